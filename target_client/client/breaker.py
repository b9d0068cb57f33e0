"""The client's circuit breaker: when to stop sending steps, and when to probe the server.

Owns ``Breaker``: explicit state, miss counting and the probe schedule. Pure logic: no socket,
no metrics, no logging, no clock of its own (``now`` is passed in, ``time.monotonic()`` seconds).
Only the I/O thread touches it; it acts on what the methods return (send a probe, log, recompute
the step gate). States:

* CLOSED: steps are sent. ``failures`` consecutive misses (timeout, error, failed send) open it.
* OPEN: steps return empty drafts at once and probe Pings go out on the schedule below; a
  healthy Pong moves it to HALF_OPEN.
* HALF_OPEN (a trial): steps are sent again, but the next miss reopens it; the first on-time
  step reply closes it and resets everything below.

Probe schedule while OPEN: every ``backoff_ms``. While fast probing is on and an engine keeps
stepping (a step within ``ACTIVE_S``), every ``step_probe_ms`` instead, and a step that finds it
open asks for a probe at once unless one went out within ``step_probe_ms``. A failed trial (the
server answers pings but misses steps: alive but slow) turns fast probing off and the next probe
waits 50 ms, doubling with every further failed trial up to ``backoff_ms``.

Restart forgiveness: a server that just (re)started (new epoch) may miss its very first steps
(cold caches, every session new at once). Fast probing is back on, and until a step succeeds a
trial tolerates one more miss before reopening, and a failed trial keeps fast probing (once: a
restarted server that stays slow gets the backoff).
"""

from __future__ import annotations

import enum
import math

# While the breaker is open and a step came within this long, probes go out every
# step_probe_ms instead of every backoff_ms (a lost probe is retried at once).
ACTIVE_S = 0.25
# After a failed half-open trial the next probe waits this long, doubling with every further
# failed trial up to backoff_ms. A server catching up on a backlog (after SIGCONT: every row that
# queued during the pause) is answering again tens of ms later; a flat 500 ms backoff cost about
# 17 engine steps without drafts there (draft-soak).
TRIAL_BACKOFF_FIRST_MS = 50.0


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"  # closed by a healthy Pong; no step has succeeded since


CLOSED = BreakerState.CLOSED
OPEN = BreakerState.OPEN
HALF_OPEN = BreakerState.HALF_OPEN


class Breaker:
    """Circuit breaker state of one client (I/O thread only). See the module docstring."""

    __slots__ = (
        "backoff_ms",
        "failures",
        "fast_probe",
        "last_probe_at",
        "last_step_at",
        "misses",
        "next_probe_at",
        "probe_due",
        "probe_ms",
        "restart_grace",
        "state",
        "step_probe_ms",
        "trial_backoff_first_ms",
        "trial_backoff_ms",
    )

    def __init__(self, failures: int, backoff_ms: float, step_probe_ms: float) -> None:
        self.failures = failures  # consecutive misses that open a closed breaker
        self.backoff_ms = backoff_ms  # the slow probe period (and the cap of the trial backoff)
        self.step_probe_ms = step_probe_ms  # the fast probe period (0: no fast probing)
        self.state = CLOSED
        self.misses = 0
        # Fast probing (step_probe_ms) finds a server that was unreachable or restarted; a server
        # that answers pings but still misses steps gets the slow probe period instead.
        self.fast_probe = True
        self.probe_ms = backoff_ms  # the probe period when not fast probing
        self.trial_backoff_first_ms = min(TRIAL_BACKOFF_FIRST_MS, backoff_ms)
        self.trial_backoff_ms = self.trial_backoff_first_ms  # the probe period after the next failed trial
        self.restart_grace = False  # the server restarted and no step has succeeded since
        self.probe_due = False  # a probe Ping should go out as soon as the socket is writable
        self.next_probe_at = math.inf
        self.last_probe_at = -math.inf
        self.last_step_at = -math.inf  # when a caller last stepped (the engine is active)

    @property
    def is_open(self) -> bool:
        return self.state is OPEN

    # -- outcomes

    def miss(self, now: float) -> bool:
        """A step missed (timeout, error, failed send). True when this opened the breaker."""
        self.misses += 1
        if self.state is OPEN or self.misses < self.failures:
            return False
        trial = self.state is HALF_OPEN
        # a failed half-open trial: the server is slow, back off (unless it has just restarted)
        self.fast_probe = not trial or self.restart_grace
        self.probe_ms = self.backoff_ms
        if trial:
            self.restart_grace = False  # used up: a restarted server that stays slow gets the backoff
            if not self.fast_probe:  # the backoff starts short and doubles with each failed trial
                self.probe_ms = self.trial_backoff_ms
                self.trial_backoff_ms = min(2.0 * self.trial_backoff_ms, self.backoff_ms)
        self.state = OPEN
        self.probe_due = False
        self.next_probe_at = now + self.probe_ms / 1000.0
        return True

    def success(self) -> bool:
        """An on-time step reply: everything is forgiven. True when this closed an open breaker
        (a call that was in flight when the breaker opened came back in time)."""
        was_open = self.state is OPEN
        self.misses = 0
        self.fast_probe = True
        self.trial_backoff_ms = self.trial_backoff_first_ms
        self.restart_grace = False
        self.state = CLOSED
        if was_open:
            self.probe_due = False
        return was_open

    def pong(self) -> bool:
        """A healthy Pong. True when this moved an open breaker to HALF_OPEN (a trial)."""
        if self.state is not OPEN:
            return False
        self.state = HALF_OPEN
        self.probe_due = False
        # the first miss of the trial reopens at once (the second after a restart)
        self.misses = self.failures - 1
        if self.restart_grace:
            self.misses = max(0, self.failures - 2)
        return True

    def restarted(self) -> None:
        """The server restarted (new epoch): it deserves a fast look again, and some forgiveness."""
        self.fast_probe = True
        self.restart_grace = True

    def reset(self) -> None:
        """A refusal was lifted (a matching Welcome): an open breaker closes and misses are
        forgotten. A running trial stays a trial, and a probe already due still goes out."""
        if self.state is OPEN:
            self.state = CLOSED
        self.misses = 0

    # -- probe schedule

    def stepped(self, now: float) -> None:
        """A caller stepped (sent or not)."""
        self.last_step_at = now

    def gated_step(self, now: float, hello_pending: bool) -> None:
        """A step was not sent: if the breaker is open, probe now unless a probe went out very
        recently (fast probing only; never while a Hello is pending, which probes by itself)."""
        gap = self.step_probe_ms / 1000.0
        if gap and self.fast_probe and self.state is OPEN and not hello_pending and now - self.last_probe_at >= gap:
            self.probe_due = True

    def tick(self, now: float, hello_pending: bool) -> None:
        """Timers: a probe is due when the probe period has passed."""
        if self.state is OPEN and not hello_pending and not self.probe_due and now >= self.next_probe_at:
            self.probe_due = True

    def probe_sent(self, now: float) -> float:
        """A probe goes out now (whether the send succeeds or not); returns when the next is due,
        which is also the deadline of this one."""
        self.probe_due = False
        period = self.probe_ms
        if self.fast_probe and self.step_probe_ms and now - self.last_step_at < ACTIVE_S:
            period = min(period, self.step_probe_ms)  # an active engine: probe fast
        self.next_probe_at = now + period / 1000.0
        self.last_probe_at = now
        return self.next_probe_at

    def wake_at(self) -> float:
        """When the I/O thread must wake for the next probe (inf: no timer)."""
        return self.next_probe_at if (self.state is OPEN and not self.probe_due) else math.inf
