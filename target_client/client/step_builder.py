"""Turning the engine's ``StepRequest``s and taps into a ``Step`` message and its frames.

Owns the two halves of building a step and the budget of a step:

* ``check_budget`` and ``prepare`` (caller thread): the caller's arguments checked locally
  (``ValueError`` for a caller bug, before anything is sent): request types, entries against the
  pinned contract and the server's limits (full ``protocol.validate`` checks once both are
  known), the rows array's shape, dtype and memory layout against the row layout of the
  client's wire format (``protocol.wire``; once known), the per-step limits.
* ``merge_rows`` and ``step_frames`` (I/O thread): each session's unacknowledged rows
  (``resend.SessionRows``) merged in front of its new rows within the resend bound and the
  step's room, sessions the server asked to hold back answered locally, sessions catching up
  after a burst (``resend`` module docstring) sent ingest-only and answered locally, the rows of
  a step that is not sent buffered; then the ``Step`` message with one tap frame (the caller's own array,
  uncopied, in the common case), or with its rows copied into a region of the client's
  shared-memory ring (transport shm, ``ring``) or, device to device, of its CUDA IPC buffer
  (transport cuda_ipc, ``target_client.cuda.ipc``: the rows are torch CUDA tensors then, and go
  to the host only for a frame when no region is free), and the budget told to the server.
* ``AdaptiveBudget`` (written by the I/O thread, read by callers): the p99 of recent round trips
  behind ``ClientConfig.adaptive_budget``.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from protocol import GREEDY, ModelContract, Phase, RowsAt, Sampling, ServerLimits, Status, Step, StepEntry, TensorSpec
from protocol.codec import NUMPY_DTYPE, encode, spec_for
from protocol.validate import check_entry, check_sampling
from protocol.wire import RowLayout
from target_client.api import ClientConfig, DraftReply, StepRequest
from target_client.client.calls import StepCall
from target_client.client.regions import DEVICE_DTYPES, device_dtype_ok, is_device
from target_client.client.resend import SessionRows, chunk_rows
from target_client.client.ring import ClientRing

RESEND_MIN_ROWS = 16  # resent rows a step may always carry (see ClientConfig.resend_ratio)
# The steady state's entries (a plain entry with new rows, its session's earlier rows all acknowledged,
# nothing held back or given up) take shortcuts through ``merge_rows`` and the reply's acknowledgement and
# replies (``io_loop``) that do what the general path does for them without its calls: 64 sessions a step
# on the caller's path. Tests turn this off to check that the general path gives the same result.
FAST_PATHS = True
CATCHING_UP = "catching up: the server is still taking in this session's earlier rows"


# ---------------------------------------------------------------- caller side


def _is_int(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def check_budget(budget_ms: Any) -> float:
    """A caller's explicit budget as a float (ValueError unless a finite number > 0)."""
    ok = not isinstance(budget_ms, bool) and isinstance(budget_ms, int | float | np.integer | np.floating)
    if not ok or not math.isfinite(budget_ms) or budget_ms <= 0:
        raise ValueError(f"budget_ms must be a finite number > 0, got {budget_ms!r}")
    return float(budget_ms)


def entry_error(e: StepEntry, contract: ModelContract | None, limits: ServerLimits | None) -> str | None:
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


