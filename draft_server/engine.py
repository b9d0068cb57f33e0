"""The engine thread: sessions, admission, deadlines, continuous batching, the drafter calls.

The I/O thread hands over admitted work with ``submit`` / ``submit_free`` and never waits;
the engine hands finished replies back through ``send_reply`` (a callback that only queues).
One engine iteration:

1. take everything that arrived (new work, frees), bind each entry to its session;
2. expire drafting work whose budget cannot be met any more (rows are kept);
3. decode batch: the head entry of every session whose rows fit a chunk — ingest all of their
   rows in one ``drafter.ingest``, draft all that want drafts in one ``drafter.draft``;
4. one prefill chunk of the oldest long entry (so a long prompt never delays a decode step).

Positions (DESIGN §4): pos == end appends, start <= pos < end overwrites, anything else
restarts the session at pos. Sessions are keyed by (client identity, session id).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from draft_server.drafter import Drafter, DraftItem, IngestItem
from draft_server.metrics import ServerMetrics
from protocol import EntryResult, Sampling, Status, StepResult, Timing

log = logging.getLogger("draft_server.engine")

SessionKey = tuple[bytes, str]


@dataclass(eq=False)
class Call:
    """One Step message: answered once every entry has a result."""

    ident: bytes
    call_id: int
    recv_t: float
    deadline: float
    results: list[EntryResult | None]
    remaining: int = 0
    queue_s: float = 0.0
    compute_s: float = 0.0


@dataclass(eq=False)
class Work:
    """One admitted entry, queued on its session."""

    call: Call
    idx: int
    sid: str
    pos: int  # position of taps[0] (advances as prefill chunks are ingested)
    taps: np.ndarray | None  # rows not yet ingested
    anchor: int
    k: int  # 0 once resolved (no drafting left to do)
    sampling: Sampling
    end: int  # session end once all rows are in

    @property
    def rows(self) -> int:
        return 0 if self.taps is None else len(self.taps)


@dataclass(eq=False)
class Session:
    handle: int
    key: SessionKey
    start: int = 0
    end: int = 0
    known: bool = False  # False until the first ingest sets [start, end)
    pending: deque[Work] = field(default_factory=deque)
    last_used: float = 0.0


class Engine:
    def __init__(
        self,
        drafter: Drafter,
        metrics: ServerMetrics,
        send_reply: Callable[[bytes, StepResult], None],
        epoch: str,
        contract_id: str,
        *,
        max_sessions: int,
        max_batch_rows: int,
        max_batch_sessions: int,
        prefill_chunk_rows: int,
        batch_window_ms: float,
        session_ttl_s: float,
        chaos_delay_p: float = 0.0,
        chaos_delay_s: float = 0.0,
    ) -> None:
        self.drafter = drafter
        self.metrics = metrics
        self.send_reply = send_reply
        self.epoch = epoch
        self.contract_id = contract_id
        self.max_sessions = max_sessions
        self.max_batch_rows = max_batch_rows
        self.max_batch_sessions = max_batch_sessions
        self.chunk = prefill_chunk_rows
        self.window_s = batch_window_ms / 1000.0
        self.ttl_s = session_ttl_s
        self.block = drafter.contract.block_size
        # fault injection for draft-soak: delay this fraction of working iterations (0: off)
        self._chaos_p = chaos_delay_p
        self._chaos_s = chaos_delay_s
        self._chaos_rng = random.Random()

        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draft-engine", daemon=True)
        self._rows_lock = threading.Lock()
        self._queued_rows = 0  # admitted rows not yet ingested (shared with the I/O thread)

        self.sessions: OrderedDict[SessionKey, Session] = OrderedDict()  # LRU order: oldest first
        self._next_handle = 1
        self._draft_ewma_s = 0.0  # recent decode-batch time, to skip work that cannot meet its budget
        self._iter_ewma_s = 0.001
        self.busy_since: float | None = None  # set while the drafter runs (watchdog)
        self._last_sweep = time.monotonic()

    # ------------------------------------------------------------------ I/O-thread side

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    def retry_hint_ms(self) -> float:
        """How long until the current queue has likely drained."""
        iters = self._queued_rows / max(1, self.max_batch_rows) + 1
        return round(max(1.0, iters * self._iter_ewma_s * 1000.0), 3)

    def try_admit_rows(self, rows: int, limit: int) -> bool:
        with self._rows_lock:
            if self._queued_rows + rows > limit:
                return False
            self._queued_rows += rows
        return True

    def submit(self, works: list[Work]) -> None:
        self._inbox.append(("work", works))
        self._wake.set()

    def submit_free(self, ident: bytes, sessions: tuple[str, ...]) -> None:
        self._inbox.append(("free", (ident, sessions)))
        self._wake.set()

    def finish_if_done(self, call: Call) -> None:
        """Used by the I/O thread for calls it answered completely itself."""
        if call.remaining == 0:
            self._reply(call)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self._drain_inbox()
                if self.window_s and self._has_decode_work():
                    time.sleep(self.window_s)
                    self._drain_inbox()
                did = self._iteration()
                self._sweep()
            except Exception:  # the loop must survive anything a batch does
                log.exception("engine iteration failed")
                self.metrics.engine_errors.inc()
                did = True
            if not did:
                self._wake.wait(timeout=0.05)
        self._fail_all_pending("server shutting down")

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "work":
                for w in payload:  # type: ignore[attr-defined]
                    self._enqueue(w)
            else:
                ident, sids = payload  # type: ignore[misc]
                for sid in sids:
                    s = self.sessions.get((ident, sid))
                    if s is not None:
                        self._release(s, "free")

    def _enqueue(self, w: Work) -> None:
        key = (w.call.ident, w.sid)
        s = self.sessions.get(key)
        if s is None:
            if len(self.sessions) >= self.max_sessions and not self._evict_lru(1, protect=None):
                self._resolve(
                    w,
                    EntryResult(
                        Status.OVERLOADED, retry_after_ms=self.retry_hint_ms(), message="session capacity reached"
                    ),
                    rows_done=True,
                )
                return
            s = Session(handle=self._next_handle, key=key)
            self._next_handle += 1
            self.sessions[key] = s
            self.metrics.sessions.set(len(self.sessions))
        s.last_used = time.monotonic()
        self.sessions.move_to_end(key)
        s.pending.append(w)

    def _has_decode_work(self) -> bool:
        return any(s.pending and s.pending[0].rows <= self.chunk for s in self.sessions.values())

    def _iteration(self) -> bool:
        now = time.monotonic()
        self._expire(now)
        decode: list[tuple[Session, Work]] = []
        rows = 0
        prefill: Session | None = None
        for s in self.sessions.values():
            if not s.pending:
                continue
            w = s.pending[0]
            if w.rows > self.chunk:
                if prefill is None or w.call.recv_t < prefill.pending[0].call.recv_t:
                    prefill = s
                continue
            if len(decode) >= self.max_batch_sessions or rows + w.rows > self.max_batch_rows - self.chunk:
                continue
            decode.append((s, w))
            rows += w.rows
        if not decode and prefill is None:
            return False
        if self._chaos_p and self._chaos_rng.random() < self._chaos_p:
            log.warning("chaos delay: this engine iteration sleeps %.1f ms first", self._chaos_s * 1000.0)
            time.sleep(self._chaos_s)  # an injected slow iteration (draft-soak); deadlines keep running
        t0 = time.monotonic()
        self.busy_since = t0
        try:
            if decode:
                self._decode_batch(decode, t0)
            if prefill is not None:
                self._prefill_chunk(prefill, t0)
        finally:
            self.busy_since = None
        dt = time.monotonic() - t0
        self._iter_ewma_s = 0.8 * self._iter_ewma_s + 0.2 * dt
        self.metrics.iteration.observe(dt)
        return True

    def _expire(self, now: float) -> None:
        early = False
        for s in self.sessions.values():
            for w in s.pending:
                if w.k and now + self._draft_ewma_s > w.call.deadline:
                    early = early or now <= w.call.deadline
                    self._resolve(w, EntryResult(Status.EXPIRED, end=w.end, message="budget passed before drafting"))
                    w.k = 0
        if early:
            # Work refused on the estimate alone never drafts, so the estimate could never come down
            # again: one stall (SIGSTOP, a GPU hiccup inside draft()) would expire everything forever.
            # Halve it instead, so drafting is tried again within a few iterations.
            self._draft_ewma_s *= 0.5

    def _place(self, s: Session, w: Work, rows: int) -> tuple[int, int] | None:
        """Positional semantics for `rows` rows at w.pos: the session's new [start, end)."""
        pos = w.pos
        if s.known and s.start <= pos <= s.end:
            start = s.start  # append or overwrite
        else:
            start = pos  # unknown session or gap: restart here
        end = pos + rows
        room_end = end + (self.block if w.k else 0)
        if not self._reserve(s, start, room_end):
            return None
        return start, end

    def _reserve(self, s: Session, start: int, end: int) -> bool:
        if self.drafter.reserve(s.handle, start, end):
            return True
        # make room by evicting idle sessions, least recently used first
        while self._evict_lru(1, protect=s):
            if self.drafter.reserve(s.handle, start, end):
                return True
        return False

    def _decode_batch(self, batch: list[tuple[Session, Work]], t0: float) -> None:
        ingest: list[IngestItem] = []
        drafts: list[tuple[Session, Work]] = []
        placed: list[tuple[Session, Work]] = []
        for s, w in batch:
            span = self._place(s, w, w.rows)
            if span is None:
                s.pending.popleft()
                self._resolve(
                    w,
                    EntryResult(Status.OVERLOADED, retry_after_ms=self.retry_hint_ms(), message="draft KV cache full"),
                    rows_done=True,
                )
                continue
            s.start, s.end = span
            s.known = True
            if w.rows:
                ingest.append(IngestItem(s.handle, s.start, w.pos, w.taps))  # type: ignore[arg-type]
            placed.append((s, w))
            if w.k:
                drafts.append((s, w))
            self.metrics.queue_wait.observe(t0 - w.call.recv_t)
            w.call.queue_s = max(w.call.queue_s, t0 - w.call.recv_t)
        n_rows = sum(len(i.taps) for i in ingest)
        try:
            if ingest:
                self.drafter.ingest(ingest)
            outs = []
            if drafts:
                td = time.monotonic()
                outs = self.drafter.draft(
                    [DraftItem(s.handle, s.start, s.end, w.anchor, w.k, w.sampling) for s, w in drafts]
                )
                self._draft_ewma_s = 0.8 * self._draft_ewma_s + 0.2 * (time.monotonic() - td)
        except Exception as e:
            log.exception("drafter failed on a batch of %d sessions", len(placed))
            self.metrics.engine_errors.inc()
            for s, w in placed:
                s.pending.popleft()
                self._resolve(
                    w, EntryResult(Status.INTERNAL, message=f"drafter error: {type(e).__name__}"), rows_done=True
                )
                self._release(s, "error")
            return
        dt = time.monotonic() - t0
        self.metrics.rows_ingested.inc(n_rows)
        self.metrics.batch_rows.observe(n_rows)
        self.metrics.batch_sessions.observe(len(drafts))
        for call in {id(w.call): w.call for _, w in placed}.values():
            call.compute_s += dt  # once per call: its entries shared this batch
        for s, w in placed:
            s.pending.popleft()
            self._ingested(w.rows)
            w.taps = None
        for (_s, w), out in zip(drafts, outs, strict=True):
            conf = tuple(out.confidence) if out.confidence else ()
            self.metrics.drafted_tokens.inc(len(out.tokens))
            self._resolve(w, EntryResult(Status.OK, drafts=tuple(out.tokens), end=w.end, confidence=conf))

    def _prefill_chunk(self, s: Session, t0: float) -> None:
        w = s.pending[0]
        n = min(self.chunk, w.rows)
        span = self._place(s, w, n)
        if span is None:
            s.pending.popleft()
            self._ingested(w.rows)
            self._resolve(
                w,
                EntryResult(Status.OVERLOADED, retry_after_ms=self.retry_hint_ms(), message="draft KV cache full"),
                rows_done=True,
            )
            return
        s.start, s.end = span
        s.known = True
        assert w.taps is not None
        try:
            self.drafter.ingest([IngestItem(s.handle, s.start, w.pos, w.taps[:n])])
        except Exception as e:
            log.exception("drafter failed on a prefill chunk")
            self.metrics.engine_errors.inc()
            s.pending.popleft()
            self._ingested(w.rows)
            self._resolve(w, EntryResult(Status.INTERNAL, message=f"drafter error: {type(e).__name__}"), rows_done=True)
            self._release(s, "error")
            return
        self.metrics.prefill_chunks.inc()
        self.metrics.rows_ingested.inc(n)
        self._ingested(n)
        w.taps = w.taps[n:]
        w.pos += n
        w.call.compute_s += time.monotonic() - t0
        if not len(w.taps):
            w.taps = None
            if not w.k:  # k>0 stays at the head with no rows left: drafted in the next decode batch
                s.pending.popleft()

    # ------------------------------------------------------------------ bookkeeping

    def _ingested(self, rows: int) -> None:
        with self._rows_lock:
            self._queued_rows -= rows
        self.metrics.queue_rows.set(self._queued_rows)

    def _resolve(self, w: Work, result: EntryResult, rows_done: bool = False) -> None:
        """Give entry w its result (once). rows_done: its rows will not be ingested."""
        call = w.call
        if rows_done and w.taps is not None:
            self._ingested(len(w.taps))
            w.taps = None
        if call.results[w.idx] is not None:
            return
        call.results[w.idx] = result
        self.metrics.entries.labels(result.status.name.lower()).inc()
        call.remaining -= 1
        if call.remaining == 0:
            self._reply(call)

    def _reply(self, call: Call) -> None:
        now = time.monotonic()
        res = StepResult(
            call_id=call.call_id,
            epoch=self.epoch,
            contract_id=self.contract_id,
            results=tuple(call.results),  # type: ignore[arg-type]
            timing=Timing(
                queue_ms=round(call.queue_s * 1000, 4),
                compute_ms=round(call.compute_s * 1000, 4),
                server_ms=round((now - call.recv_t) * 1000, 4),
            ),
        )
        self.metrics.step_latency.observe(now - call.recv_t)
        self.send_reply(call.ident, res)

    def _release(self, s: Session, reason: str) -> None:
        for w in s.pending:
            self._resolve(w, EntryResult(Status.EXPIRED, message=f"session released ({reason})"), rows_done=True)
        s.pending.clear()
        self.sessions.pop(s.key, None)
        self.drafter.release(s.handle)
        self.metrics.evictions.labels(reason).inc()
        self.metrics.sessions.set(len(self.sessions))

    def _evict_lru(self, n: int, protect: Session | None) -> bool:
        """Evict up to n idle sessions (no pending work), oldest first. True if any went."""
        victims = [s for s in self.sessions.values() if not s.pending and s is not protect][:n]
        for s in victims:
            self._release(s, "lru")
        return bool(victims)

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < min(1.0, self.ttl_s / 4):
            return
        self._last_sweep = now
        for s in [s for s in self.sessions.values() if not s.pending and now - s.last_used > self.ttl_s]:
            self._release(s, "ttl")
        self.metrics.kv_used.set(self.drafter.used_tokens())

    def _fail_all_pending(self, why: str) -> None:
        for s in list(self.sessions.values()):
            for w in list(s.pending):
                self._resolve(w, EntryResult(Status.INTERNAL, message=why), rows_done=True)
            s.pending.clear()


