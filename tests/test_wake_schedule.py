"""When the loop wakes next, decided in one place (loop/passes.py, WakeSchedule)."""

from __future__ import annotations

from nodeagent.host.gatefile import RENEW_S
from nodeagent.loop.passes import PASS_RETRY_S, WakeSchedule


def test_a_pass_is_due_at_the_resync_when_no_guard_asks_sooner() -> None:
    s = WakeSchedule(now=100.0, resync_s=30.0)
    s.passed(None)
    assert s.next_wake(100.0, beat=False) == (130.0, 30.0)


def test_a_guards_wake_at_comes_before_the_resync() -> None:
    s = WakeSchedule(now=100.0, resync_s=30.0)
    s.passed(104.5)  # e.g. a retry backoff
    assert s.next_wake(101.0, beat=False) == (104.5, 3.5)
    s.passed(500.0)  # later than the resync: the resync still comes first
    assert s.next_wake(101.0, beat=False) == (130.0, 29.0)


def test_a_beat_wakes_the_loop_every_renewal_without_moving_the_deadline() -> None:
    s = WakeSchedule(now=0.0, resync_s=30.0)
    deadline, wait = s.next_wake(0.0, beat=True)
    assert deadline == 30.0 and wait == RENEW_S
    deadline, wait = s.next_wake(29.9, beat=True)
    assert deadline == 30.0 and 0 < wait < RENEW_S  # never past the deadline
    assert s.next_wake(31.0, beat=True)[1] == 0.0  # overdue: no wait at all


def test_a_failed_pass_is_tried_again_soon_and_never_after_the_resync() -> None:
    s = WakeSchedule(now=0.0, resync_s=30.0)
    s.failed(10.0)
    assert s.next_wake(10.0, beat=False) == (10.0 + PASS_RETRY_S, PASS_RETRY_S)
    short = WakeSchedule(now=0.0, resync_s=2.0)
    short.failed(1.0)
    assert short.next_wake(1.0, beat=False)[0] == 2.0  # the resync is sooner than a retry


def test_the_resync_is_rescheduled_once_it_came_due() -> None:
    s = WakeSchedule(now=0.0, resync_s=30.0)
    s.passed(None)
    s.after(29.0)
    assert s.next_wake(29.0, beat=False)[0] == 30.0  # not due yet: unchanged
    s.after(31.0)
    assert s.next_wake(31.0, beat=False)[0] == 61.0
