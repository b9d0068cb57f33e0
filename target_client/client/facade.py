"""DraftClient: the target engine's thin client of the draft server (the public API only).

Owns what callers see: the constructor, ``connect``, ``step``/``astep``, ``send_taps`` and
``commit`` (early taps), ``free``, ``ping``, ``stats``, ``close`` and the read-only properties.
Everything else is in the parts:

* ``io_loop.IoLoop``: the ZeroMQ DEALER socket and the loop around it (the vLLM ``core_client``
  shape): whoever holds its lock runs a pass over the socket. A caller's command is one such pass
  in the caller's own thread when the lock is free (else the I/O thread's), and a caller waiting
  in ``step()`` watches the socket itself, so a step's send and its reply take no hop through the
  I/O thread; replies resolve per-call futures keyed by call id (``calls``: commands, futures,
  outcomes);
* ``handshake.Handshake``: Hello/Welcome, the pinned contract, refusals, epochs;
* ``breaker.Breaker``: when to stop sending and when to probe;
* ``step_builder``: argument checks (caller side) and Step messages with resend rows merged in
  (I/O side), over the resend buffers of ``resend``;
* ``counters.Counters``: metrics and the counts behind ``stats()``.

Callers, from any thread or from asyncio tasks, validate their own arguments locally and never
hold a lock across a wait: the loop's lock covers one pass of non-blocking socket calls, which is
how the socket moves between threads (ZeroMQ asks for a full memory barrier there, which a mutex
is). Every wait has a deadline. ``step()`` blocks at most its budget and never raises for a draft-side fault (server
down, slow, restarted, overloaded, garbage, another model): it returns empty drafts for the
requests it could not serve and counts why. ``ValueError`` is raised only for caller bugs,
checked with ``protocol.validate`` before anything is sent.

Early taps (``protocol.Phase``; only when the server's Welcome lists ``FEATURE_EARLY_TAPS``, see
``early_taps``): ``send_taps`` hands the rows of a verify step to the I/O thread and returns at
once, right after the target's forward; ``commit`` then asks for the drafts with entries of no
rows (``pos`` = the committed context end), a few bytes on the critical path. The rows stay in
the resend buffer until the Taps call's reply acknowledges them; a commit never carries rows
that Taps call is still carrying, but does once it failed, and the next step does after a
MISSING_ROWS answer. Without the feature, or for a span over ``ClientConfig.early_taps_max_mib``
whose rows travel in frames, ``send_taps`` returns False and the caller sends the single message
with ``step()``.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from protocol import FEATURE_EARLY_TAPS, ModelContract, Phase, Pong, ServerLimits, Timing, Welcome
from protocol.wire import RowLayout
from target_client.api import (
    ClientConfig,
    ConnectTimeoutError,
    DraftClientError,
    DraftReply,
    StepRequest,
    empty_replies,
)
from target_client.client.calls import Connect, FreeCmd, Outcome, PingCmd, StepCall
from target_client.client.counters import Counters
from target_client.client.io_loop import IoLoop, random_routing_id
from target_client.client.step_builder import check_budget, prepare

_RESULT_GRACE_S = 0.002  # a result the I/O thread has claimed is set within microseconds


class DraftClient:
    """Client of one draft server endpoint. Thread-safe and asyncio-safe; see the module docstring.

    The taps array given to ``step``/``astep`` is kept by REFERENCE (no copy) until the server
    acknowledges its rows (or they fall out of the resend bound, or the session is freed): the
    caller must not mutate it afterwards. Allocate a fresh array per step.
    """

    def __init__(self, cfg: ClientConfig) -> None:
        self.cfg = cfg
        self.routing_id = cfg.routing_id or random_routing_id()
        self._counters = Counters(cfg.registry)
        self._counters.m.budget.set(cfg.budget_ms / 1000.0)
        self._close_lock = threading.Lock()
        self._closed = False
        self._connect_requested = False
        self._device_rows = cfg.transport == "cuda_ipc"  # step() takes torch CUDA tensors
        self._taps_declined = 0  # early taps declined for their size (send_taps: the single message instead)
        device = None
        if self._device_rows:  # the buffer's device: the caller thread's, unless configured
            from target_client.cuda.ipc import current_device  # torch, only for a cuda_ipc client

            device = cfg.cuda_device if cfg.cuda_device >= 0 else current_device()
        # Makes the socket (ValueError for a bad endpoint), pays pyzmq's zero-copy set-up, starts the thread.
        self._io = IoLoop(cfg, self.routing_id, self._counters, device)

    # ------------------------------------------------------------------ properties

    @property
    def welcome(self) -> Welcome | None:
        """The verified Welcome (None before the first handshake)."""
        return self._io.handshake.welcome

    @property
    def contract(self) -> ModelContract | None:
        """The model contract verified at the handshake (None before it)."""
        w = self._io.handshake.welcome
        return w.contract if w is not None else None

    @property
    def limits(self) -> ServerLimits | None:
        w = self._io.handshake.welcome
        return w.limits if w is not None else None

    @property
    def epoch(self) -> str | None:
        return self._io.handshake.epoch

    @property
    def row_layout(self) -> RowLayout | None:
        """(dtype, width) of the rows step() takes in this client's wire format (None until known)."""
        return self._io.handshake.layout

    @property
    def advised_k(self) -> int:
        """The server's latest load-aware k advice (-1: none)."""
        return self._io.advised_k

    @property
    def early_taps(self) -> bool:
        """Whether the server takes early taps and commits (its Welcome lists FEATURE_EARLY_TAPS)."""
        w = self._io.handshake.welcome
        return w is not None and FEATURE_EARLY_TAPS in w.features

    @property
    def gate(self) -> str | None:
        """None while steps are sent; else why a step returns at once without drafts: "not_ready"
        (no verified Welcome yet), "breaker_open" (misses, or a refused contract), "closed"."""
        return "closed" if self._closed else self._io.gate

    @property
    def breaker_open(self) -> bool:
        return self._io.gate == "breaker_open"

    @property
    def last_timing(self) -> Timing | None:
        """Server timing of the latest on-time StepResult (None before one)."""
        return self._io.last_timing

    @property
    def budget_ms(self) -> float:
        """The default budget of a step: fixed, or adaptive when configured and warmed up."""
        a = self._io.budget.ms
        return a if (self.cfg.adaptive_budget and a is not None) else self.cfg.budget_ms

    # ------------------------------------------------------------------ calls

    def connect(self, wait: bool = True) -> Welcome | None:
        """Hello/Welcome handshake.

        wait=True: the verified Welcome, or ContractMismatchError (the server serves another
        contract or protocol version), or ConnectTimeoutError after ``connect_timeout_s`` (the
        client keeps trying in the background either way). wait=False: None at once; the
        handshake goes on in the background and steps return empty drafts until it succeeds.
        """
        if self._closed or self._io.gate == "closed":
            raise DraftClientError("client is closed (or its I/O thread failed; see the log)")
        self._connect_requested = True
        fut: Future | None = Future() if wait else None
        self._io.submit(Connect(fut))
        if fut is None:
            return None
        try:
            return fut.result(timeout=self.cfg.connect_timeout_s)
        except FutureTimeout:
            fut.cancel()
            raise ConnectTimeoutError(
                f"no Welcome from draft server {self.cfg.endpoint} within {self.cfg.connect_timeout_s} s "
                "(still trying in the background)"
            ) from None

    def step(
        self, requests: Sequence[StepRequest], taps: np.ndarray | None, budget_ms: float | None = None
    ) -> list[DraftReply]:
        """Drafts for one engine step: one DraftReply per request, in order, within the budget.

        ``taps``: C-contiguous [sum(rows), width] rows of the client's wire format in their wire
        storage dtype (bf16: [rows, contract.tap_width] uint16 bit patterns; see ``row_layout``
        and ``target_client.vllm.wire``), or None when no request has rows. With transport
        cuda_ipc it may be a contiguous torch CUDA tensor (bf16 as torch.bfloat16), copied device to
        device after the caller's current stream has written it. Kept by reference until
        acknowledged: do not mutate it afterwards.
        """
        return self.submit_step(requests, taps, budget_ms).collect()

    def submit_step(
        self,
        requests: Sequence[StepRequest],
        taps: np.ndarray | None,
        budget_ms: float | None = None,
        t0: float | None = None,
    ) -> StepTicket:
        """step() in two halves, for a caller that waits on several clients at once
        (``target_client.fleet``): the step goes out now; ``collect()`` on the ticket waits for
        it, at most until its deadline (``t0``, default now, plus the budget). ValueError for a
        caller bug, as step()."""
        t0 = time.monotonic() if t0 is None else t0
        call = self._begin(requests, taps, budget_ms, t0)
        if isinstance(call, StepCall):
            self._io.submit(call)
            return StepTicket(self, t0, call)
        ticket = StepTicket(self, t0, None)  # answered without waiting
        ticket.replies, ticket.outcome = call
        return ticket

    def send_taps(
        self,
        requests: Sequence[StepRequest],
        taps: np.ndarray | None,
        budget_ms: float | None = None,
        exact: bool = False,
        commit_follows: bool = False,
    ) -> bool:
        """Early taps: the rows of a verify step (requests with ``k=0``, the span's rows by position,
        rejected ones included), sent by the I/O thread without waiting; acknowledged within the
        budget or resent. False, with nothing sent or kept, when the server lacks early taps
        (``early_taps``), or when the span is larger than ``early_taps_max_mib`` and travels in
        frames: send the step's accepted rows with ``step()``. ``exact``: the caller knows the span
        holds only rows the step will commit (predicted commits), so it carries no more bytes than
        the single message would: never declined for its size. ``commit_follows``: the caller sends
        commits for (some of) these rows at once, before its sampling (predicted commits): the server
        waits a moment for them instead of ingesting the rows alone first (``Step.commit_follows``).
        ValueError for a caller bug.
        ``taps`` is kept by reference, as in ``step()``."""
        if not self.takes_taps(taps, exact):
            return False
        budget = self.budget_ms if budget_ms is None else check_budget(budget_ms)
        hs = self._io.handshake
        welcome = hs.welcome
        limits = welcome.limits if welcome is not None else None
        entries, taps = prepare(requests, taps, hs.pinned, limits, hs.layout, Phase.TAPS, self._device_rows)
        if entries and self._call_gate() != "closed":
            deadline = time.monotonic() + budget / 1000.0
            call = StepCall(entries, taps, deadline, send=self._io.gate is None, phase=Phase.TAPS)
            call.ready = self._ready(taps)
            call.commit_follows = commit_follows
            self._io.submit(call)
        return True

    def takes_taps(self, taps: Any, exact: bool = False) -> bool:
        """Whether ``send_taps`` would send these rows now: the server takes early taps and the span
        is ``exact`` or not too large for the transport (a decline is counted in ``early_taps_declined``)."""
        if not self.early_taps:
            return False
        if not exact and self._span_too_large(taps):
            self._taps_declined += 1
            return False
        return True

    def _span_too_large(self, taps: Any) -> bool:
        """A span over ``early_taps_max_mib`` whose rows would travel in the socket's frames."""
        limit, hs = self.cfg.early_taps_max_mib, self._io.handshake
        if limit <= 0 or taps is None or not hs.shm_off or hs.cuda:
            return False
        return int(getattr(taps, "nbytes", 0)) > limit * (1 << 20)

    def claim_rows(self, nbytes: int, pin: Any = None) -> np.ndarray | None:
        """Room for a step's rows in the server's view already: a writable uint8 array of ``nbytes``
        in the shared-memory ring (transport shm, mapped by the server), or None (another
        transport, not connected, the ring full). Write the rows into it (a view of it in wire
        storage, e.g. ``.view(np.uint16).reshape(rows, width)``) and pass that view as the taps of
        ``send_taps``/``step``: the I/O thread sends them where they lie, without the copy into the
        ring. The region is reused once no view of it lives and the server is done with it.
        ``pin(address, nbytes)``: page-locks the ring once (a device-to-host copy into it then runs
        at the bus's speed) and returns what undoes it; when it raises, claims return None from
        then on. Any thread."""
        ring = self._io.handshake.rows_ring
        if ring is None or self._closed or not hasattr(ring, "claim"):
            return None
        return ring.claim(nbytes, pin)

    def commit(self, requests: Sequence[StepRequest], budget_ms: float | None = None) -> list[DraftReply]:
        """Drafts after early taps: ``step()`` with entries of no rows at ``pos`` = the committed
        context end (the anchor's position). The server drafts from the rows below ``pos`` it
        holds, or answers ``Status.MISSING_ROWS`` (no drafts) when it lacks some."""
        return self.submit_commit(requests, budget_ms).collect()

    def submit_commit(
        self, requests: Sequence[StepRequest], budget_ms: float | None = None, t0: float | None = None
    ) -> StepTicket:
        """commit() in two halves, as ``submit_step`` is step()'s."""
        t0 = time.monotonic() if t0 is None else t0
        call = self._begin(requests, None, budget_ms, t0, Phase.COMMIT)
        if isinstance(call, StepCall):
            self._io.submit(call)
            return StepTicket(self, t0, call)
        ticket = StepTicket(self, t0, None)
        ticket.replies, ticket.outcome = call
        return ticket

    async def astep(
        self, requests: Sequence[StepRequest], taps: np.ndarray | None, budget_ms: float | None = None
    ) -> list[DraftReply]:
        """step() for asyncio callers: never blocks the event loop."""
        t0 = time.monotonic()
        call = self._begin(requests, taps, budget_ms, t0)
        if not isinstance(call, StepCall):
            return call[0]  # answered without waiting
        fut = call.future
        assert fut is not None
        afut = asyncio.wrap_future(fut)
        self._io.submit(call)
        try:
            await asyncio.wait((afut,), timeout=max(0.0, call.deadline - time.monotonic()))
        except asyncio.CancelledError:
            fut.cancel()
            raise
        return self._end(t0, call, fut.result() if fut.done() and not fut.cancelled() else None)

    def nudge(self) -> None:
        """An engine is stepping although none of its steps comes here (a fleet moved its sessions
        to other servers): while the breaker is open, probe at the fast step-probe period, as for
        a step that finds it open, so that a server that is back is found within a step or two."""
        if not self._closed and self._io.gate == "breaker_open":
            self._io.submit(StepCall((), None, time.monotonic(), send=False))

    def free(self, sessions: Iterable[str]) -> None:
        """Release sessions on the server (fire-and-forget) and drop their client-side state."""
        names = tuple(sessions)
        if not names or self._closed or self._io.gate == "closed":
            return
        self._io.submit(FreeCmd(names))

    def ping(self, timeout_ms: float = 100.0) -> Pong | None:
        """A Pong from the server within ``timeout_ms``, else None."""
        if not (math.isfinite(timeout_ms) and timeout_ms > 0):
            raise ValueError(f"timeout_ms must be finite and > 0, got {timeout_ms}")
        if self._closed or self._io.gate == "closed":
            return None
        deadline = time.monotonic() + timeout_ms / 1000.0
        fut: Future = Future()
        self._io.submit(PingCmd(fut, deadline))
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except (FutureTimeout, FutureCancelled):
            fut.cancel()
            return None

    def stats(self) -> dict[str, Any]:
        """Counters and state for tests and logs."""
        d = self._counters.snapshot()
        io = self._io
        hs = io.handshake
        gate = io.gate
        d.update(
            breaker_state="open" if gate == "breaker_open" else ("closed" if gate != "closed" else "shut"),
            gate=gate or "open_for_steps",
            welcomed=hs.welcome is not None,
            epoch=hs.epoch,
            contract_id=hs.contract_id,
            refused=hs.refused,
            budget_ms=self.budget_ms,
            rtt_p99_ms=io.budget.p99_ms,
            advised_k=io.advised_k,
            sessions=len(io.sessions),
            pending=len(io.pending),
            io_thread_alive=io.thread.is_alive(),
            early_taps_declined=self._taps_declined,
            rows_in_place=hs.in_place_before + getattr(hs.ring, "in_place_steps", 0),
            spare_rings_used=hs.spares_used,
            direct_link=io.link_up,
            direct_sent=io.direct_sent,
            direct_read=io.direct_read,
        )
        return d

    def close(self) -> None:
        """Stop the I/O thread and drop the socket (LINGER 0). Idempotent, bounded by close_timeout_s."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._io.stop(self.cfg.close_timeout_s)

    def __enter__(self) -> DraftClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ step(), both flavours

    def _begin(
        self,
        requests: Sequence[StepRequest],
        taps: np.ndarray | None,
        budget_ms: float | None,
        t0: float,
        phase: Phase = Phase.WHOLE,
    ) -> tuple[list[DraftReply], str] | StepCall:
        """The part of a step before the wait: the replies and outcome when it is answered at
        once (no requests; gate closed, rows only buffered), else the call to submit, with its future."""
        budget = self.budget_ms if budget_ms is None else check_budget(budget_ms)
        contract = self._io.handshake.pinned
        welcome = self._io.handshake.welcome
        limits = welcome.limits if welcome is not None else None
        entries, taps = prepare(requests, taps, contract, limits, self._io.handshake.layout, phase, self._device_rows)
        n = len(entries)
        if n == 0:
            return [], "ok"
        deadline = t0 + budget / 1000.0
        gate = self._call_gate()
        if gate is not None:
            if gate != "closed":
                self._io.submit(StepCall(entries, taps, deadline, send=False, phase=phase, ready=self._ready(taps)))
            return self._finish(t0, empty_replies(n), gate), gate
        return StepCall(entries, taps, deadline, send=True, future=Future(), phase=phase, ready=self._ready(taps))

    def _ready(self, taps: Any) -> Any:
        """cuda_ipc with device rows: an event on the caller's current stream after them (the I/O
        thread's copy waits on it on the GPU); else None."""
        if not self._device_rows or taps is None or isinstance(taps, np.ndarray):
            return None
        from target_client.cuda.ipc import record_ready

        return record_ready(taps)

    def _end(self, t0: float, call: StepCall, out: Outcome | None) -> list[DraftReply]:
        """The part after the wait: the outcome the I/O thread set, or a timeout."""
        return self._finish(t0, *self._outcome(call, out))

    def _outcome(self, call: StepCall, out: Outcome | None) -> tuple[list[DraftReply], str]:
        if out is not None:
            return out.replies, out.outcome
        assert call.future is not None
        return self._give_up(call.future, len(call.entries), call.deadline)

    def _call_gate(self) -> str | None:
        if self._closed:
            return "closed"
        if not self._connect_requested:
            self._connect_requested = True
            self._io.submit(Connect(None))
        return self._io.gate

    def _give_up(self, fut: Future, n: int, deadline: float) -> tuple[list[DraftReply], str]:
        """The deadline passed: claim the call as timed out, unless its result was just claimed."""
        if fut.cancel():
            self._io.gave_up(deadline)  # the miss counts now
            return empty_replies(n), "timeout"
        try:
            out = fut.result(timeout=_RESULT_GRACE_S)
            return out.replies, out.outcome
        except Exception:
            return empty_replies(n), "timeout"

    def _finish(self, t0: float, replies: list[DraftReply], outcome: str) -> list[DraftReply]:
        self._counters.step_done(time.monotonic() - t0, replies, outcome)
        return replies