def warm_up(drafter: Drafter, max_batch_sessions: int, prefill_chunk_rows: int) -> dict[str, float]:
    """Run the drafter once at each batch shape class it will meet, on throwaway sessions.

    Called before the socket binds, so the first real steps after a (re)start do not pay for
    lazy kernel loading, library handles and the caching allocator's first blocks (on a GPU the
    first K3 steps took hundreds of ms and a restarted server missed its first budgets). Draft
    batches of 1, 2, 4, ... up to ``max_batch_sessions`` sessions (as many as the KV cache
    takes), then one prefill chunk. Everything is released afterwards. Returns the seconds spent
    and the largest batch warmed.
    """
    from protocol.codec import NUMPY_DTYPE

    c = drafter.contract
    rng = np.random.default_rng(0)

    def taps(rows: int) -> np.ndarray:
        x = rng.standard_normal((rows, c.tap_width), dtype=np.float32)
        if NUMPY_DTYPE[c.tap_dtype] == np.uint16:  # bf16 travels as its bit pattern
            return (x.view(np.uint32) >> 16).astype(np.uint16)
        return x.astype(NUMPY_DTYPE[c.tap_dtype])

    t0 = time.perf_counter()
    rows, k = 4, c.block_size
    keys: list[int] = []  # negative: never a real session's handle
    largest = 0
    top = max(1, max_batch_sessions)
    try:
        for n in sorted({min(1 << i, top) for i in range(top.bit_length() + 1)}):  # 1, 2, 4, ..., top
            while len(keys) < n and drafter.reserve(-(len(keys) + 1), 0, rows + k + 1):
                keys.append(-(len(keys) + 1))
            if len(keys) < n:
                break  # the KV cache holds no more warm-up sessions
            drafter.ingest([IngestItem(key, 0, 0, taps(rows)) for key in keys[:n]])
            drafter.draft([DraftItem(key, 0, rows, 0, k, Sampling()) for key in keys[:n]])
            largest = n
        chunk = max(1, prefill_chunk_rows)
        key = -(len(keys) + 1)
        if drafter.reserve(key, 0, chunk + k + 1):
            keys.append(key)
            drafter.ingest([IngestItem(key, 0, 0, taps(chunk))])
    finally:
        for key in keys:
            drafter.release(key)
    return {"seconds": time.perf_counter() - t0, "largest_batch": float(largest)}
