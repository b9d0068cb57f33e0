"""Unit tests of the client's circuit breaker (target_client.client.breaker): pure logic, no sockets."""

from __future__ import annotations

import math

import pytest

from target_client.client.breaker import ACTIVE_S, Breaker, BreakerState

FAILURES = 3
BACKOFF_MS = 500.0
STEP_PROBE_MS = 10.0


def make(failures: int = FAILURES, backoff_ms: float = BACKOFF_MS, step_probe_ms: float = STEP_PROBE_MS) -> Breaker:
    return Breaker(failures, backoff_ms, step_probe_ms)


def open_breaker(b: Breaker, now: float = 0.0) -> None:
    """Miss until the breaker opens (from closed or half-open)."""
    assert b.state is not BreakerState.OPEN
    for _ in range(b.failures + 1):
        if b.miss(now):
            break
    assert b.state is BreakerState.OPEN


def fail_trial(b: Breaker, now: float = 0.0) -> None:
    """An open breaker goes half-open on a pong, then its trial step misses."""
    assert b.pong()
    assert b.state is BreakerState.HALF_OPEN
    open_breaker(b, now)


# ---------------------------------------------------------------- state transitions


def test_starts_closed_and_opens_on_the_nth_consecutive_miss() -> None:
    b = make()
    assert b.state is BreakerState.CLOSED and not b.is_open
    assert [b.miss(1.0) for _ in range(FAILURES - 1)] == [False] * (FAILURES - 1)
    assert b.state is BreakerState.CLOSED
    assert b.miss(1.0) is True  # the failures-th miss opens it, reported once
    assert b.state is BreakerState.OPEN and b.is_open
    assert b.misses == FAILURES
    assert b.next_probe_at == pytest.approx(1.0 + BACKOFF_MS / 1000.0)  # a breaker opened from closed: slow period
    assert b.fast_probe and b.probe_ms == BACKOFF_MS
    assert b.miss(1.1) is False and b.state is BreakerState.OPEN  # already open: not reported again
    assert b.misses == FAILURES + 1


def test_a_success_between_misses_resets_the_count() -> None:
    b = make()
    for _ in range(FAILURES - 1):
        b.miss(0.0)
    assert b.success() is False  # it was not open
    assert b.misses == 0
    assert [b.miss(0.0) for _ in range(FAILURES - 1)] == [False] * (FAILURES - 1)
    assert b.state is BreakerState.CLOSED


def test_pong_half_opens_only_an_open_breaker() -> None:
    b = make()
    assert b.pong() is False and b.state is BreakerState.CLOSED
    open_breaker(b)
    b.probe_due = True
    assert b.pong() is True
    assert b.state is BreakerState.HALF_OPEN and not b.is_open
    assert not b.probe_due
    assert b.misses == FAILURES - 1
    assert b.pong() is False and b.state is BreakerState.HALF_OPEN  # a second pong changes nothing


def test_half_open_reopens_on_the_first_miss() -> None:
    b = make()
    open_breaker(b)
    b.pong()
    assert b.miss(2.0) is True
    assert b.state is BreakerState.OPEN


def test_half_open_closes_on_the_first_success() -> None:
    b = make()
    open_breaker(b)
    b.pong()
    assert b.success() is False  # closing a trial is not closing an open breaker
    assert b.state is BreakerState.CLOSED and b.misses == 0
    assert [b.miss(0.0) for _ in range(FAILURES - 1)] == [False] * (FAILURES - 1)  # the full count again
    assert b.miss(0.0) is True


def test_success_while_open_closes_it() -> None:
    """A call in flight when the breaker opened comes back in time."""
    b = make()
    open_breaker(b)
    b.probe_due = True
    assert b.success() is True
    assert b.state is BreakerState.CLOSED and b.misses == 0 and not b.probe_due


def test_reset_closes_an_open_breaker_and_keeps_a_trial() -> None:
    b = make()
    open_breaker(b)
    b.reset()
    assert b.state is BreakerState.CLOSED and b.misses == 0
    open_breaker(b)
    b.pong()
    b.reset()
    assert b.state is BreakerState.HALF_OPEN and b.misses == 0
    # still a trial: when it opens after the full count, that is a failed trial (backoff)
    open_breaker(b)
    assert not b.fast_probe and b.probe_ms == 50.0


# ---------------------------------------------------------------- backoff after failed trials


def test_failed_trials_back_off_from_50_ms_doubling_up_to_the_backoff() -> None:
    b = make()
    open_breaker(b, 0.0)
    periods = []
    for i in range(7):
        now = float(i + 1)
        b.pong()
        assert b.miss(now) is True
        assert not b.fast_probe  # the server answers pings but misses steps: slow probes only
        assert b.next_probe_at == pytest.approx(now + b.probe_ms / 1000.0)
        periods.append(b.probe_ms)
    assert periods == [50.0, 100.0, 200.0, 400.0, 500.0, 500.0, 500.0]


def test_a_success_resets_the_trial_backoff_and_fast_probing() -> None:
    b = make()
    open_breaker(b)
    fail_trial(b)
    fail_trial(b)
    assert b.probe_ms == 100.0 and not b.fast_probe
    b.pong()
    b.success()
    assert b.fast_probe
    open_breaker(b)  # from closed: fast probing, slow period = backoff
    assert b.fast_probe and b.probe_ms == BACKOFF_MS
    fail_trial(b)
    assert b.probe_ms == 50.0  # the doubling starts over


