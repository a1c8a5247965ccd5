"""The engine lock: a swap borrows the engine once it is free, or from a generation that
lends it at a token boundary; nothing else ever overlaps."""

from __future__ import annotations

import threading
import time

import pytest

from services.rollout.engine_lock import EngineLock

pytestmark = pytest.mark.timeout(30)


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_swap_waits_for_a_call_that_does_not_lend():
    lock, events = EngineLock(), []
    holding, release = threading.Event(), threading.Event()

    def call():
        with lock.hold():
            holding.set()
            release.wait(10)
            events.append("call ends")

    def swap():
        with lock.borrow():
            events.append("swap")

    a = _in_thread(call)
    holding.wait(10)
    b = _in_thread(swap)
    time.sleep(0.1)
    assert events == []  # the swap waits
    release.set()
    a.join(10), b.join(10)
    assert events == ["call ends", "swap"]


def test_a_generation_lends_the_engine_at_a_boundary_and_waits_for_the_swap():
    lock, events = EngineLock(), []
    swap_waiting = threading.Event()

    def generation():
        with lock.hold():
            assert not lock.lend_if_asked()  # nobody asks: goes on at once
            swap_waiting.wait(10)
            while not lock.lend_if_asked():  # the next boundaries, until the swap asks
                time.sleep(0.001)
            events.append("generation goes on")

    def swap():
        with lock.borrow():
            events.append("swap starts")
            time.sleep(0.05)
            events.append("swap ends")

    g = _in_thread(generation)
    s = _in_thread(swap)
    swap_waiting.set()
    g.join(10), s.join(10)
    assert events == ["swap starts", "swap ends", "generation goes on"]


def test_calls_that_come_after_a_waiting_swap_go_after_it():
    lock, events = EngineLock(), []
    holding, release = threading.Event(), threading.Event()

    def first():
        with lock.hold():
            holding.set()
            release.wait(10)

    def later_call():
        with lock.hold():
            events.append("later call")

    def swap():
        with lock.borrow():
            events.append("swap")

    a = _in_thread(first)
    holding.wait(10)
    s = _in_thread(swap)
    while not lock._borrowers:  # the swap is waiting
        time.sleep(0.001)
    c = _in_thread(later_call)
    time.sleep(0.05)
    release.set()
    for t in (a, s, c):
        t.join(10)
    assert events == ["swap", "later call"]