def prepare(
    requests: Sequence[StepRequest],
    taps: np.ndarray | None,
    contract: ModelContract | None,
    limits: ServerLimits | None,
    layout: RowLayout | None,
    phase: Phase = Phase.WHOLE,
    device_ok: bool = False,
) -> tuple[tuple[StepEntry, ...], Any]:
    """Check the caller's arguments (ValueError on a caller bug); build the wire entries (of ``phase``).

    ``layout``: (dtype, width) of the client's rows, None while unknown. ``device_ok``: the taps
    may be a torch CUDA tensor (transport cuda_ipc). Returns the entries and the taps (None when no
    request has rows)."""
    entries: list[StepEntry] = []
    seen: set[str] = set()
    total = 0
    # the common request (plain ints, greedy, valid against the server's limits), checked in one
    # expression as ``check_entry``'s own fast path does; anything else takes the full checks below
    if contract is not None and limits is not None:
        sid_bytes, block, vocab, max_pos = (
            limits.max_session_id_bytes,
            contract.block_size,
            contract.vocab_size,
            limits.max_position,
        )
    else:
        sid_bytes = -1  # no fast path: every request is checked in full
    for i, r in enumerate(requests):
        if (
            type(r) is StepRequest
            and type(sid := r.session) is str
            and 0 < len(sid) * 4 <= sid_bytes
            and type(pos := r.pos) is int
            and type(rows := r.rows) is int
            and type(anchor := r.anchor) is int
            and type(k := r.k) is int
            and pos >= 0
            and rows >= 0
            and 0 <= k <= block
            and pos + rows + k <= max_pos
            and 0 <= anchor < vocab
            and (not k or phase != Phase.TAPS)
            and r.sampling is GREEDY
            and sid not in seen
        ):
            seen.add(sid)
            total += rows
            entries.append(StepEntry(sid, pos, rows, anchor, k, GREEDY, phase))
            continue
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
        e = StepEntry(r.session, int(r.pos), int(r.rows), int(r.anchor), int(r.k), r.sampling, phase)
        err = entry_error(e, contract, limits)
        if err is None and phase == Phase.TAPS and e.k:
            err = f"early taps are ingest only (k=0), got k={e.k}"
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
    elif is_device(taps):
        if not device_ok:
            raise ValueError("taps on a CUDA device need ClientConfig.transport 'cuda_ipc' (else: a host numpy array)")
        _check_device_taps(taps, total, layout)
        if total == 0:
            taps = None
    else:
        if not isinstance(taps, np.ndarray):
            raise ValueError(f"taps must be a numpy array, got {type(taps).__name__}")
        if taps.ndim != 2 or taps.shape[0] != total:
            raise ValueError(f"taps has shape {tuple(taps.shape)}, requests announce {total} rows")
        if not taps.flags.c_contiguous:
            raise ValueError("taps must be C-contiguous (the client sends it without copying)")
        if layout is not None:
            dtype, width = layout
            want = NUMPY_DTYPE[dtype]
            if taps.dtype != want:
                raise ValueError(
                    f"taps dtype {taps.dtype} does not carry {dtype.value} (want {want}: "
                    "bf16 travels as its uint16 bit pattern, fp8 rows as uint8)"
                )
            if taps.shape[1] != width:
                raise ValueError(f"taps width {taps.shape[1]} != {width}, the row width of this client's wire format")
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
    return tuple(entries), taps


def _check_device_taps(taps: Any, total: int, layout: RowLayout | None) -> None:
    """``prepare``'s checks of rows in a torch CUDA tensor (ValueError on a caller bug)."""
    if taps.dim() != 2 or taps.shape[0] != total:
        raise ValueError(f"taps has shape {tuple(taps.shape)}, requests announce {total} rows")
    if not taps.is_contiguous():
        raise ValueError("taps must be contiguous (the client copies it into its CUDA IPC buffer as it is)")
    if layout is not None:
        dtype, width = layout
        if not device_dtype_ok(taps, dtype):
            raise ValueError(
                f"taps dtype {taps.dtype} does not carry {dtype.value} (want one of {', '.join(DEVICE_DTYPES[dtype])})"
            )
        if taps.shape[1] != width:
            raise ValueError(f"taps width {taps.shape[1]} != {width}, the row width of this client's wire format")
    elif not any(str(taps.dtype) in names for names in DEVICE_DTYPES.values()):
        raise ValueError(f"taps dtype {taps.dtype} is no wire dtype")


# ---------------------------------------------------------------- I/O thread side


def fits(arr: Any, layout: RowLayout | None) -> bool:
    """Whether rows (validated or buffered before the row layout was known) fit it."""
    if layout is None:
        return True
    if arr.shape[1] != layout[1]:
        return False
    return device_dtype_ok(arr, layout[0]) if is_device(arr) else arr.dtype == NUMPY_DTYPE[layout[0]]


@dataclass(slots=True, eq=False)
class MergedStep:
    """A step's requests with their resend rows merged in (what ``merge_rows`` decided)."""

    entries: list[StepEntry] = field(default_factory=list)  # wire entries, in request order
    parts: list[np.ndarray] = field(default_factory=list)  # their rows, in entry order
    index: list[int] = field(default_factory=list)  # request index per wire entry
    sessions: list[str] = field(default_factory=list)  # session per wire entry
    ks: list[int] = field(default_factory=list)  # k per wire entry
    local: dict[int, DraftReply] = field(default_factory=dict)  # replies of requests answered locally
    zero_copy: bool = True  # parts are exactly the caller's taps, in order
    resent: int = 0  # buffered rows sent again
    dropped: int = 0  # buffered or new rows given up
    skipped: int = 0  # requests held back because the server asked us to
    behind: int = 0  # requests answered locally: their session is catching up (rows sent ingest-only)

    def replies(self, n: int) -> list[DraftReply]:
        """Empty replies for the ``n`` requests, apart from those answered locally."""
        return [self.local.get(i) or DraftReply([]) for i in range(n)]


