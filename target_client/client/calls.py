"""What crosses from the caller threads to the I/O thread, and how a call's outcome is claimed.

Owns the commands callers append to the I/O thread's queue (``StepCall``, ``Connect``,
``PingCmd``, ``FreeCmd``, ``CloseCmd``), the I/O thread's record of a call in flight
(``Pending``), a step's outcome (``Outcome``) and the once-only claiming of futures.

Outcome race: a step's future is claimed exactly once, either by the I/O loop
(``set_running_or_notify_cancel``, here) or by the caller (``cancel`` at its deadline). A reply
whose future was cancelled is late: its drafts are dropped and counted, its acknowledgements still
update the resend buffers. The loop claims a step's future during its pass and sets the result when
the pass is over (``Wakeups``): a caller whose future is claimed waits for that (microseconds; a
caller past its deadline waits a short grace for it).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol import Phase, StepEntry
from target_client.api import DraftReply


@dataclass(slots=True, eq=False)
class Outcome:
    replies: list[DraftReply]
    outcome: str  # one of target_client.metrics.OUTCOMES


@dataclass(slots=True, eq=False)
class StepCall:
    entries: tuple[StepEntry, ...]
    taps: np.ndarray | Any | None  # host rows, or (transport cuda_ipc) a torch CUDA tensor
    deadline: float  # time.monotonic() by which the caller stops waiting
    send: bool  # False: buffer the rows only (breaker open / not ready)
    future: Future | None = None  # None: nobody waits (early taps)
    phase: Phase = Phase.WHOLE  # of every entry (``protocol.Phase``)
    # cuda_ipc with device rows: an event on the caller's stream after them (the copy waits on it)
    ready: Any = None
    commit_follows: bool = False  # early taps: the caller commits at once (``Step.commit_follows``)
    sent_at: float = 0.0  # time.monotonic() when it went out on the socket (0: not, or not yet)


@dataclass(slots=True, eq=False)
class Connect:
    future: Future | None  # None: start the handshake without waiting for it


@dataclass(slots=True, eq=False)
class PingCmd:
    future: Future
    deadline: float


@dataclass(slots=True, eq=False)
class FreeCmd:
    sessions: tuple[str, ...]


class CloseCmd:
    pass


@dataclass(slots=True, eq=False)
class Pending:
    kind: str  # "step" | "taps" (early taps: nobody waits) | "ping" (a caller's) | "probe" (the breaker's) | "hello"
    call_id: int
    deadline: float
    sent_at: float
    future: Future | None = None
    sessions: tuple[str, ...] = ()  # per sent entry
    index: tuple[int, ...] = ()  # request index per sent entry
    ks: tuple[int, ...] = ()  # k per sent entry
    local: dict[int, DraftReply] | None = None  # replies of requests held back locally
    n: int = 0  # requests in the call
    afters: tuple[int, ...] = ()  # per sent entry: the early Taps call a commit relies on (0: none)


def set_future(f: Future, value: Any) -> bool:
    """Claim ``f`` for the I/O thread and set its result; False if the caller claimed it first."""
    try:
        if f.set_running_or_notify_cancel():
            f.set_result(value)
            return True
    except RuntimeError:  # already resolved
        pass
    return False


class Wakeups:
    """Steps' outcomes claimed during a pass of the I/O loop, handed to their callers after it
    (``release``, from any thread: every outcome is set exactly once)."""

    __slots__ = ("_due",)

    def __init__(self) -> None:
        self._due: deque[tuple[Future, Outcome]] = deque()

    def resolve(self, f: Future | None, replies: list[DraftReply], outcome: str) -> bool:
        """Claim a step's future for ``replies``; False if there is none or its caller gave up already."""
        if f is None:
            return False
        try:
            if not f.set_running_or_notify_cancel():
                return False
        except RuntimeError:  # already resolved
            return False
        self._due.append((f, Outcome(replies, outcome)))
        return True

    def release(self) -> None:
        """Set the outcomes claimed so far (wakes their callers)."""
        due = self._due
        while due:
            f, out = due.popleft()
            f.set_result(out)
