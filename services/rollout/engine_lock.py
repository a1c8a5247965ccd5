"""Exclusive use of the engine, which a running generation may lend to a weight swap at its
token boundaries (partial rollouts).

Every call that touches the engine (generation, scoring, loading, memory) *holds* it; a
weight swap *borrows* it. A borrower gets the engine once nobody holds it, or, with
``rollout.partial_rollout``, as soon as the generation holding it reaches a token boundary
and lends it (:meth:`EngineLock.lend_if_asked`): the generation waits there while the
weights are swapped, then goes on. A generation that does not lend (partial rollouts off,
or an engine that cannot stop half-way) keeps the engine to its end: the swap waits for it.

A swap waiting for the engine goes before calls that come after it, so a stream of
generations cannot hold a sync off.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class EngineLock:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False  # a call holds the engine
        self._parked = False  # ... and, a generation, waits at a token boundary right now
        self._borrowed = False  # a swap has the engine
        self._borrowers = 0  # swaps waiting for the engine or using it

    @contextmanager
    def hold(self) -> Iterator[None]:
        """The engine for one call (a generation lends it on with :meth:`lend_if_asked`)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._held and not self._borrowers)
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    @contextmanager
    def borrow(self) -> Iterator[None]:
        """The engine for a weight swap: once free, or lent by the generation holding it."""
        with self._cond:
            self._borrowers += 1
            self._cond.notify_all()  # a generation waiting at a boundary may lend now
            try:
                self._cond.wait_for(lambda: not self._borrowed and (not self._held or self._parked))
            except BaseException:
                self._borrowers -= 1
                self._cond.notify_all()
                raise
            self._borrowed = True
        try:
            yield
        finally:
            with self._cond:
                self._borrowed = False
                self._borrowers -= 1
                self._cond.notify_all()

    @property
    def swap_waiting(self) -> bool:
        return bool(self._borrowers)  # an int read: nothing else on the hot path

    def lend_if_asked(self) -> bool:
        """Called by the generation holding the engine at a token boundary: when a swap waits,
        lends it the engine and waits until every waiting swap is done. True when one ran
        (the weights may have changed: the caller reads the engine's version again)."""
        if not self._borrowers:  # an int read: nothing else on the hot path
            return False
        with self._cond:
            if not self._borrowers:
                return False
            self._parked = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._borrowers)
            self._parked = False
        return True