def room_for_resend(cfg: ClientConfig, call: StepCall, layout: RowLayout, limits: ServerLimits) -> int:
    """Resent rows the step may carry besides its new rows (server limits, ``resend_ratio``)."""
    n = len(call.entries)
    new_total = sum(e.rows for e in call.entries)
    row_bytes = layout[1] * layout[0].itemsize
    room = limits.max_rows_per_step - new_total
    if row_bytes:
        room = min(room, (limits.max_message_bytes - 4096 - 256 * n) // row_bytes - new_total)
    return max(0, min(room, max(RESEND_MIN_ROWS, int(cfg.resend_ratio * new_total))))


def merge_rows(
    call: StepCall,
    sessions: dict[str, SessionRows],
    now: float,
    call_id: int | None,
    layout: RowLayout | None,
    room: int,
    limit: int,
    in_taps: Callable[[int], bool] | None = None,
) -> MergedStep:
    """Merge each session's buffered rows with its new rows and buffer them again.

    ``call_id`` None: the step is not sent, its rows are only buffered. Else the rows go out
    with call ``call_id`` (at most ``room`` resent rows in all, ``limit`` per session) and stay
    buffered until acknowledged. Creates the SessionRows of sessions seen for the first time.
    A commit (``Phase.COMMIT``, no rows of its own) does not resend rows an early Taps call still
    in flight carries (``in_taps(call id)``): they stay buffered under that call, so its reply
    acknowledges them; once it failed (or the commit was answered MISSING_ROWS) they go again.
    A session catching up (``SessionRows.catching_up``) gets a local reply without drafts and its
    rows go as a plain ingest-only entry (WHOLE, k=0: the server ingests it with the next batch,
    where early taps would wait for one without drafting; a rowless commit not at all), so that
    nobody waits on it; it resends only buffered rows that never left (the others are on their way
    in order, and the server is behind already), and an acknowledgement of its newest call covers
    them all. With early taps such an entry names the call carrying the rows below it (``after``):
    were that call lost, the server could hold an older span's rejected rows there, so unless that
    call's rows reached the session last it applies nothing (MISSING_ROWS: catching up ends, the next
    step resends from the buffer). A request of more than ``limit`` new rows (a burst) marks them as
    only the server's (``SessionRows.sent_big``). In a session with early taps that gave up
    unacknowledged rows (``SessionRows.lost_end``, the ``resend`` module docstring) every entry that
    goes is marked ``restart``, but a commit relying on its Taps call in flight (``after``: that
    call's own mark stands for it).
    """
    send = call_id is not None
    out = MergedStep()
    local = out.local
    off = 0
    new_fit = call.taps is None or fits(call.taps, layout)  # every request's rows are a slice of these
    taps = call.taps
    fast = FAST_PATHS and send and new_fit and taps is not None
    for i, e in enumerate(call.entries):
        n = e.rows
        new = taps[off : off + n] if (n and taps is not None) else None
        off += n
        s = sessions.get(e.session)
        if (  # the steady state (``FAST_PATHS``): a plain entry appending new rows, nothing buffered (all
            # acknowledged), nothing owed (no hold-back, catching up, given-up or superseded rows)
            fast
            and s is not None
            and n
            and not s.chunks
            and e.phase == Phase.WHOLE
            and n <= limit
            and s.retry_at <= now
            and s.behind_since < 0
            and s.unsure_call is None
            and s.lost_end < 0
            and s.sent_end <= e.pos
        ):
            s.last_used = now
            s.chunks, s.call_id, s.sent_end = [(e.pos, new)], call_id, e.pos + n
            out.entries.append(e)
            out.parts.append(new)
            out.index.append(i)
            out.sessions.append(e.session)
            out.ks.append(e.k)
            continue
        if s is None:
            s = sessions[e.session] = SessionRows(now)
        s.last_used = now
        s.tapped = s.tapped or e.phase != Phase.WHOLE
        flying = s.call_id  # the call carrying the buffered rows (None: they never left)
        carried = flying if (send and new is None and e.phase == Phase.COMMIT) else None
        if carried is not None and not (in_taps is not None and in_taps(carried)):
            carried = None
        prev, d = s.take(e.pos, limit)
        out.dropped += d
        if prev and not fits(prev[0][1], layout):  # buffered before the row layout was known
            out.dropped += chunk_rows(prev)
            prev = []
        if new is not None and not new_fit:  # validated before the row layout was known
            out.dropped += len(new)
            local[i] = DraftReply([], None, message="taps do not fit the server's contract")
            out.zero_copy = False
            continue
        if not send or s.retry_at > now:  # only buffered: not sent, or the server asked us to hold back
            out.dropped += s.store([*prev, (e.pos, new)] if new is not None else prev, limit, None)
            if send:
                local[i] = DraftReply(
                    [], Status.OVERLOADED, retry_after_ms=(s.retry_at - now) * 1000.0, message="held back locally"
                )
                out.skipped += 1
                out.zero_copy = out.zero_copy and new is None
            continue
        behind = s.behind_since >= 0 and s.catching_up(now)
        if behind:  # the server is still taking in this session's burst: its rows go, nobody waits
            local[i] = DraftReply([], None, message=CATCHING_UP)
            out.behind += 1
            if e.k or e.phase != Phase.WHOLE:  # plain ingest-only: urgent on the server, as early taps are not
                e = msgspec.structs.replace(e, k=0, phase=Phase.WHOLE, after=0)
            if s.lost_end >= 0:
                e = msgspec.structs.replace(e, restart=True)
            if prev and flying is not None:  # on their way already, in order: not again (that
                if new is None:  # would double the rows of a server that is behind)
                    out.dropped += s.store(prev, limit, flying)
                    continue
                if s.tapped:  # the server may hold a span's rejected rows below: only over call ``flying``'s
                    e = msgspec.structs.replace(e, after=flying)
                out.entries.append(e)
                out.parts.append(new)
                out.index.append(i)
                out.sessions.append(e.session)
                out.ks.append(0)
                out.dropped += s.store([*prev, (e.pos, new)], limit, call_id)
                if e.rows > limit:
                    s.sent_big(call_id, e.pos)
                continue
        if carried is not None:  # on their way in the early Taps call: not twice
            out.dropped += s.store(prev, limit, carried)
            out.entries.append(msgspec.structs.replace(e, after=carried))
            out.index.append(i)
            out.sessions.append(e.session)
            out.ks.append(e.k)
            continue
        if s.unsure_call is not None:
            s.resending()  # its rows go from the buffer's front: no call in flight stands for them
        if prev:
            have = chunk_rows(prev)
            if have > room:
                end = prev[-1][0] + len(prev[-1][1])
                prev = s.trimmed(prev, room, end)
                out.dropped += have - room
                have = room
            room -= have
            out.resent += have
            out.zero_copy = out.zero_copy and not prev
        chunks = [*prev, (e.pos, new)] if new is not None else prev
        start = chunks[0][0] if chunks else e.pos
        rows = e.rows if not prev else chunk_rows(chunks)
        if behind and not rows:  # nothing to ingest: the entry would be a no-op
            out.dropped += s.store(chunks, limit, call_id)
            continue
        if e.rows > limit:  # new rows beyond what the buffer keeps (a burst): only the server will hold them
            s.sent_big(call_id, e.pos)
        if start != e.pos or s.lost_end >= 0:
            e = msgspec.structs.replace(e, pos=start, rows=rows, restart=s.lost_end >= 0)
        out.entries.append(e)
        if prev:
            out.parts.extend(a for _, a in chunks)
        elif new is not None:
            out.parts.append(new)
        out.index.append(i)
        out.sessions.append(e.session)
        out.ks.append(e.k)
        out.dropped += s.store(chunks, limit, call_id)
    return out


def step_frames(
    merged: MergedStep,
    call: StepCall,
    call_id: int,
    layout: RowLayout,
    wire_format: str,
    limits: ServerLimits,
    reply_margin_ms: float,
    ring: ClientRing | Any | None = None,
    ready: Any = None,
) -> list[Any]:
    """The frames of the Step message carrying ``merged`` (header, then at most one row frame).
    With a ``ring`` the rows are copied into its next free region instead, when one is free
    (a CUDA IPC buffer's copy after ``ready``, the caller's event after its device rows), or go
    where they lie when the caller wrote them into a region of the shm ring (``ClientRing.claim``)."""
    parts = merged.parts
    frame: np.ndarray | None
    total = sum(map(len, parts))
    whole = merged.zero_copy and call.taps is not None and total == len(call.taps)
    at = None
    if ring is not None and parts:
        if whole and isinstance(ring, ClientRing) and isinstance(call.taps, np.ndarray):
            at = ring.in_place(call.taps)  # the caller wrote them into a region it claimed: no copy
        if at is None:
            at = ring.put(parts, ready)
    if at is not None:
        spec = TensorSpec(layout[0], (total, parts[0].shape[1]), -1)  # rows are at ``at``, in no frame
        return encode(_step(merged, call, call_id, limits, reply_margin_ms, wire_format, spec, at))
    if not parts:
        frame = None
    elif any(is_device(p) for p in parts):  # cuda_ipc, no free region: one copy to the host
        from target_client.cuda.ipc import host_rows  # torch, only for a cuda_ipc client

        frame = host_rows(parts, ready)
    elif whole:
        frame = call.taps  # the common case: the caller's array goes out as it is
    else:
        frame = np.concatenate(parts, axis=0)  # resend or hold-back: one copy
    spec = spec_for(frame, layout[0], 0) if frame is not None else None
    msg = _step(merged, call, call_id, limits, reply_margin_ms, wire_format, spec, None)
    return encode(msg, [frame] if frame is not None else [])


def _step(
    merged: MergedStep,
    call: StepCall,
    call_id: int,
    limits: ServerLimits,
    reply_margin_ms: float,
    wire_format: str,
    taps: TensorSpec | None,
    rows_at: RowsAt | None,
) -> Step:
    # a fresh clock: the I/O loop's ``now`` was read before this command was drained and may
    # predate the caller's own start, which would tell the server more time than the caller has
    budget_wire = (call.deadline - time.monotonic()) * 1000.0 - reply_margin_ms
    budget_wire = min(max(budget_wire, 0.1), limits.max_budget_ms)
    return Step(
        call_id=call_id,
        budget_ms=budget_wire,
        entries=tuple(merged.entries),
        taps=taps,
        sent_ms=time.monotonic() * 1000.0,  # lets the server spot a step it reads after its caller gave up
        wire=wire_format,
        rows_at=rows_at,
        commit_follows=call.commit_follows and call.phase == Phase.TAPS,
    )


# ---------------------------------------------------------------- adaptive budget


class AdaptiveBudget:
    """The p99 of recent Step round trips and the budget derived from it (I/O loop writes;
    callers read ``ms`` and ``p99_ms``). Kept up to date every 16 samples while
    ``adaptive_budget`` is on; else the p99 is only taken when someone reads it (``stats()``)."""

    def __init__(self, cfg: ClientConfig, gauge: Any) -> None:
        self._cfg = cfg
        self._gauge = gauge  # draft_client budget gauge, set while adaptive_budget is on
        self._rtts: collections.deque[float] = collections.deque(maxlen=cfg.adaptive_window)
        self._new = 0
        self.ms: float | None = None  # None until warmed up (32 samples)
        self._p99_ms: float | None = None

    @property
    def p99_ms(self) -> float | None:
        if self._cfg.adaptive_budget:
            return self._p99_ms
        return _p99_ms(list(self._rtts))  # a copy: the loop may append meanwhile

    def add(self, rtt_s: float) -> None:
        self._rtts.append(rtt_s)
        if not self._cfg.adaptive_budget:
            return
        self._new += 1
        if self._new >= 16:
            self._update()

    def _update(self) -> None:
        self._new = 0
        p99_ms = _p99_ms(self._rtts)
        if p99_ms is None:
            return
        cfg = self._cfg
        self._p99_ms = p99_ms
        self.ms = min(max(cfg.adaptive_multiplier * p99_ms, cfg.adaptive_min_ms), cfg.budget_ms)
        self._gauge.set(self.ms / 1000.0)


def _p99_ms(samples: Iterable[float]) -> float | None:
    """numpy's linear 99th percentile of round trips in seconds, in ms (None below 32 samples), in
    plain Python: np.percentile's first call imports numpy.ma (22 ms with the GIL held, measured
    inside a K3 soak step on the H200)."""
    rtts = sorted(samples)
    if len(rtts) < 32:
        return None
    pos = (len(rtts) - 1) * 0.99
    lo = int(pos)
    hi = min(lo + 1, len(rtts) - 1)
    return (rtts[lo] + (rtts[hi] - rtts[lo]) * (pos - lo)) * 1000.0