class StepTicket:
    """A step sent by ``DraftClient.submit_step``. ``future`` (None once answered) resolves when
    the I/O thread has the outcome; ``collect()`` returns the replies, waiting at most until
    ``deadline``; ``outcome`` (one of ``metrics.OUTCOMES``) is set by then."""

    __slots__ = ("_call", "_client", "_t0", "outcome", "replies")

    def __init__(self, client: DraftClient, t0: float, call: StepCall | None) -> None:
        self._client = client
        self._t0 = t0
        self._call = call
        self.replies: list[DraftReply] | None = None
        self.outcome = ""

    @property
    def future(self) -> Future | None:
        return self._call.future if self._call is not None and self.replies is None else None

    @property
    def deadline(self) -> float:
        return self._call.deadline if self._call is not None else self._t0

    @property
    def sent_at(self) -> float:
        """When the step went out on the socket (time.monotonic(); 0: not sent, or not yet)."""
        return self._call.sent_at if self._call is not None else 0.0

    def collect(self) -> list[DraftReply]:
        if self.replies is not None:
            return self.replies
        call = self._call
        assert call is not None and call.future is not None
        out = self._client._io.await_step(call)
        replies, self.outcome = self._client._outcome(call, out)
        self.replies = self._client._finish(self._t0, replies, self.outcome)
        return self.replies
