"""The engine thread: continuous batching over every client's queued work, and the drafter calls.

The I/O thread hands over admitted work with ``submit`` / ``submit_free`` (an append to the
inbox) and rings the engine awake with ``wake`` once per pass over the socket, right before it
sleeps itself; it never waits. The engine hands finished replies to ``send_reply`` (a callback
that sends when the socket is free or an I/O pass frees it within 1 ms, else queues). An idle engine given the
socket (``attach_socket``: its FD and the router's ``engine_take`` / ``engine_serve``) watches it
itself: a Step that finds it idle wakes it directly and is read and admitted on its thread (the
router's own code, under the router's lock), with no hop through the I/O thread.
One engine iteration:

1. take everything that arrived (new work, frees), bind each entry to its session (a newer
   entry for a session supersedes its older queued one's drafting; an ingest-only entry is
   acknowledged once its session is admitted);
2. expire drafting work whose budget cannot be met any more (rows are kept);
3. decode batch: the head entry of every session whose rows fit a chunk, taken round-robin
   across clients so no client fills the batch alone; then, in the rows left, each of those
   sessions' next queued entries, one per session per pass in the same order (a run: each entry
   fits a chunk and starts inside or right at the end of the rows of the one before it, which is
   ingest-only: a drafting entry ends the run, its drafts after every row before it; an entry that
   overwrites the one before it from its first row (the next early-taps span over the last span's
   rejected rows, a resend) cuts that one's rows there once it is placed: they are never ingested
   (an entry refused leaves the one before it whole); a gap waits for a
   later batch, and so does the rest of a run after an entry answered MISSING_ROWS or KV-full; early
   taps join a run only in a batch without drafting or of a session with a draft waiting) — ingest
   all of their rows (a run's host rows as items of at most a chunk) and draft all that want drafts
   in one ``drafter.step`` (ingest, then draft; the rows free when it returns);
4. one prefill chunk of the oldest long entry (so a long prompt never delays a decode step).

Holding a batch for expected arrivals. Clients that call in a closed loop (each sends its next
Step as soon as its drafts arrive) otherwise split into cohorts: the first to come back starts a
batch alone, the rest wait a whole batch behind it, and the GPU runs two half batches for the
price of two full ones (16 single-session callers on a 2.6 ms step: 7.7 sessions per batch). So
the engine learns each client's turnaround (its drafts' reply to its next drafting call) and,
before a decode batch, holds it for the clients due back while waiting costs the sessions at hand
less than it saves those due (``Engine._hold``: less than a batch, never past what the waiting
entries' budgets allow), starting at once when the last of them arrives. A client whose
turnaround is a batch or longer (a target engine between its forwards) is never waited for; with
one client nothing is ever held. Not with a fixed ``batch_window_ms``, which waits blindly instead.

Idle. With nothing to do the engine waits on its bell (and the socket it watches) in a blocking
poll; with ``idle_spin_ms`` it polls without sleeping from that long before the first client due
back (its last drafts' reply plus its learnt turnaround, as for the hold) until that long after,
sleeping through the rest (with no client due: for that long after its last batch), so the next
step of a target that is between its forwards finds it awake (a thread that slept, and the core
under it, take 0.15-0.2 ms to wake on an H100 host after a 10 ms gap:
``bench/results/hop_marks_k3_gap10_h100.json``) while the core sleeps through most of the forward;
and it polls unslept through its short waits too (a hold, a wait for commits that follow their taps:
2 ms at most), so the commit a target sends before its sampling ends is read as it lands.

Positions (DESIGN §4): pos == end appends, start <= pos < end overwrites, anything else
restarts the session at pos (counted by cause). Every reply names the context [start, end) its
session holds. Sessions are keyed by (owner, session id).

Early taps (``protocol.Phase``): a TAPS entry (the whole verified span, sent right after the
target's forward) is acknowledged once admitted and ingested only by a batch with no drafting
in it (sessions with a draft waiting go first; their own taps precede their commit by the
per-session FIFO). A COMMIT that arrives while its session's taps still wait is folded into
them: one entry with the taps' rows up to the commit's position and the commit's drafts, the
rejected rows never ingested: what the single message would have been. Taps whose call says its
commits follow at once (``Step.commit_follows``: predicted commits) are not ingested alone while
nothing else is ready: the engine waits for those commits (``commit_wait_s``, 2 ms after the call at
most; not for a client whose newer call brought commits already), so they fold. A COMMIT on its own
drafts from [start, pos) only when the session holds every row below ``pos`` (the rows past it
are cut, as any positional overwrite does) and, when it names the Taps call carrying them
(``after``), that call's taps were the session's latest (else the rows it holds there may be an
older span's rejected rows whose commit was lost); otherwise it answers MISSING_ROWS, never a
gap restart. In a session that has had early taps, an entry whose call is older than the newest
call that reached it (call ids grow per connection: it was overtaken on the way) applies nothing
and is answered MISSING_ROWS (not applied: the client resends): a late span would overwrite the
newer span's accepted rows with its rejected ones (also as the ingest-only WHOLE entry a
catching-up client sends a span as), a late commit would cut them. Sessions without early taps
(only committed rows, from any client version) apply late entries by position as before. An entry
marked ``restart`` (a client that gave up unacknowledged rows below its position: the session may
hold a span's rejected rows there) starts its session at its position, as a gap does, and heads
its run; a commit so marked without rows of its own is answered MISSING_ROWS. An entry with rows
that names a call (``after``: a client catching up sends a span's new rows alone, the rows below
them on their way in that call) is answered MISSING_ROWS, nothing applied, unless that call's rows
reached the session last (``Session.rows_call``): else that call was lost or refused, and the rows
the session holds below the entry may be an older span's rejected ones.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from draft_server.drafters import Drafter, DraftItem, DraftOut, IngestItem
from draft_server.engine.admission import Admission
from draft_server.engine.sessions import Session, SessionTable
from draft_server.engine.types import Call, Work
from draft_server.metrics import ServerMetrics
from protocol import DType, EntryResult, Phase, Status, StepResult, Timing, spec_for
from protocol.wake import WakePipe, repoll

log = logging.getLogger("draft_server.engine")

LONG_BATCH_S = 0.002  # an engine watching the socket hands it to the I/O thread before batches longer than this
HOLD_FORGET_S = 10.0  # a client silent this long is no longer tracked
# the longest early taps wait for the commits their call said follow at once (``Engine._commits_due``):
# they come a client's step-building later (0.1-0.5 ms); this bound only matters when one is lost
COMMIT_WAIT_S = 0.002
_OK = Status.OK
_WHOLE = Phase.WHOLE


@dataclass(slots=True)
class _Cadence:
    """How fast a client comes back: from the reply that carried its drafts to its next drafting call."""

    reply_t: float = 0.0  # when its last drafting call was answered
    turn_s: float = -1.0  # EWMA of that turnaround (-1: not seen yet)
    awaiting: bool = False  # answered, and its next drafting call has not arrived
    drafts: int = 0  # entries that drafted in that call (sessions a hold would take in)

    def expected(self) -> float:
        """When its next drafting call should come: the reply plus its turnaround."""
        return self.reply_t + self.turn_s

    def due(self) -> float:
        """When its next drafting call is given up on (1.25 turnarounds + 50 us after the reply)."""
        return self.reply_t + 1.25 * self.turn_s + 5e-5


_Watch = tuple[Callable[[], Sequence[int]], Callable[[], bool], Callable[[], None], Callable[[], None]]


class Engine:
    def __init__(
        self,
        drafter: Drafter,
        metrics: ServerMetrics,
        send_reply: Callable[[bytes, StepResult, list], None],
        epoch: str,
        contract_id: str,
        *,
        max_sessions: int,
        max_queue_rows: int,
        max_batch_rows: int,
        max_batch_sessions: int,
        prefill_chunk_rows: int,
        batch_window_ms: float,
        session_ttl_s: float,
        idle_spin_ms: float = 0.0,
        commit_wait_s: float = COMMIT_WAIT_S,
    ) -> None:
        self.drafter = drafter
        self.metrics = metrics
        self.send_reply = send_reply
        self.epoch = epoch
        self.contract_id = contract_id
        self.max_batch_rows = max_batch_rows
        self.max_batch_sessions = max_batch_sessions
        self.chunk = prefill_chunk_rows
        self.window_s = batch_window_ms / 1000.0
        self.spin_s = idle_spin_ms / 1000.0
        self.commit_wait_s = commit_wait_s
        self._busy_t = time.monotonic()  # when the engine last did work (the idle spin counts from it)
        self.ttl_s = session_ttl_s
        self.sessions = SessionTable(drafter, metrics, max_sessions, session_ttl_s)
        self.admission = Admission(drafter, self.sessions, metrics, max_queue_rows, max_batch_rows)

        self._inbox: deque[tuple[str, object]] = deque()
        self._bell = WakePipe()  # a byte ends the idle wait
        self._idle = False  # the engine waits on the bell (or is about to)
        self._poll = select.poll()
        self._polled: set[int] = set()  # what ``_poll`` watches: the bell, and the socket's FDs while watched
        # the socket an idle engine watches itself: (its FDs, take it, read it, leave it); None: the bell only
        self._socket: _Watch | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draft-engine", daemon=True)
        self._draft_ewma_s = 0.0  # recent decode-batch time, to skip work that cannot meet its budget
        self._rr = 0  # round-robin start among clients
        self.busy_since: float | None = None  # set while the drafter runs (watchdog)
        self._last_sweep = time.monotonic()
        self._cadence: dict[bytes, _Cadence] = {}  # by owner: its turnaround, for holding a batch
        self._commits_seen: dict[bytes, int] = {}  # by owner: its newest call with commits (``_commits_due``)
        self._commit_wait_t0: float | None = None  # when the current wait for commits began
        self._hold_until: float | None = None  # the batch being formed waits for ``_hold_for`` until then
        self._hold_for: set[bytes] = set()
        self._hold_t0 = 0.0

    # ------------------------------------------------------------------ I/O-thread side

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._bell.ring()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._bell.close()  # a late wake() never writes into a closed (or reused) descriptor

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, works: list[Work]) -> None:
        """Queue admitted work (taken by the engine's next iteration; ``wake`` if it may be idle)."""
        self._inbox.append(("work", works))

    def submit_free(self, owner: bytes, sessions: tuple[str, ...]) -> None:
        self._inbox.append(("free", (owner, sessions)))

    def wake(self) -> None:
        """End the engine's idle wait if it is in one (any thread; costs nothing when it is busy)."""
        if self._idle:
            self._idle = False
            self._bell.ring()

    def attach_socket(
        self,
        fds: Callable[[], Sequence[int]],
        take: Callable[[], bool],
        serve: Callable[[], None],
        leave: Callable[[], None],
    ) -> None:
        """Watch the socket while idle (before ``start``): ``fds()`` what to poll (its ZMQ_FD and the
        direct links' descriptors, read at each wait), ``take()`` makes the
        engine the one watching it (False: not now), ``serve()`` reads what waits, as the I/O
        thread would (the work it admits lands in this engine's inbox), ``leave()`` hands it back
        before a batch expected to be long (``LONG_BATCH_S``). Not with a batch window (the engine
        sleeps through it, so the socket would go unread)."""
        if not self.window_s:
            self._socket = (fds, take, serve, leave)

    def reply_now(self, call: Call) -> None:
        """Used by the I/O thread for a call it answered completely itself (no entry left to draft)."""
        self._reply(call)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_inbox()
                if self.window_s and self._has_decode_work():
                    time.sleep(self.window_s)
                    self._drain_inbox()
                did = self._iteration()
                self._sweep()
                self._flush_metrics()
                if did:
                    self._busy_t = time.monotonic()
                else:
                    self._wait()  # inside: it reads the socket (the router's code) when it watches it
            except Exception:  # the loop must survive anything a batch (or a message it read) does
                log.exception("engine iteration failed")
                self.metrics.engine_errors.inc()
        self._fail_all_pending("server shutting down")
        self._flush_metrics()

    def _wait(self, timeout_s: float = 0.05) -> None:
        """Idle: until new work (``wake``, or a message on the socket it watches), ``stop`` or
        ``timeout_s`` (50 ms: sweeps, expiry; a held batch: its hold)."""
        self._idle = True  # announced before the inbox is read: work queued after the read rings the bell
        sock = self._socket
        watch = sock is not None and sock[1]()
        watched: Sequence[int] = sock[0]() if watch else ()  # type: ignore[index]
        self._polled = repoll(self._poll, self._polled, {self._bell.fd, *watched})
        try:
            fds = [self._bell.fd, *watched]
            ready: list[int] = []
            now = time.monotonic()
            until = now + timeout_s
            if self.spin_s and max(fds) < 1024:  # ``idle_spin_ms``: no sleep, so no wake-up to wait for
                # a hold or a wait for commits (short, bounded): all of it; idle: around the next client due
                spin_from, spin_end = (now, until) if timeout_s < 0.05 else self._spin_window(now)
                if spin_from < until:  # else a later wait spins: this one sleeps its whole timeout
                    if now < spin_from:  # asleep until then (select's timeout has microseconds)
                        ready = select.select(fds, [], [], spin_from - now)[0]
                    while not ready and not self._inbox and not self._stop.is_set() and time.monotonic() < spin_end:
                        ready = select.select(fds, [], [], 0)[0]
            if not ready and not self._inbox and not self._stop.is_set():
                if timeout_s < 0.05 and max(fds) < 1024:
                    # select's timeout has microseconds (poll's is whole milliseconds): a hold is short
                    ready = select.select(fds, [], [], max(until - time.monotonic(), 0.0))[0]
                else:
                    ready = [fd for fd, _ in self._poll.poll(max(1, int(timeout_s * 1000)))]
            if self._bell.fd in ready:
                self._bell.drain()
        finally:
            if watch:
                sock[2]()  # type: ignore[index]  # read what came (it lands in the inbox), or give the socket back
            self._idle = False

    def _spin_window(self, now: float) -> tuple[float, float]:
        """When the idle engine polls unslept: from ``spin_s`` before the first client due back (its
        last drafts' reply plus its turnaround) to ``spin_s`` after; with none due, for ``spin_s``
        after the last batch. So a target between its forwards finds the engine awake, and the core
        sleeps through the rest of the forward."""
        late = now - self.spin_s  # a client due before this, and not back, is not waited for (gone, or slow)
        dues = (c.expected() for c in self._cadence.values() if c.awaiting and c.turn_s >= 0.0)
        due = min((d for d in dues if d > late), default=None)
        if due is None:  # nobody due: after the last batch, if still
            return now, self._busy_t + self.spin_s
        return due - self.spin_s, due + self.spin_s

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
        call, phase = w.call, w.phase
        cid, owner = call.call_id, call.owner
        s = self.sessions.open((owner, w.sid))
        if s is None:
            self._resolve(w, self.admission.overloaded("session capacity reached"), rows_done=True)
            return
        if cid < s.last_call and (phase != _WHOLE or s.taps_call):  # overtaken (module docstring)
            self.metrics.stale_steps.labels("reordered").inc()
            self._resolve(w, _missing(s, "overtaken by a newer step of its session: not applied"), rows_done=True)
            return
        if w.after and self._predecessor_lost(s, w):
            return
        if cid > s.last_call:
            s.last_call = cid
        if w.k and (c := self._cadence.get(owner)) is not None and c.awaiting:
            turn = max(0.0, call.recv_t - c.reply_t)
            c.turn_s = turn if c.turn_s < 0 else 0.7 * c.turn_s + 0.3 * turn
            c.awaiting = False
        if w.taps is not None:
            s.rows_call = cid
        for old in s.pending:  # a newer step for this session: the older one's drafts are moot
            if old.k:
                old.k = 0
                self.metrics.stale_steps.labels("superseded").inc()
                self._resolve(old, EntryResult(Status.EXPIRED, end=old.end, message="superseded by a newer step"))
        if phase != _WHOLE:
            if phase == Phase.TAPS:
                s.taps_call = cid
            elif cid > self._commits_seen.get(owner, 0):  # a commit
                self._commits_seen[owner] = cid
            if phase == Phase.COMMIT and self._fold_commit(s, w):
                return
        s.pending.append(w)
        if not w.k:  # ingest only: acknowledged now that its session is admitted (EXPIRED: it was read late)
            start = s.start if s.known and s.start <= w.pos <= s.end and not w.restart else w.pos
            status = Status.EXPIRED if w.late else Status.OK
            self._resolve(w, EntryResult(status, end=w.end, start=start, message=w.late))

    def _predecessor_lost(self, s: Session, w: Work) -> bool:
        """An entry with rows that names the call carrying the rows below it (``after``: a client
        catching up sends each span's new rows alone, the rows below on their way in that call) when
        another call's rows reached the session last (that call was lost, or refused: the session may
        hold an older span's rejected rows there): answered MISSING_ROWS, nothing applied (the
        client resends from its buffer), True. A commit's ``after`` is checked when it drafts."""
        if not w.after or w.taps is None or w.phase == Phase.COMMIT or w.restart:
            return False
        if not s.rows_call or w.after == s.rows_call:  # no rows ever queued here: a gap restart is safe
            return False
        why = f"the rows below {w.pos} (call {w.after}) did not reach the session last: not applied"
        self._resolve(w, _missing(s, why), rows_done=True, why="missing_rows")
        return True

    def _fold_commit(self, s: Session, w: Work) -> bool:
        """Fold a commit (no rows) into its session's early taps still waiting (see the module
        docstring): the taps' work takes the commit's call, anchor, k and end. False if there are none."""
        t = s.pending[-1] if s.pending else None
        if w.rows or t is None or t.phase != Phase.TAPS or t.taps is None or not t.pos < w.pos <= t.pos + t.rows:
            return False
        if w.restart or (w.after and w.after != t.call.call_id):
            return False
        cut = t.pos + t.rows - w.pos  # rejected drafts' rows: never ingested
        if cut:
            self.admission.retire_rows(t.call.owner, cut)
            t.taps = t.taps[: w.pos - t.pos]
        t.call, t.idx, t.anchor, t.k, t.sampling, t.end = w.call, w.idx, w.anchor, w.k, w.sampling, w.end
        t.phase = Phase.WHOLE
        return True

    def _rows_missing(self, s: Session, w: Work) -> bool:
        """A commit whose session does not hold every row below its first row (or, marked
        ``restart``, brings none of its own): answered MISSING_ROWS (nothing applied, nothing
        drafted; the client resends), True."""
        if w.restart:  # nothing below its first row counts: its own rows are the whole context
            held = w.rows > 0
        else:
            held = s.known and s.start <= w.pos <= s.end and (not w.after or w.after == s.taps_call)
        if w.phase != Phase.COMMIT or w.pos == 0 or held:
            return False
        s.pending.remove(w)
        self._resolve(w, _missing(s, f"rows below {w.pos} not held"), rows_done=True, why="missing_rows")
        return True

    def _has_decode_work(self) -> bool:
        return any(s.pending and s.pending[0].rows <= self.chunk for s in self.sessions)

    def _iteration(self) -> bool:
        now = time.monotonic()
        self._expire(now)
        ready: dict[bytes, list[Session]] = {}
        early: dict[bytes, list[Session]] = {}  # nothing but early taps queued: only in a batch without drafts
        prefill: Session | None = None
        for s in self.sessions:
            if not s.pending:
                continue
            w = s.pending[0]
            if w.rows > self.chunk:
                if prefill is None or w.call.recv_t < prefill.pending[0].call.recv_t:
                    prefill = s
                continue
            urgent = w.phase != Phase.TAPS or any(x.k for x in s.pending)
            (ready if urgent else early).setdefault(s.owner, []).append(s)
        decode: list[tuple[Session, list[Work]]] = []  # each session's run, in queue order
        rows = 0
        # decode rows beside the prefill chunk; the first entry always goes (each fits max_batch_rows
        # alone, and a budget of 0 when max_batch_rows == prefill_chunk_rows must not starve decode)
        budget = self.max_batch_rows - (self.chunk if prefill is not None else 0)
        clients = list((ready or early).values())
        if clients:
            self._rr = (self._rr + 1) % len(clients)
            clients = clients[self._rr :] + clients[: self._rr]  # who goes first rotates
        for turn in range(max((len(c) for c in clients), default=0)):  # one session per client per turn
            for c in clients:
                if turn >= len(c) or len(decode) >= self.max_batch_sessions:
                    continue
                w = c[turn].pending[0]
                n = w.rows
                if decode and rows + n > budget:
                    continue
                decode.append((c[turn], [w]))
                rows += n
        if early and not ready and prefill is None and self._commits_due(early, now):
            return True  # waited for commits that follow their taps: the next pass folds them in
        if self._commit_wait_t0 is not None:  # the wait is over: the commits came (or their bound passed)
            self.metrics.later.later(self.metrics.commit_wait.observe, now - self._commit_wait_t0)
            self._commit_wait_t0 = None
        self._extend_runs(decode, budget - rows, taps_ok=not ready)
        if not decode and prefill is None:
            return False
        if decode and self._hold(decode, now):
            return True  # waited for clients due back: the next pass takes them in
        if self._socket is not None and (prefill is not None or self.admission.iter_ewma_s > LONG_BATCH_S):
            self._socket[3]()  # a long batch ahead: the I/O thread watches the socket meanwhile
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
        self.admission.iter_ewma_s = 0.8 * self.admission.iter_ewma_s + 0.2 * dt
        m = self.metrics
        m.later.later(m.iteration.observe, dt)
        return True

    def _hold(self, decode: list[tuple[Session, list[Work]]], now: float) -> bool:
        """Hold the decode batch being formed for clients due back soon (module docstring): wait
        for their calls (or the hold's end) and return True, or False to run the batch now.

        Whom to wait for: holding T costs each of the P sessions drafting now T; each of the E
        sessions due back saves the rest of this batch and its own (b - T, b the batch time) by
        riding along. So the hold is worth it while T < b * E / (E + P): of the clients in the order
        they are expected, the most whose last expected arrival still meets that. Each is waited for
        until 1.25 of its turnaround at most."""
        drafting = [w for _, run in decode for w in run if w.k]
        if self.window_s or not drafting or len(decode) >= self.max_batch_sessions:
            return self._end_hold(now)
        if self._hold_until is None:  # a new batch: whom to wait for, and how long at most
            b = self._draft_ewma_s
            cad = self._cadence
            due = {o: c for o, c in cad.items() if c.awaiting and 0.0 <= c.turn_s < b and now < c.due()}
            if due:  # not those with work queued already (a batch too full for it, a prefill)
                for s in self.sessions:
                    if s.pending:
                        due.pop(s.owner, None)
            # the longest prefix, in order of expected arrival, whose last arrival is worth its wait
            order = sorted(due.items(), key=lambda oc: oc[1].expected())
            take, e, p = 0, 0, len(drafting)
            for i, (_, c) in enumerate(order):
                e += c.drafts
                if c.expected() - now <= b * e / (e + p):
                    take = i + 1
            if not take:
                return False
            self._hold_for.update(o for o, _ in order[:take])
            until = max(c.due() for _, c in order[:take])
            # never past the point where a waiting entry could no longer draft within its budget
            self._hold_until = min(until, min(w.call.deadline for w in drafting) - 1.5 * b)
            self._hold_t0 = now
        if now >= self._hold_until or not any(cad.awaiting for o in self._hold_for if (cad := self._cadence.get(o))):
            return self._end_hold(now)
        self._wait(self._hold_until - now)
        return True

    def _commits_due(self, early: dict[bytes, list[Session]], now: float) -> bool:
        """Nothing but early taps queued, and a call of them said its commits follow at once (predicted
        commits, ``Step.commit_follows``): wait for those commits, until ``commit_wait_s`` after the
        call came at most, and return True (each folds into its session's taps: rows and drafts in one
        batch, instead of an ingest batch the commit would queue behind); False to ingest now. A client
        whose newer call already brought commits has none due."""
        until = 0.0
        for owner, sessions in early.items():
            seen = self._commits_seen.get(owner, 0)
            for s in sessions:
                c = s.pending[0].call
                if not c.commit_follows or c.call_id <= seen:
                    continue
                if now >= c.recv_t + self.commit_wait_s:  # lost, or a client far slower than its hint: no more waits
                    c.commit_follows = False
                    self.metrics.commit_wait_timeouts.inc()
                    continue
                until = max(until, c.recv_t + self.commit_wait_s)
        if not until:
            return False
        if self._commit_wait_t0 is None:
            self._commit_wait_t0 = now
        self._wait(until - now)
        return True

    def _end_hold(self, now: float) -> bool:
        """The batch being formed runs now: the hold (if any) is over and observed. Returns False."""
        if self._hold_until is not None and now > self._hold_t0:
            self.metrics.later.later(self.metrics.batch_hold.observe, now - self._hold_t0)
        self._hold_until = None
        self._hold_for.clear()
        return False

    def _extend_runs(self, decode: list[tuple[Session, list[Work]]], left: int, taps_ok: bool) -> None:
        """Grow each session's run past its head entry in the ``left`` rows (point 3 of the module
        docstring): one entry per session per pass, in the order the heads were taken."""
        grow = decode
        while grow and left > 0:
            more = []
            for s, run in grow:
                w = run[-1]
                if w.k or len(run) == len(s.pending):
                    continue
                nxt = s.pending[len(run)]
                # from inside w's rows or right after them (``_decode_batch`` cuts w's rows at nxt.pos);
                # a restart heads its own run: every item of a run has one context start
                if not w.pos < nxt.pos <= w.pos + w.rows or nxt.rows > min(self.chunk, left) or nxt.restart:
                    continue
                if nxt.phase == Phase.TAPS and not taps_ok and not any(x.k for x in s.pending):
                    continue
                run.append(nxt)
                left -= nxt.rows
                more.append((s, run))
            grow = more

    def _flush_metrics(self) -> None:
        """Apply the metric updates queued so far (each iteration's replies are out by now, so
        they are off their path)."""
        self.metrics.later.flush()

    def _expire(self, now: float) -> None:
        early = False
        limit = now + self._draft_ewma_s  # an entry due before this could not draft in time
        for s in self.sessions:
            for w in s.pending:
                if w.k and limit > w.call.deadline:
                    early = early or now <= w.call.deadline
                    self._resolve(w, EntryResult(Status.EXPIRED, end=w.end, message="budget passed before drafting"))
                    w.k = 0
        if early:
            # Work refused on the estimate alone never drafts, so the estimate could never come down
            # again: one stall (SIGSTOP, a GPU hiccup inside draft()) would expire everything forever.
            # Halve it instead, so drafting is tried again within a few iterations.
            self._draft_ewma_s *= 0.5

    def _place(self, s: Session, w: Work, rows: int) -> bool:
        """Positional semantics for ``rows`` rows at w.pos: reserve KV and set the session's [start, end).

        False (session unchanged) when the KV cache has no room even after evicting idle sessions.
        """
        pos = w.pos
        keep = s.known and s.start <= pos <= s.end and not w.restart
        start = s.start if keep else pos  # append/overwrite, else restart here
        end = pos + rows
        if not self.admission.reserve(s, start, end + (self.drafter.scratch_rows if w.k else 0)):
            return False
        if s.known and (pos > s.end or (w.restart and pos > s.start)):
            self.metrics.restarts.labels("gap").inc()
        elif not s.known and pos > 0:
            why = self.sessions.released_as(s.key)
            cause = {"lru": "evicted", "ttl": "ttl", "free": "freed", "error": "error"}.get(why or "", "unknown")
            self.metrics.restarts.labels(cause).inc()
        s.start, s.end, s.known = start, end, True
        w.restart = False  # done: a prefill's next chunk appends to this one
        return True

    def _kv_full(self, s: Session, w: Work) -> None:
        """Entry ``w`` of ``s`` found no KV room: answer it overloaded, its rows dropped. The session
        stops claiming rows from w.pos on: what it held there is not what its client sent (with early
        taps, an older span's rejected rows, and an ingest-only entry was acknowledged when queued),
        so a commit past w.pos is MISSING_ROWS, never drafted from them."""
        s.pending.remove(w)
        if s.known and s.start <= w.pos < s.end:
            s.end = w.pos
        self._resolve(w, self.admission.overloaded("draft KV cache full"), rows_done=True, why="kv_full")

    def _drafter_failed(self, placed: list[tuple[Session, Work]], e: Exception) -> None:
        """The drafter raised on these entries: each is answered INTERNAL (its rows dropped), then
        their sessions are released (with whatever else they had queued)."""
        err = EntryResult(Status.INTERNAL, message=f"drafter error: {type(e).__name__}")
        for _, w in placed:
            self._resolve(w, err, rows_done=True, why="drafter_error")
        for s in {id(s): s for s, _ in placed}.values():
            self._release(s, "error")

    def _decode_batch(self, batch: list[tuple[Session, list[Work]]], t0: float) -> None:
        m = self.metrics
        later = m.later.later
        ingest: list[IngestItem] = []
        drafts: list[tuple[Session, Work]] = []
        placed: list[tuple[Session, Work]] = []
        retired: dict[bytes, int] = {}  # rows per client the batch takes out of admission's queue
        n_rows = 0
        for s, run in batch:
            items: list[IngestItem] = []
            for w in run:  # in queue order: each is placed on the context the one before it left
                if w.phase == Phase.COMMIT and self._rows_missing(s, w):
                    break
                n = w.rows
                if not self._place(s, w, n):
                    self._kv_full(s, w)
                    break  # the run's next entry would restart the session below rows placed here
                if items and w.pos < items[-1].pos + len(items[-1].taps):
                    # w, placed, overwrites the entry before it from its first row on (an early-taps
                    # span over the last span's rejected rows, a resend): that entry's rows past w.pos
                    # never go in, so none lands outside the span w left reserved. Cut only once w is
                    # placed: an entry refused here leaves the one before it whole, as it claimed.
                    prev = items[-1]
                    n_rows -= prev.pos + len(prev.taps) - w.pos
                    items[-1] = IngestItem(prev.key, prev.start, prev.pos, prev.taps[: w.pos - prev.pos], prev.fmt)
                if n:
                    items.append(IngestItem(s.handle, s.start, w.pos, w.taps, w.fmt))  # type: ignore[arg-type]
                    n_rows += n
                placed.append((s, w))
                call = w.call
                if n:
                    retired[call.owner] = retired.get(call.owner, 0) + n
                if w.k:
                    drafts.append((s, w))
                wait = t0 - call.recv_t  # observed once per call, with its reply (``_reply``)
                if wait > call.queue_s:
                    call.queue_s = wait
            ingest += _joined(items, self.chunk)
        items = []  # else the loop's last items keep their rows, and so their shm region, past the replies
        try:
            td = time.monotonic()
            outs = self.drafter.step(
                ingest, [DraftItem(s.handle, s.start, s.end, w.anchor, w.k, w.sampling) for s, w in drafts]
            )
            if drafts:
                self._draft_ewma_s = 0.8 * self._draft_ewma_s + 0.2 * (time.monotonic() - td)
        except Exception as e:
            log.exception("drafter failed on a batch of %d entries", len(placed))
            self.metrics.engine_errors.inc()
            self._drafter_failed(placed, e)
            return
        ingest.clear()  # the rows are in the KV cache: let go of them (a shm region is free once unreferenced)
        dt = time.monotonic() - t0
        if n_rows:
            later(m.rows_ingested.inc, n_rows)
        later(m.batch_rows.observe, n_rows)
        later(m.batch_sessions.observe, len(drafts))
        for call in {id(w.call): w.call for _, w in placed}.values():
            call.compute_s += dt  # once per call: its entries shared this batch
        for s, w in placed:  # each session's placed entries are its queue's head, in order
            s.pending.popleft()
            w.taps = None
        for owner, rows in retired.items():
            self.admission.retire_rows(owner, rows)
        drafted = sum(len(out.tokens) for out in outs)
        if drafted:  # queued before the replies go: a scrape after a reply counts its drafts
            later(m.drafted_tokens.inc, drafted)
        for (s, w), out in zip(drafts, outs, strict=True):
            tokens = tuple(out.tokens)
            if out.confidence or out.probs is not None:
                self._resolve(w, self._rich_result(s, w, out, tokens))
            else:
                self._resolve(w, EntryResult(_OK, tokens, w.end, start=s.start))

    @staticmethod
    def _rich_result(s: Session, w: Work, out: DraftOut, tokens: tuple[int, ...]) -> EntryResult:
        """A drafted entry's result with its confidences and, as frames of the reply, its probabilities."""
        probs = prob_ids = None
        if out.probs is not None and out.prob_ids is not None:  # frames of the reply
            payloads = w.call.payloads
            probs = spec_for(out.probs, DType.F32, len(payloads))
            prob_ids = spec_for(out.prob_ids, DType.I32, len(payloads) + 1)
            payloads += [np.ascontiguousarray(out.probs, np.float32), np.ascontiguousarray(out.prob_ids, np.int32)]
        conf = tuple(out.confidence) if out.confidence else ()
        return EntryResult(_OK, tokens, w.end, confidence=conf, probs=probs, prob_ids=prob_ids, start=s.start)

    def _prefill_chunk(self, s: Session, t0: float) -> None:
        w = s.pending[0]
        assert w.taps is not None
        n = min(self.chunk, w.rows)
        if self._rows_missing(s, w):
            return
        if not self._place(s, w, n):
            self._kv_full(s, w)
            return
        try:
            self.drafter.ingest([IngestItem(s.handle, s.start, w.pos, w.taps[:n], w.fmt)])
        except Exception as e:
            log.exception("drafter failed on a prefill chunk")
            self.metrics.engine_errors.inc()
            self._drafter_failed([(s, w)], e)
            return
        self.metrics.prefill_chunks.inc()
        self.metrics.rows_ingested.inc(n)
        self.admission.retire_rows(w.call.owner, n)
        w.taps = w.taps[n:]
        w.pos += n
        w.call.compute_s += time.monotonic() - t0
        if not len(w.taps):
            w.taps = None
            if not w.k:  # k>0 stays at the head with no rows left: drafted in the next decode batch
                s.pending.popleft()

    # ------------------------------------------------------------------ bookkeeping

    def _resolve(self, w: Work, result: EntryResult, rows_done: bool = False, why: str = "released") -> None:
        """Give entry w its result (once). rows_done: its rows will not be ingested (``why``)."""
        call = w.call
        if rows_done and w.taps is not None:
            self.admission.retire_rows(call.owner, len(w.taps))
            if call.results[w.idx] is not None:  # acknowledged already (ingest only): say it in a metric
                self.metrics.rows_dropped.labels(why).inc(len(w.taps))
            w.taps = None
        if call.results[w.idx] is not None:
            return
        call.results[w.idx] = result
        call.remaining -= 1
        if call.remaining == 0:
            self._reply(call)

    def _reply(self, call: Call) -> None:
        now = time.monotonic()
        results: tuple[EntryResult, ...] = tuple(call.results)  # type: ignore[arg-type]
        self.metrics.count_entries(results)  # queued before the send: a scrape after the reply counts it
        res = StepResult(
            call_id=call.call_id,
            epoch=self.epoch,
            contract_id=self.contract_id,
            results=results,
            timing=Timing(
                queue_ms=round(call.queue_s * 1000, 4),
                compute_ms=round(call.compute_s * 1000, 4),
                server_ms=round((now - call.recv_t) * 1000, 4),
            ),
            advised_k=self.admission.advised_k(self.drafter.contract.block_size),
        )
        drafted = sum(1 for r in results if r.drafts) if call.compute_s > 0 else 0
        if drafted:  # drafts from a batch: on the engine thread
            c = self._cadence.get(call.owner)
            if c is None:
                c = self._cadence[call.owner] = _Cadence()
            c.reply_t, c.awaiting, c.drafts = now, True, drafted
        m = self.metrics
        m.later.later(m.step_latency.observe, now - call.recv_t)
        if call.compute_s > 0:  # a batch served it: its wait for the batch that took its last entry
            m.later.later(m.queue_wait.observe, call.queue_s)
        self.send_reply(call.ident, res, call.payloads)

    def _release(self, s: Session, reason: str) -> None:
        for w in self.sessions.release(s, reason):
            self._resolve(w, EntryResult(Status.EXPIRED, message=f"session released ({reason})"), rows_done=True)

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < min(1.0, self.ttl_s / 4):
            return
        self._last_sweep = now
        self.sessions.expire_idle(now)
        for o in [o for o, c in self._cadence.items() if now - c.reply_t > HOLD_FORGET_S]:
            del self._cadence[o]
        if self._commits_seen:
            live = self.sessions.owners()
            self._commits_seen = {o: c for o, c in self._commits_seen.items() if o in live}
        self.metrics.kv_used.set(self.drafter.used_tokens())

    def _fail_all_pending(self, why: str) -> None:
        for s in list(self.sessions):
            for w in list(s.pending):
                self._resolve(w, EntryResult(Status.INTERNAL, message=why), rows_done=True)
            s.pending.clear()


def _missing(s: Session, message: str) -> EntryResult:
    """MISSING_ROWS (nothing applied: the client resends), with what session ``s`` holds."""
    return EntryResult(
        Status.MISSING_ROWS, end=s.end if s.known else -1, start=s.start if s.known else -1, message=message
    )


def _joined(items: list[IngestItem], most: int) -> list[IngestItem]:
    """A session's run of ingest items (exact appends, in order) as few items as can be: neighbouring
    host rows of one wire format and layout in one array of at most ``most`` rows (the prefill chunk:
    no item is longer than one entry could be, so the drafter's working memory stays what it was);
    the drafter ingests an item in one pass, a session repeated in one call in a pass per repeat.
    Rows on the device stay their own items."""
    if len(items) < 2:  # the common case: one entry per session in a decode batch
        return items
    out: list[IngestItem] = []
    parts: list[list[np.ndarray]] = []
    rows: list[int] = []
    for it in items:
        a, b = (out[-1].taps, it.taps) if out else (None, None)
        if (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and out[-1].fmt == it.fmt
            and (a.dtype, a.shape[1:]) == (b.dtype, b.shape[1:])
            and rows[-1] + len(b) <= most
        ):
            parts[-1].append(b)
            rows[-1] += len(b)
        else:
            out.append(it)
            parts.append([it.taps])  # type: ignore[list-item]
            rows.append(len(it.taps) if it.taps is not None else 0)
    for it, p in zip(out, parts, strict=True):
        if len(p) > 1:
            it.taps = np.concatenate(p)
    return out