def test_opening_from_closed_does_not_advance_the_trial_backoff() -> None:
    b = make()
    open_breaker(b)
    fail_trial(b)
    assert b.probe_ms == 50.0
    b.reset()  # closed without a success (a lifted refusal)
    open_breaker(b)
    assert b.fast_probe and b.probe_ms == BACKOFF_MS
    fail_trial(b)
    assert b.probe_ms == 100.0  # continues where it was: only a success resets it


def test_a_backoff_below_50_ms_caps_the_first_trial_backoff() -> None:
    b = make(backoff_ms=20.0)
    open_breaker(b)
    fail_trial(b)
    assert b.probe_ms == 20.0
    fail_trial(b)
    assert b.probe_ms == 20.0


# ---------------------------------------------------------------- restart forgiveness


def test_after_a_restart_a_trial_tolerates_one_more_miss() -> None:
    b = make()
    open_breaker(b)
    b.restarted()
    assert b.pong() is True
    assert b.misses == FAILURES - 2
    assert b.miss(0.0) is False and b.state is BreakerState.HALF_OPEN  # forgiven once
    assert b.miss(0.0) is True and b.state is BreakerState.OPEN


def test_after_a_restart_a_failed_trial_keeps_fast_probing_once() -> None:
    b = make()
    open_breaker(b)
    fail_trial(b)  # a slow server: backoff
    assert not b.fast_probe
    b.restarted()
    assert b.fast_probe  # a restarted server deserves a fast look again
    fail_trial(b)
    assert b.fast_probe and b.probe_ms == BACKOFF_MS and not b.restart_grace  # forgiven, grace used up
    assert b.pong() and b.misses == FAILURES - 1  # no extra miss any more
    assert b.miss(0.0) is True
    assert not b.fast_probe and b.probe_ms == 100.0  # the backoff goes on where it was


def test_a_success_ends_the_restart_grace() -> None:
    b = make()
    b.restarted()
    assert b.restart_grace
    b.success()
    assert not b.restart_grace
    open_breaker(b)
    b.pong()
    assert b.misses == FAILURES - 1


def test_restart_grace_with_a_single_failure_threshold() -> None:
    b = make(failures=1)
    assert b.miss(0.0) is True
    b.restarted()
    b.pong()
    assert b.misses == 0
    assert b.miss(0.0) is True  # one miss is the threshold: nothing left to forgive


# ---------------------------------------------------------------- probe schedule


def test_timer_makes_a_probe_due_only_when_open_and_no_hello_is_pending() -> None:
    b = make()
    b.tick(100.0, hello_pending=False)
    assert not b.probe_due and b.wake_at() == math.inf  # closed: no timer
    open_breaker(b, 0.0)
    assert b.wake_at() == pytest.approx(BACKOFF_MS / 1000.0)
    b.tick(0.1, hello_pending=False)
    assert not b.probe_due  # not yet
    b.tick(0.5, hello_pending=True)
    assert not b.probe_due  # the Hello probes by itself
    b.tick(0.5, hello_pending=False)
    assert b.probe_due and b.wake_at() == math.inf


def test_probe_period_is_fast_while_the_engine_steps() -> None:
    b = make()
    open_breaker(b, 0.0)
    b.stepped(10.0)
    assert b.probe_sent(10.0 + ACTIVE_S / 2) == pytest.approx(10.0 + ACTIVE_S / 2 + STEP_PROBE_MS / 1000.0)
    assert not b.probe_due and b.last_probe_at == pytest.approx(10.0 + ACTIVE_S / 2)
    # an idle engine: the slow period
    assert b.probe_sent(10.0 + 2 * ACTIVE_S) == pytest.approx(10.0 + 2 * ACTIVE_S + BACKOFF_MS / 1000.0)


def test_probe_period_after_a_failed_trial_ignores_activity() -> None:
    b = make()
    open_breaker(b)
    fail_trial(b, 5.0)
    b.stepped(5.0)
    assert b.probe_sent(5.0) == pytest.approx(5.0 + 0.050)  # the trial backoff, not step_probe_ms


def test_probe_period_without_fast_probing_configured() -> None:
    b = make(step_probe_ms=0.0)
    open_breaker(b)
    b.stepped(1.0)
    assert b.probe_sent(1.0) == pytest.approx(1.0 + BACKOFF_MS / 1000.0)
    b.gated_step(2.0, hello_pending=False)
    assert not b.probe_due


def test_a_gated_step_asks_for_a_probe_unless_one_went_out_recently() -> None:
    b = make()
    b.gated_step(1.0, hello_pending=False)
    assert not b.probe_due  # closed (e.g. not ready): no probe
    open_breaker(b, 1.0)
    b.probe_sent(1.0)
    b.gated_step(1.0 + STEP_PROBE_MS / 2000.0, hello_pending=False)
    assert not b.probe_due  # the last probe is too recent
    b.gated_step(1.0 + STEP_PROBE_MS / 1000.0, hello_pending=True)
    assert not b.probe_due  # a Hello is pending
    b.gated_step(1.0 + STEP_PROBE_MS / 1000.0, hello_pending=False)
    assert b.probe_due


def test_a_gated_step_asks_for_no_probe_after_a_failed_trial() -> None:
    b = make()
    open_breaker(b)
    fail_trial(b)
    b.gated_step(100.0, hello_pending=False)
    assert not b.probe_due


def test_opening_cancels_a_due_probe_and_schedules_the_next() -> None:
    b = make()
    b.probe_due = True  # e.g. left over from before a lifted refusal
    open_breaker(b, 3.0)
    assert not b.probe_due
    assert b.wake_at() == pytest.approx(3.0 + BACKOFF_MS / 1000.0)
