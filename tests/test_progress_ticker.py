"""A wait that says how it goes every few seconds, and never fails because of it."""

from __future__ import annotations

import time

from meshrl.progress_ticker import ProgressTicker


def test_it_says_every_period_while_the_wait_lasts_and_nothing_after():
    said: list[str] = []
    with ProgressTicker(lambda s: f"{s:.1f} s", said.append, every_s=0.1):
        time.sleep(0.55)
    count = len(said)
    time.sleep(0.25)
    assert 3 <= count == len(said), "about five lines, and none once the wait is over"


def test_a_describer_that_fails_or_has_nothing_to_say_is_skipped():
    calls = iter([None, "", ValueError("boom"), "fine"])

    def describe(_: float) -> str | None:
        value = next(calls, None)
        if isinstance(value, Exception):
            raise value
        return value

    said: list[str] = []
    with ProgressTicker(describe, said.append, every_s=0.05):
        time.sleep(0.4)
    assert said == ["fine"]
