"""DraftClient: the target engine's thin client of the draft server.

Owns one ZeroMQ DEALER socket and the single I/O thread that alone touches it (the vLLM
``core_client`` shape). Callers, from any thread or from asyncio tasks, validate their own
arguments, append a command to a thread-safe deque and wake the I/O thread through a pipe
registered in its zmq Poller; replies resolve per-call futures keyed by call id. No lock is
ever held across network I/O and no zmq socket is shared between threads.

Every wait has a deadline. ``step()`` blocks at most its budget and never raises for a
draft-side fault (server down, slow, restarted, overloaded, garbage, another model): it returns
empty drafts for the requests it could not serve and counts why. ``ValueError`` is raised only
for caller bugs, checked locally with ``protocol.validate`` before anything is sent.

The I/O thread owns all mutable protocol state: the pending-call table, the per-session resend
buffers (``resend.SessionRows``), the handshake state (verified Welcome, pinned contract,
epoch), the circuit breaker and the RTT window of the adaptive budget. Callers only read
immutable snapshots of it (``_gate``, ``_welcome``, ``_pinned``, ``_adaptive_ms``).

Outcome race: a step's future is claimed exactly once, either by the I/O thread
(``set_running_or_notify_cancel`` before ``set_result``) or by the caller (``cancel`` at the
deadline). A reply whose future was cancelled is late: its drafts are dropped and counted, its
acknowledgements still update the resend buffers.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zmq

from protocol import (
    PROTOCOL_VERSION,
    EntryResult,
    Error,
    ErrorCode,
    Free,
    Hello,
    ModelContract,
    Ping,
    Pong,
    Sampling,
    ServerLimits,
    Status,
    Step,
    StepEntry,
    StepResult,
    Timing,
    Welcome,
)
from protocol.codec import NUMPY_DTYPE, ProtocolError, decode_reply, encode, spec_for, tensor
from protocol.validate import check_entry, check_sampling
from target_client.api import (
    ClientConfig,
    ConnectTimeoutError,
    ContractMismatchError,
    DraftClientError,
    DraftReply,
    StepRequest,
    empty_replies,
)
from target_client.metrics import OUTCOMES, metrics_for
from target_client.resend import SessionRows, chunk_rows, keep_newest

log = logging.getLogger("target_client")

_EXPIRED_KEEP = 4096  # timed-out calls remembered so their late replies can still acknowledge rows
_MAX_RETRY_AFTER_S = 5.0  # cap on a server's retry hint
_SWEEP_EVERY_S = 5.0
_RESULT_GRACE_S = 0.002  # a result the I/O thread has claimed is set within microseconds
# The I/O thread expires a step this long after the caller's own deadline, so that at the deadline
# only the caller wakes (it gives up by itself; the I/O thread's expiry is bookkeeping).
_EXPIRE_GRACE_S = 0.002
_FREE_CHUNK = 1024  # sessions per Free message
_COMMANDS_PER_ITERATION = 256
# While the breaker is open and a step came within this long, probes go out every
# breaker_step_probe_ms instead of every breaker_backoff_ms (a lost probe is retried at once).
_ACTIVE_S = 0.25
# After a failed half-open trial the next probe waits this long, doubling with every further
# failed trial up to breaker_backoff_ms. A server catching up on a backlog (after SIGCONT: every
# row that queued during the pause) is answering again tens of ms later; a flat 500 ms backoff
# cost about 17 engine steps without drafts there (draft-soak).
_TRIAL_BACKOFF_FIRST_MS = 50.0
_RESEND_MIN_ROWS = 16  # resent rows a step may always carry (see ClientConfig.resend_ratio)
_APPLIED = (Status.OK, Status.EXPIRED)
_CONTRACT_FIELDS = tuple(ModelContract.__struct_fields__)


@dataclass(slots=True, eq=False)
class _Outcome:
    replies: list[DraftReply]
    outcome: str


@dataclass(slots=True, eq=False)
class _StepCall:
    entries: tuple[StepEntry, ...]
    taps: np.ndarray | None
    deadline: float  # time.monotonic() by which the caller stops waiting
    send: bool  # False: buffer the rows only (breaker open / not ready)
    future: Future | None = None


@dataclass(slots=True, eq=False)
class _Pending:
    kind: str  # "step" | "ping" (a caller's) | "probe" (the breaker's) | "hello"
    call_id: int
    deadline: float
    sent_at: float
    future: Future | None = None
    sessions: tuple[str, ...] = ()  # per sent entry
    index: tuple[int, ...] = ()  # request index per sent entry
    ks: tuple[int, ...] = ()  # k per sent entry
    local: dict[int, DraftReply] | None = None  # replies of requests held back locally
    n: int = 0  # requests in the call


@dataclass(slots=True, eq=False)
class _Connect:
    future: Future | None


@dataclass(slots=True, eq=False)
class _PingCmd:
    future: Future
    deadline: float


@dataclass(slots=True, eq=False)
class _FreeCmd:
    sessions: tuple[str, ...]


class _CloseCmd:
    pass


def _random_routing_id() -> bytes:
    return b"dc-" + os.urandom(12)  # never starts with a zero byte (reserved by ZeroMQ)


def _is_int(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


class DraftClient:
    """Client of one draft server endpoint. Thread-safe and asyncio-safe; see the module docstring.

    The taps array given to ``step``/``astep`` is kept by REFERENCE (no copy) until the server
    acknowledges its rows (or they fall out of the resend bound, or the session is freed): the
    caller must not mutate it afterwards. Allocate a fresh array per step.
    """

    def __init__(self, cfg: ClientConfig) -> None:
        self.cfg = cfg
        self.routing_id = cfg.routing_id or _random_routing_id()
        self._m = metrics_for(cfg.registry)
        self._m_steps = {o: self._m.steps.labels(o) for o in OUTCOMES}
        self._m_entries = {s: self._m.entries.labels(s.name.lower()) for s in Status}
        self._m_entries_skipped = self._m.entries.labels("skipped")
        self._m.budget.set(cfg.budget_ms / 1000.0)
        self.last_timing: Timing | None = None  # server timing of the latest on-time StepResult

        # Counters written by both sides (tiny critical sections, never around I/O).
        self._stats_lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

        # Snapshots written by the I/O thread, read by callers (single attribute reads).
        self._gate: str | None = "not_ready"  # None: steps are sent; else the outcome of an immediate return
        self._welcome: Welcome | None = None
        self._pinned: ModelContract | None = cfg.expect  # contract taps are validated against
        self._epoch: str | None = None
        self._advised_k = -1
        self._adaptive_ms: float | None = None
        self._rtt_p99_ms: float | None = None

        self._close_lock = threading.Lock()
        self._closed = False
        self._connect_requested = False
        self._cmds: collections.deque[Any] = collections.deque()

        # I/O thread state (touched by no other thread once the thread has started).
        self._sessions: dict[str, SessionRows] = {}
        self._pending: dict[int, _Pending] = {}
        self._expired: collections.OrderedDict[int, _Pending] = collections.OrderedDict()
        self._ids = itertools.count(1)
        self._contract_id: str | None = None
        self._misses = 0
        self._breaker = False
        self._gauge_on = False
        self._refused: str | None = None
        self._verifying = False
        self._need_hello = False
        self._hello_due = False
        self._next_hello_at = math.inf
        self._probe_due = False
        self._next_probe_at = math.inf
        self._last_probe_at = -math.inf
        self._last_step_at = -math.inf  # when a caller last stepped (the engine is active)
        # Fast probing (breaker_step_probe_ms) finds a server that was unreachable or restarted. A
        # server that answers pings but still misses steps (alive but slow) gets the backoff instead:
        # after a failed half-open trial only slow probes (from 50 ms, doubling to breaker_backoff_ms).
        self._fast_probe = True
        self._slow_probe_ms = cfg.breaker_backoff_ms  # the probe period when not fast probing
        self._trial_backoff_first_ms = min(_TRIAL_BACKOFF_FIRST_MS, cfg.breaker_backoff_ms)
        self._trial_backoff_ms = self._trial_backoff_first_ms  # after the next failed trial
        self._trial = False  # the breaker was closed by a pong and no step has succeeded since
        # A server that just (re)started may miss its very first steps (cold caches, lazy CUDA
        # init, every session new at once): until a step succeeds, a pong-closed breaker then
        # tolerates one more miss before reopening, and a failed trial keeps fast probing.
        self._restart_grace = False
        self._ping_queue: list[_PingCmd] = []  # caller pings waiting for a live connection
        self._next_sweep = time.monotonic() + _SWEEP_EVERY_S
        self._waiters: list[Future] = []
        self._rtts: collections.deque[float] = collections.deque(maxlen=cfg.adaptive_window)
        self._rtt_new = 0
        self._closing = False

        # The socket is made here so a bad endpoint fails in the constructor, then handed to the
        # I/O thread (thread start is the full memory barrier ZeroMQ asks for when a socket moves).
        self._ctx = zmq.Context(io_threads=1)
        try:
            self._sock = self._make_socket()
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise ValueError(f"cannot connect a DEALER to {cfg.endpoint!r}: {exc}") from exc
        # A frame above zmq.COPY_THRESHOLD goes out without a copy, and pyzmq's first such frame
        # imports zmq.utils.garbage and starts its collector thread: measured at 13-16 ms with
        # the GIL held in the first steps of a K3 soak (the caller could not return at its
        # deadline). Paid here instead, before any step.
        zmq.Frame(bytes(zmq.COPY_THRESHOLD + 1), copy=False)
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        # Guards the write end against close(): a caller racing close() must never write into a
        # closed (and possibly reused) descriptor. Held for one non-blocking write only.
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"draft-client-io-{cfg.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    @property
    def welcome(self) -> Welcome | None:
        """The verified Welcome (None before the first handshake)."""
        return self._welcome

    @property
    def contract(self) -> ModelContract | None:
        """The model contract verified at the handshake (None before it)."""
        w = self._welcome
        return w.contract if w is not None else None

    @property
    def limits(self) -> ServerLimits | None:
        w = self._welcome
        return w.limits if w is not None else None

    @property
    def epoch(self) -> str | None:
        return self._epoch

    @property
    def advised_k(self) -> int:
        """The server's latest load-aware k advice (-1: none)."""
        return self._advised_k

    @property
    def breaker_open(self) -> bool:
        return self._gate == "breaker_open"

    @property
    def budget_ms(self) -> float:
        """The default budget of a step: fixed, or adaptive when configured and warmed up."""
        a = self._adaptive_ms
        return a if (self.cfg.adaptive_budget and a is not None) else self.cfg.budget_ms

    def connect(self, wait: bool = True) -> Welcome | None:
        """Hello/Welcome handshake.

        wait=True: the verified Welcome, or ContractMismatchError (the server serves another
        contract or protocol version), or ConnectTimeoutError after ``connect_timeout_s`` (the
        client keeps trying in the background either way). wait=False: None at once; the
        handshake goes on in the background and steps return empty drafts until it succeeds.
        """
        if self._closed or self._gate == "closed":
            raise DraftClientError("client is closed (or its I/O thread failed; see the log)")
        self._connect_requested = True
        fut: Future | None = Future() if wait else None
        self._submit(_Connect(fut))
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

        ``taps``: C-contiguous [sum(rows), contract.tap_width] in the wire storage dtype (uint16
        bit patterns for bf16), or None when no request has rows. Kept by reference until
        acknowledged: do not mutate it afterwards.
        """
        t0 = time.monotonic()
        entries, taps, budget = self._prepare(requests, taps, budget_ms)
        n = len(entries)
        if n == 0:
            return []
        deadline = t0 + budget / 1000.0
        gate = self._call_gate()
        if gate is not None:
            if gate != "closed":
                self._submit(_StepCall(entries, taps, deadline, send=False))
            return self._finish(t0, empty_replies(n), gate)
        fut: Future = Future()
        self._submit(_StepCall(entries, taps, deadline, send=True, future=fut))
        try:
            out = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            return self._finish(t0, out.replies, out.outcome)
        except (FutureTimeout, FutureCancelled):
            pass
        return self._finish(t0, *self._give_up(fut, n))

    async def astep(
        self, requests: Sequence[StepRequest], taps: np.ndarray | None, budget_ms: float | None = None
    ) -> list[DraftReply]:
        """step() for asyncio callers: never blocks the event loop."""
        t0 = time.monotonic()
        entries, taps, budget = self._prepare(requests, taps, budget_ms)
        n = len(entries)
        if n == 0:
            return []
        deadline = t0 + budget / 1000.0
        gate = self._call_gate()
        if gate is not None:
            if gate != "closed":
                self._submit(_StepCall(entries, taps, deadline, send=False))
            return self._finish(t0, empty_replies(n), gate)
        fut: Future = Future()
        afut = asyncio.wrap_future(fut)
        self._submit(_StepCall(entries, taps, deadline, send=True, future=fut))
        try:
            await asyncio.wait((afut,), timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.CancelledError:
            fut.cancel()
            raise
        if fut.done() and not fut.cancelled():
            out = fut.result()
            return self._finish(t0, out.replies, out.outcome)
        return self._finish(t0, *self._give_up(fut, n))

    def free(self, sessions: Iterable[str]) -> None:
        """Release sessions on the server (fire-and-forget) and drop their client-side state."""
        names = tuple(sessions)
        if not names or self._closed or self._gate == "closed":
            return
        self._submit(_FreeCmd(names))

    def ping(self, timeout_ms: float = 100.0) -> Pong | None:
        """A Pong from the server within ``timeout_ms``, else None."""
        if not (math.isfinite(timeout_ms) and timeout_ms > 0):
            raise ValueError(f"timeout_ms must be finite and > 0, got {timeout_ms}")
        if self._closed or self._gate == "closed":
            return None
        deadline = time.monotonic() + timeout_ms / 1000.0
        fut: Future = Future()
        self._submit(_PingCmd(fut, deadline))
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except (FutureTimeout, FutureCancelled):
            fut.cancel()
            return None

    def stats(self) -> dict[str, Any]:
        """Counters and state for tests and logs."""
        with self._stats_lock:
            d: dict[str, Any] = dict.fromkeys(
                (
                    "calls",
                    "ok",
                    "timeouts",
                    "errors",
                    "fallbacks",
                    "overloaded_returns",
                    "drafts",
                    "late_replies_dropped",
                    "bad_replies",
                    "resent_rows",
                    "dropped_rows",
                    "epoch_changes",
                    "contract_changes",
                    "breaker_opens",
                    "send_failures",
                    "hellos_sent",
                    "probes_sent",
                    "pongs",
                    "frees_sent",
                ),
                0,
            )
            d.update(self._counts)
        gate = self._gate
        d.update(
            breaker_state="open" if gate == "breaker_open" else ("closed" if gate != "closed" else "shut"),
            gate=gate or "open_for_steps",
            welcomed=self._welcome is not None,
            epoch=self._epoch,
            contract_id=self._contract_id,
            refused=self._refused,
            budget_ms=self.budget_ms,
            rtt_p99_ms=self._rtt_p99_ms,
            advised_k=self._advised_k,
            sessions=len(self._sessions),
            pending=len(self._pending),
            io_thread_alive=self._thread.is_alive(),
        )
        return d

    def close(self) -> None:
        """Stop the I/O thread and drop the socket (LINGER 0). Idempotent, bounded by close_timeout_s."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._cmds.append(_CloseCmd())
        self._wake()
        self._thread.join(self.cfg.close_timeout_s)
        if self._thread.is_alive():  # pragma: no cover - would need a wedged libzmq call
            log.error("draft client %s: I/O thread did not stop within %.1f s", self.cfg.name, self.cfg.close_timeout_s)
            return
        with self._wake_lock:
            wfd, self._wfd = self._wfd, -1
        for fd in (self._rfd, wfd):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> DraftClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ caller side helpers

    def _prepare(
        self, requests: Sequence[StepRequest], taps: np.ndarray | None, budget_ms: float | None
    ) -> tuple[tuple[StepEntry, ...], np.ndarray | None, float]:
        """Check the caller's arguments (ValueError on a caller bug); build the wire entries."""
        if budget_ms is None:
            budget = self.budget_ms
        else:
            ok = not isinstance(budget_ms, bool) and isinstance(budget_ms, int | float | np.integer | np.floating)
            if not ok or not math.isfinite(budget_ms) or budget_ms <= 0:
                raise ValueError(f"budget_ms must be a finite number > 0, got {budget_ms!r}")
            budget = float(budget_ms)
        contract = self._pinned
        welcome = self._welcome
        limits = welcome.limits if welcome is not None else None
        entries: list[StepEntry] = []
        seen: set[str] = set()
        total = 0
        for i, r in enumerate(requests):
            if not isinstance(r, StepRequest):
                raise ValueError(f"requests[{i}] is a {type(r).__name__}, not a StepRequest")
            if not isinstance(r.session, str):
                raise ValueError(f"requests[{i}].session must be a str, got {type(r.session).__name__}")
            if not (type(r.pos) is int and type(r.rows) is int and type(r.anchor) is int and type(r.k) is int):
                for name in ("pos", "rows", "anchor", "k"):  # slow path: numpy ints are fine, bools are not
                    if not _is_int(getattr(r, name)):
                        raise ValueError(f"requests[{i}].{name} must be an int, got {getattr(r, name)!r}")
            if not isinstance(r.sampling, Sampling):
                raise ValueError(f"requests[{i}].sampling must be a protocol.Sampling")
            e = StepEntry(r.session, int(r.pos), int(r.rows), int(r.anchor), int(r.k), r.sampling)
            err = _entry_error(e, contract, limits)
            if err is None and e.session in seen:
                err = "session appears twice in one step"
            if err is not None:
                raise ValueError(f"requests[{i}] (session {r.session!r}): {err}")
            seen.add(e.session)
            total += e.rows
            entries.append(e)
        if taps is None:
            if total:
                raise ValueError(f"requests announce {total} rows but taps is None")
        else:
            if not isinstance(taps, np.ndarray):
                raise ValueError(f"taps must be a numpy array, got {type(taps).__name__}")
            if taps.ndim != 2 or taps.shape[0] != total:
                raise ValueError(f"taps has shape {tuple(taps.shape)}, requests announce {total} rows")
            if not taps.flags.c_contiguous:
                raise ValueError("taps must be C-contiguous (the client sends it without copying)")
            if contract is not None:
                want = NUMPY_DTYPE[contract.tap_dtype]
                if taps.dtype != want:
                    raise ValueError(
                        f"taps dtype {taps.dtype} does not carry {contract.tap_dtype.value} (want {want}: "
                        "bf16 travels as its uint16 bit pattern)"
                    )
                if taps.shape[1] != contract.tap_width:
                    raise ValueError(
                        f"taps width {taps.shape[1]} != contract tap_width {contract.tap_width} "
                        f"({len(contract.tap_layer_ids)} taps x {contract.target_hidden_size})"
                    )
            elif taps.dtype not in NUMPY_DTYPE.values():
                raise ValueError(f"taps dtype {taps.dtype} is no wire dtype")
            if total == 0:
                taps = None
        if limits is not None:
            if len(entries) > limits.max_entries_per_step:
                raise ValueError(f"{len(entries)} requests exceed the server's max_entries_per_step")
            if total > limits.max_rows_per_step:
                raise ValueError(
                    f"{total} rows exceed the server's max_rows_per_step {limits.max_rows_per_step} "
                    "(split prefill into chunks of client.limits.prefill_chunk_rows)"
                )
            if taps is not None and taps.nbytes > limits.max_message_bytes:
                raise ValueError(f"{taps.nbytes} tap bytes exceed the server's max_message_bytes")
        return tuple(entries), taps, budget

    def _call_gate(self) -> str | None:
        if self._closed:
            return "closed"
        if not self._connect_requested:
            self._connect_requested = True
            self._submit(_Connect(None))
        return self._gate

    def _give_up(self, fut: Future, n: int) -> tuple[list[DraftReply], str]:
        """The deadline passed: claim the call as timed out, unless its result was just claimed."""
        if fut.cancel():
            return empty_replies(n), "timeout"
        try:
            out = fut.result(timeout=_RESULT_GRACE_S)
            return out.replies, out.outcome
        except Exception:
            return empty_replies(n), "timeout"

    def _finish(self, t0: float, replies: list[DraftReply], outcome: str) -> list[DraftReply]:
        self._m.step_duration.observe(time.monotonic() - t0)
        self._m_steps[outcome].inc()
        drafts = sum(len(r.tokens) for r in replies)
        if drafts:
            self._m.drafts.inc(drafts)
        key = {"ok": "ok", "timeout": "timeouts", "error": "errors", "overloaded": "overloaded_returns"}.get(outcome)
        with self._stats_lock:
            c = self._counts
            c["calls"] += 1
            c["drafts"] += drafts
            c[f"outcome_{outcome}"] += 1
            if key is not None:
                c[key] += 1
            else:  # breaker_open / not_ready / closed: returned at once without waiting
                c["fallbacks"] += 1
        return replies

    def _submit(self, cmd: object) -> None:
        self._cmds.append(cmd)
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wfd < 0:
                return  # closed
            try:
                os.write(self._wfd, b"\0")
            except OSError:
                pass  # BlockingIOError: the pipe is full, so a wake-up is already pending

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self._counts[key] += n

    # ------------------------------------------------------------------ I/O thread

    def _make_socket(self) -> zmq.Socket:
        cfg = self.cfg
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IMMEDIATE, 1)  # queue only towards a live connection; else sends fail fast
        s.setsockopt(zmq.ROUTING_ID, self.routing_id)  # stable across TCP reconnects: sessions survive
        s.setsockopt(zmq.RECONNECT_IVL, cfg.reconnect_ivl_ms)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, cfg.reconnect_ivl_max_ms)
        s.setsockopt(zmq.MAXMSGSIZE, cfg.max_reply_bytes)
        s.setsockopt(zmq.SNDHWM, cfg.send_hwm)
        if cfg.curve_server_key is not None:
            pub, sec = cfg.curve_public_key, cfg.curve_secret_key
            if pub is None or sec is None:
                pub, sec = zmq.curve_keypair()
            s.curve_serverkey = cfg.curve_server_key
            s.curve_publickey = pub
            s.curve_secretkey = sec
        s.connect(cfg.endpoint)
        return s

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._rfd, zmq.POLLIN)
        sock_flags = zmq.POLLIN
        try:
            while True:
                want = zmq.POLLIN | (zmq.POLLOUT if self._out_due() else 0)
                if want != sock_flags:
                    poller.modify(self._sock, want)
                    sock_flags = want
                events = dict(poller.poll(self._poll_timeout_ms(time.monotonic())))
                if self._rfd in events:
                    self._drain_wake()
                now = time.monotonic()
                if events.get(self._sock, 0) & zmq.POLLIN:
                    self._recv_all(now)  # replies first: their acks shape the next resend
                self._drain_commands(now)
                if self._closing:
                    break
                now = time.monotonic()
                self._expire(now)
                self._timers(now)
                if self._out_due() and (self._sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT):
                    self._send_due(now)
        except Exception:
            log.exception("draft client %s: I/O thread failed; drafting is off for this client", self.cfg.name)
        finally:
            self._shutdown()

    def _out_due(self) -> bool:
        return self._hello_due or self._probe_due or bool(self._ping_queue)

    def _poll_timeout_ms(self, now: float) -> int:
        if self._cmds:
            return 0  # commands left over from a bounded drain
        t = min(now + 1.0, self._next_sweep)
        for p in self._pending.values():
            t = min(t, p.deadline + (_EXPIRE_GRACE_S if p.kind == "step" else 0.0))
        for q in self._ping_queue:
            t = min(t, q.deadline)
        if self._need_hello and not self._hello_due:
            t = min(t, self._next_hello_at)
        if self._breaker and not self._probe_due:
            t = min(t, self._next_probe_at)
        return max(0, math.ceil((t - now) * 1000.0))

    def _drain_wake(self) -> None:
        try:
            while os.read(self._rfd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _drain_commands(self, now: float) -> None:
        # Bounded: callers may keep appending (e.g. fast breaker-open steps); timers, expiry and
        # replies must still run every iteration. Leftovers make the next poll return at once.
        cmds = self._cmds
        for _ in range(min(len(cmds), _COMMANDS_PER_ITERATION)):
            cmd = cmds.popleft()
            try:
                if isinstance(cmd, _StepCall):
                    self._do_step(cmd, now)
                elif isinstance(cmd, _Connect):
                    self._do_connect(cmd, now)
                elif isinstance(cmd, _PingCmd):
                    self._do_ping(cmd, now)
                elif isinstance(cmd, _FreeCmd):
                    self._do_free(cmd)
                elif isinstance(cmd, _CloseCmd):
                    self._closing = True
                    return
            except Exception:
                log.exception("draft client %s: command %s failed", self.cfg.name, type(cmd).__name__)
                if isinstance(cmd, _StepCall):
                    self._resolve(cmd.future, empty_replies(len(cmd.entries)), "error")

    # -- sending

    def _try_send(self, frames: list[Any]) -> bool:
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError:  # EAGAIN: no live connection (IMMEDIATE) or the send queue is full
            self._count("send_failures")
            return False

    def _do_step(self, call: _StepCall, now: float) -> None:
        cfg = self.cfg
        self._last_step_at = now
        n = len(call.entries)
        send = call.send and self._gate is None and self._welcome is not None
        contract = self._pinned
        limit = cfg.resend_rows_limit
        room = 1 << 62
        if send:
            assert contract is not None and self._welcome is not None
            limits = self._welcome.limits
            new_total = sum(e.rows for e in call.entries)
            row_bytes = contract.tap_width * contract.tap_dtype.itemsize
            room = limits.max_rows_per_step - new_total
            if row_bytes:
                room = min(room, (limits.max_message_bytes - 4096 - 256 * n) // row_bytes - new_total)
            room = max(0, min(room, max(_RESEND_MIN_ROWS, int(cfg.resend_ratio * new_total))))
        cid = next(self._ids) if send else None
        wire_entries: list[StepEntry] = []
        parts: list[np.ndarray] = []
        index: list[int] = []
        sessions: list[str] = []
        ks: list[int] = []
        local: dict[int, DraftReply] = {}
        zero_copy = True
        resent = dropped = 0
        off = 0
        for i, e in enumerate(call.entries):
            new = call.taps[off : off + e.rows] if (e.rows and call.taps is not None) else None
            off += e.rows
            s = self._sessions.get(e.session)
            if s is None:
                s = self._sessions[e.session] = SessionRows(now)
            s.last_used = now
            prev, d = s.take(e.pos, limit)
            dropped += d
            if prev and not self._fits(prev[0][1]):  # buffered before the contract was known
                dropped += chunk_rows(prev)
                prev = []
            if new is not None and not self._fits(new):  # validated before the contract was known
                dropped += len(new)
                local[i] = DraftReply([], None, message="taps do not fit the server's contract")
                zero_copy = False
                continue
            mine = [*prev, (e.pos, new)] if new is not None else prev
            if not send:
                dropped += s.store(mine, limit, None)
                continue
            if s.retry_at > now:  # the server asked us to hold this session back
                dropped += s.store(mine, limit, None)
                local[i] = DraftReply(
                    [], Status.OVERLOADED, retry_after_ms=(s.retry_at - now) * 1000.0, message="held back locally"
                )
                self._m_entries_skipped.inc()
                zero_copy = zero_copy and new is None
                continue
            if prev:
                have = chunk_rows(prev)
                if have > room:
                    prev, cut = keep_newest(prev, room)
                    dropped += cut
                    have = room
                room -= have
                resent += have
                zero_copy = zero_copy and not prev
            chunks = [*prev, (e.pos, new)] if new is not None else prev
            start = chunks[0][0] if chunks else e.pos
            rows = chunk_rows(chunks)
            wire_entries.append(e if start == e.pos else msgspec.structs.replace(e, pos=start, rows=rows))
            parts.extend(a for _, a in chunks)
            index.append(i)
            sessions.append(e.session)
            ks.append(e.k)
            dropped += s.store(chunks, limit, cid)
        if dropped:
            self._m.dropped_rows.inc(dropped)
            self._count("dropped_rows", dropped)
        if not send:
            self._step_probe(now)
            self._resolve(call.future, empty_replies(n), self._gate or "not_ready")
            return
        if not wire_entries:  # everything held back
            self._resolve(call.future, [local.get(i) or DraftReply([]) for i in range(n)], "overloaded")
            return
        assert contract is not None and cid is not None and self._welcome is not None
        frame: np.ndarray | None
        if not parts:
            frame = None
        elif zero_copy and call.taps is not None and sum(len(p) for p in parts) == len(call.taps):
            frame = call.taps  # the common case: the caller's array goes out as it is
        else:
            frame = np.concatenate(parts, axis=0)  # resend or hold-back: one copy
        # a fresh clock: ``now`` was read before this command was drained and may predate the
        # caller's own start, which would tell the server more time than the caller has
        budget_wire = (call.deadline - time.monotonic()) * 1000.0 - cfg.reply_margin_ms
        budget_wire = min(max(budget_wire, 0.1), self._welcome.limits.max_budget_ms)
        msg = Step(
            call_id=cid,
            budget_ms=budget_wire,
            entries=tuple(wire_entries),
            taps=spec_for(frame, contract.tap_dtype, 0) if frame is not None else None,
        )
        if not self._try_send(encode(msg, [frame] if frame is not None else [])):
            for sess in sessions:
                self._sessions[sess].unsent()
            self._resolve(call.future, [local.get(i) or DraftReply([]) for i in range(n)], "error")
            self._miss(now)
            return
        if resent:
            self._m.resent_rows.inc(resent)
            self._count("resent_rows", resent)
        self._pending[cid] = _Pending(
            "step", cid, call.deadline, now, call.future, tuple(sessions), tuple(index), tuple(ks), local, n
        )

    def _fits(self, arr: np.ndarray) -> bool:
        c = self._pinned
        return c is None or (arr.shape[1] == c.tap_width and arr.dtype == NUMPY_DTYPE[c.tap_dtype])

    def _do_connect(self, cmd: _Connect, now: float) -> None:
        if self._welcome is not None and not self._verifying and self._refused is None:
            if cmd.future is not None:
                self._set_future(cmd.future, self._welcome)
            return
        if cmd.future is not None:
            self._waiters.append(cmd.future)
        self._need_hello = True  # an explicit connect retries at once, even after a refusal
        self._hello_due = True

    def _do_ping(self, cmd: _PingCmd, now: float) -> None:
        if not self._send_ping(cmd, now):
            self._ping_queue.append(cmd)  # no live connection yet: sent when the socket turns writable

    def _send_ping(self, cmd: _PingCmd, now: float) -> bool:
        cid = next(self._ids)
        if not self._try_send(encode(Ping(call_id=cid))):
            return False
        self._pending[cid] = _Pending("ping", cid, cmd.deadline, now, cmd.future)
        return True

    def _do_free(self, cmd: _FreeCmd) -> None:
        dropped = 0
        for name in cmd.sessions:
            s = self._sessions.pop(name, None)
            if s is not None:
                dropped += s.rows
        if dropped:
            self._m.dropped_rows.inc(dropped)
            self._count("dropped_rows", dropped)
        for i in range(0, len(cmd.sessions), _FREE_CHUNK):
            if self._try_send(encode(Free(sessions=cmd.sessions[i : i + _FREE_CHUNK]))):
                self._count("frees_sent")

    def _send_due(self, now: float) -> None:
        if self._hello_due:
            cid = next(self._ids)
            hello = Hello(
                protocol_version=PROTOCOL_VERSION, client_name=self.cfg.name, call_id=cid, expect=self.cfg.expect
            )
            self._hello_due = False
            if self._try_send(encode(hello)):
                self._count("hellos_sent")
                period = self.cfg.breaker_backoff_ms if self._refused is not None else self.cfg.hello_retry_ms
                self._next_hello_at = now + period / 1000.0
                self._pending[cid] = _Pending("hello", cid, self._next_hello_at, now)
            else:
                self._next_hello_at = now + 0.02
        if self._ping_queue:
            queue, self._ping_queue = self._ping_queue, []
            for i, cmd in enumerate(queue):
                if not self._send_ping(cmd, now):
                    self._ping_queue = queue[i:]
                    break
        if self._probe_due:
            cid = next(self._ids)
            self._probe_due = False
            period = self._slow_probe_ms
            if self._fast_probe and self.cfg.breaker_step_probe_ms and now - self._last_step_at < _ACTIVE_S:
                period = min(period, self.cfg.breaker_step_probe_ms)  # an active engine: probe fast
            self._next_probe_at = now + period / 1000.0
            self._last_probe_at = now
            if self._try_send(encode(Ping(call_id=cid))):
                self._count("probes_sent")
                self._pending[cid] = _Pending("probe", cid, self._next_probe_at, now)

    def _step_probe(self, now: float) -> None:
        """A step found the breaker open: probe now unless a probe went out very recently."""
        gap = self.cfg.breaker_step_probe_ms / 1000.0
        if gap and self._fast_probe and self._breaker and not self._need_hello and now - self._last_probe_at >= gap:
            self._probe_due = True  # sent by _send_due in this same loop iteration (socket writable)

    def _timers(self, now: float) -> None:
        if self._need_hello and not self._hello_due and now >= self._next_hello_at:
            self._hello_due = True
        if self._breaker and not self._need_hello and not self._probe_due and now >= self._next_probe_at:
            self._probe_due = True
        if now >= self._next_sweep:
            self._next_sweep = now + _SWEEP_EVERY_S
            idle = now - self.cfg.session_idle_s
            for name in [k for k, s in self._sessions.items() if s.last_used < idle]:
                del self._sessions[name]

    def _expire(self, now: float) -> None:
        if self._ping_queue:
            for cmd in self._ping_queue:
                if cmd.deadline <= now:
                    self._set_future(cmd.future, None)
            self._ping_queue = [c for c in self._ping_queue if c.deadline > now]
        late = now - _EXPIRE_GRACE_S
        for cid in [c for c, p in self._pending.items() if p.deadline <= (late if p.kind == "step" else now)]:
            p = self._pending.pop(cid)
            if p.kind == "step":
                if p.future is not None:
                    p.future.cancel()  # the caller gives up at the same deadline; a later reply is late
                self._expired[cid] = p
                while len(self._expired) > _EXPIRED_KEEP:
                    self._expired.popitem(last=False)
                self._miss(now)
            elif p.kind == "ping" and p.future is not None:
                self._set_future(p.future, None)

    # -- receiving

    def _recv_all(self, now: float) -> None:
        for _ in range(1024):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._on_frames(frames, now)
            except Exception:
                log.exception("draft client %s: reply handling failed", self.cfg.name)
                self._bad_reply()

    def _bad_reply(self) -> None:
        self._m.bad_replies.inc()
        self._count("bad_replies")

    def _on_frames(self, frames: list[zmq.Frame], now: float) -> None:
        bufs = [f.buffer for f in frames]
        if len(bufs) > 1 and len(bufs[0]) == 0:  # tolerate a REQ-style empty delimiter
            bufs = bufs[1:]
        try:
            msg = decode_reply(bufs[0])
        except ProtocolError:
            self._bad_reply()
            return
        if isinstance(msg, StepResult):
            self._on_result(msg, bufs[1:], now)
        elif isinstance(msg, Pong):
            self._on_pong(msg, now)
        elif isinstance(msg, Welcome):
            self._on_welcome(msg, now)
        elif isinstance(msg, Error):
            self._on_error(msg, now)

    def _take_pending(self, call_id: int) -> tuple[_Pending | None, bool]:
        p = self._pending.pop(call_id, None)
        if p is not None:
            return p, False
        p = self._expired.pop(call_id, None)
        return p, p is not None

    def _on_result(self, msg: StepResult, payloads: list[memoryview], now: float) -> None:
        p, late = self._take_pending(msg.call_id)
        if p is None or p.kind != "step":
            self._bad_reply()  # a call we never made, or one long forgotten
            return
        self._rtts.append(now - p.sent_at)
        self._m.rtt.observe(now - p.sent_at)
        self._rtt_new += 1
        if self._rtt_new >= 16:
            self._update_adaptive()
        if self._contract_id is not None and msg.contract_id != self._contract_id:
            self._note_epoch(msg.epoch)
            self._contract_changed(msg.contract_id, now)
            if not late and self._resolve(p.future, self._replies(p, None, ()), "error"):
                self._miss(now)
            else:
                self._late(p, now, late)
            return
        if len(msg.results) != len(p.sessions):
            self._note_epoch(msg.epoch)
            self._bad_reply()
            if not late and self._resolve(p.future, self._replies(p, None, ()), "error"):
                self._miss(now)
            else:
                self._late(p, now, late)
            return
        for name, r in zip(p.sessions, msg.results, strict=True):
            s = self._sessions.get(name)
            if s is None:
                continue
            if r.status in _APPLIED:
                s.ack(p.call_id, r.end)
            elif r.status == Status.OVERLOADED and r.retry_after_ms > 0:
                s.retry_at = now + min(r.retry_after_ms / 1000.0, _MAX_RETRY_AFTER_S)
        self._note_epoch(msg.epoch)  # after the acks: this reply's own acks stand
        self.last_timing = msg.timing  # set before the future resolves, so a lone caller sees its own
        if late or not self._resolve(p.future, self._replies(p, msg.results, payloads), "ok"):
            self._late(p, now, late)
            return
        self._misses = 0
        self._trial = False
        self._fast_probe = True
        self._trial_backoff_ms = self._trial_backoff_first_ms
        self._restart_grace = False
        if self._breaker:  # a call that was in flight when the breaker opened came back in time
            self._close_breaker(trial=False)
            self._misses = 0
        self._advised_k = msg.advised_k
        for r in msg.results:
            self._m_entries[r.status].inc()

    def _late(self, p: _Pending, now: float, already_missed: bool) -> None:
        self._m.late_replies.inc()
        self._count("late_replies_dropped")
        if not already_missed:  # the caller gave up before the I/O thread's own expiry
            self._miss(now)

    def _replies(self, p: _Pending, results: Sequence[EntryResult] | None, payloads: Sequence[Any]) -> list[DraftReply]:
        local = p.local or {}
        out = [local.get(i) or DraftReply([]) for i in range(p.n)]
        if results is None:
            return out
        vocab = self._pinned.vocab_size if self._pinned is not None else None
        for idx, k, r in zip(p.index, p.ks, results, strict=True):
            out[idx] = self._reply(r, k, vocab, payloads)
        return out

    def _reply(self, r: EntryResult, k: int, vocab: int | None, payloads: Sequence[Any]) -> DraftReply:
        if r.status != Status.OK:
            return DraftReply([], r.status, retry_after_ms=r.retry_after_ms, message=r.message)
        tokens = list(r.drafts[:k])  # msgspec already checked they are ints
        if vocab is not None and tokens and (min(tokens) < 0 or max(tokens) >= vocab):
            self._bad_reply()
            return DraftReply([], r.status, message="drafts outside the vocabulary dropped")
        probs = prob_ids = None
        if r.probs is not None and r.prob_ids is not None:
            try:
                probs = np.array(tensor(r.probs, payloads))
                prob_ids = np.array(tensor(r.prob_ids, payloads))
            except ProtocolError:
                self._bad_reply()
                probs = prob_ids = None
        return DraftReply(
            tokens, r.status, list(r.confidence[: len(tokens)]), probs, prob_ids, r.retry_after_ms, r.message
        )

    def _on_pong(self, msg: Pong, now: float) -> None:
        p, _ = self._take_pending(msg.call_id)
        self._count("pongs")
        self._note_epoch(msg.epoch)
        if self._contract_id is not None and msg.contract_id != self._contract_id:
            self._contract_changed(msg.contract_id, now)
        elif self._breaker and msg.healthy:
            self._close_breaker()
        if p is not None and p.kind == "ping" and p.future is not None:
            self._set_future(p.future, msg)

    def _on_welcome(self, w: Welcome, now: float) -> None:
        self._pending.pop(w.call_id, None)
        self._note_epoch(w.epoch)
        if w.protocol_version != PROTOCOL_VERSION:
            self._refuse(
                f"draft server {self.cfg.endpoint} speaks protocol_version {w.protocol_version}, "
                f"this client speaks {PROTOCOL_VERSION}",
                ("protocol_version",),
                now,
            )
            return
        pinned = self._pinned
        if pinned is not None:
            diffs = pinned.mismatches(w.contract)
            if diffs:
                self._refuse(
                    f"draft server {self.cfg.endpoint} serves a different model contract "
                    f"(expected != served): {'; '.join(diffs)}",
                    tuple(d.split(":", 1)[0] for d in diffs),
                    now,
                )
                return
        first = self._welcome is None
        self._welcome = w
        self._pinned = pinned if pinned is not None else w.contract
        self._contract_id = w.contract_id
        self._need_hello = self._hello_due = self._verifying = False
        if self._refused is not None:
            self._refused = None
            self._breaker = False
            self._misses = 0
        self._set_gate()
        if first:
            log.info(
                "draft client %s: welcomed by %s (model %s, contract %s, epoch %s)",
                self.cfg.name,
                self.cfg.endpoint,
                w.contract.model_name,
                w.contract_id,
                w.epoch,
            )
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            self._set_future(f, w)

    def _on_error(self, err: Error, now: float) -> None:
        if err.epoch:
            self._note_epoch(err.epoch)
        p, late = self._take_pending(err.call_id)
        if p is None:
            self._bad_reply()
            log.debug("draft client %s: server error without a call: %s %s", self.cfg.name, err.code.name, err.message)
            return
        if p.kind == "hello":
            if err.code in (ErrorCode.CONTRACT_MISMATCH, ErrorCode.UNSUPPORTED_VERSION):
                named = tuple(f for f in _CONTRACT_FIELDS if f in err.message)
                if err.code == ErrorCode.UNSUPPORTED_VERSION:
                    named = ("protocol_version",)
                self._refuse(f"draft server {self.cfg.endpoint} refused the handshake: {err.message}", named, now)
            return  # other errors (e.g. NOT_READY): the Hello is retried on its timer
        if p.kind == "step":
            if late:
                self._late(p, now, True)
            elif self._resolve(p.future, self._replies(p, None, ()), "error"):
                self._miss(now)
            else:
                self._late(p, now, False)
            if err.code == ErrorCode.CONTRACT_MISMATCH:
                self._contract_changed("", now)
        elif p.kind == "ping" and p.future is not None:
            self._set_future(p.future, None)

    # -- state changes

    def _note_epoch(self, epoch: str) -> None:
        if not epoch or epoch == self._epoch:
            return
        if self._epoch is not None:
            self._m.epoch_changes.inc()
            self._count("epoch_changes")
            log.info("draft client %s: server restarted (epoch %s -> %s)", self.cfg.name, self._epoch, epoch)
            dropped = 0
            self._fast_probe = True  # a restarted server deserves a fast look again
            self._restart_grace = True
            for s in self._sessions.values():  # the server's sessions are gone: forget what it acknowledged
                s.unsent()
                s.retry_at = 0.0
                s.chunks, d = keep_newest(s.chunks, self.cfg.restart_resend_rows)  # a small first step
                dropped += d
            if dropped:
                self._m.dropped_rows.inc(dropped)
                self._count("dropped_rows", dropped)
        self._epoch = epoch

    def _contract_changed(self, new_id: str, now: float) -> None:
        self._m.contract_changes.inc()
        self._count("contract_changes")
        if self._verifying:
            return
        log.warning(
            "draft client %s: server answers with contract_id %r, verified %r; re-verifying",
            self.cfg.name,
            new_id,
            self._contract_id,
        )
        self._verifying = True
        self._need_hello = self._hello_due = True
        self._set_gate()

    def _refuse(self, message: str, fields: tuple[str, ...], now: float) -> None:
        if self._refused != message:
            log.error("draft client %s: %s; drafting stays off (breaker open)", self.cfg.name, message)
        self._refused = message
        self._verifying = False
        self._need_hello = True
        self._hello_due = False
        self._next_hello_at = now + self.cfg.breaker_backoff_ms / 1000.0
        self._count("contract_refusals")
        self._set_gate()
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if f.set_running_or_notify_cancel():
                f.set_exception(ContractMismatchError(message, fields))

    def _miss(self, now: float) -> None:
        self._misses += 1
        if not self._breaker and self._misses >= self.cfg.breaker_failures:
            self._breaker = True
            # a failed half-open trial: the server is slow, back off (unless it has just restarted)
            self._fast_probe = not self._trial or self._restart_grace
            self._slow_probe_ms = self.cfg.breaker_backoff_ms
            if self._trial:
                self._restart_grace = False  # used up: a restarted server that stays slow gets the backoff
                if not self._fast_probe:  # the backoff starts short and doubles with each failed trial
                    self._slow_probe_ms = self._trial_backoff_ms
                    self._trial_backoff_ms = min(2.0 * self._trial_backoff_ms, self.cfg.breaker_backoff_ms)
            self._trial = False
            self._probe_due = False
            self._next_probe_at = now + self._slow_probe_ms / 1000.0
            self._m.breaker_opens.inc()
            self._count("breaker_opens")
            log.warning(
                "draft client %s: %d consecutive misses, breaker open (probing every %.0f ms)",
                self.cfg.name,
                self._misses,
                self._slow_probe_ms,
            )
            self._set_gate()

    def _close_breaker(self, trial: bool = True) -> None:
        self._breaker = False
        self._probe_due = False
        # Half-open: the first miss after a close reopens at once; the first success resets.
        self._misses = self.cfg.breaker_failures - 1
        if trial and self._restart_grace:
            self._misses = max(0, self.cfg.breaker_failures - 2)
        self._trial = trial
        log.info("draft client %s: server answers pings again, breaker closed", self.cfg.name)
        self._set_gate()

    def _set_gate(self) -> None:
        if self._closing:
            gate: str | None = "closed"
        elif self._refused is not None or self._breaker:
            gate = "breaker_open"
        elif self._welcome is None or self._verifying:
            gate = "not_ready"
        else:
            gate = None
        on = gate == "breaker_open"
        if on != self._gauge_on:
            self._gauge_on = on
            self._m.breaker_open.inc() if on else self._m.breaker_open.dec()
        self._gate = gate

    def _update_adaptive(self) -> None:
        self._rtt_new = 0
        if len(self._rtts) < 32:
            return
        cfg = self.cfg
        # numpy's linear percentile in plain Python: np.percentile's first call imports numpy.ma
        # (22 ms with the GIL held, measured inside a K3 soak step on the H200)
        rtts = sorted(self._rtts)
        pos = (len(rtts) - 1) * 0.99
        lo = int(pos)
        hi = min(lo + 1, len(rtts) - 1)
        p99_ms = (rtts[lo] + (rtts[hi] - rtts[lo]) * (pos - lo)) * 1000.0
        self._rtt_p99_ms = p99_ms
        self._adaptive_ms = min(max(cfg.adaptive_multiplier * p99_ms, cfg.adaptive_min_ms), cfg.budget_ms)
        if cfg.adaptive_budget:
            self._m.budget.set(self._adaptive_ms / 1000.0)

    # -- futures

    @staticmethod
    def _set_future(f: Future, value: Any) -> bool:
        try:
            if f.set_running_or_notify_cancel():
                f.set_result(value)
                return True
        except RuntimeError:  # already resolved
            pass
        return False

    def _resolve(self, f: Future | None, replies: list[DraftReply], outcome: str) -> bool:
        return f is not None and self._set_future(f, _Outcome(replies, outcome))

    def _shutdown(self) -> None:
        self._closing = True
        self._set_gate()
        for p in self._pending.values():
            if p.kind == "step":
                self._resolve(p.future, empty_replies(p.n), "closed")
            elif p.kind == "ping" and p.future is not None:
                self._set_future(p.future, None)
        self._pending.clear()
        for q in self._ping_queue:
            self._set_future(q.future, None)
        self._ping_queue = []
        while self._cmds:
            cmd = self._cmds.popleft()
            if isinstance(cmd, _StepCall):
                self._resolve(cmd.future, empty_replies(len(cmd.entries)), "closed")
            elif isinstance(cmd, _PingCmd):
                self._set_future(cmd.future, None)
            elif isinstance(cmd, _Connect) and cmd.future is not None:
                self._waiters.append(cmd.future)
        for f in self._waiters:
            if f.set_running_or_notify_cancel():
                f.set_exception(DraftClientError("client closed"))
        self._waiters = []
        if self._gauge_on:
            self._gauge_on = False
            self._m.breaker_open.dec()
        self._ctx.destroy(linger=0)  # closes the socket (LINGER 0), then terminates the context


def _entry_error(e: StepEntry, contract: ModelContract | None, limits: ServerLimits | None) -> str | None:
    """Why the entry is a caller bug, or None (full protocol checks once the server's limits are known)."""
    if contract is not None and limits is not None:
        return check_entry(e, contract, limits)
    if not e.session:
        return "empty session id"
    if e.pos < 0 or e.rows < 0 or e.k < 0 or e.anchor < 0:
        return f"pos, rows, anchor and k must be >= 0 (got pos={e.pos} rows={e.rows} anchor={e.anchor} k={e.k})"
    if contract is not None:
        if e.k > contract.block_size:
            return f"k={e.k} outside [0, block_size={contract.block_size}]"
        if e.anchor >= contract.vocab_size:
            return f"anchor token {e.anchor} outside vocab [0, {contract.vocab_size})"
    return check_sampling(e.sampling, contract.vocab_size if contract is not None else 1 << 31)
