"""One synthetic target engine of draft-soak, run as its own process with its own client.

The client is a DraftClient for one server, a FleetClient when the endpoint names several
(``target_client.make_client``); with a fleet every session also records the server it is on,
and every move to another server how many steps it went without drafts until drafts came back
(``moves``: the must-show of issue 15, at most 2).

Owns ``EngineSpec`` and ``engine_main``. The engine holds up to ``sessions`` concurrent
sessions; new ones arrive as others finish (at most ``arrivals_per_step`` per step, so arrivals
are staggered). A session prefills (a short prompt, or now and then a long one sent as an
ingest-only k=0 step), then decodes: every step commits 1..k+1 rows (anchor plus accepted
drafts), with now and then a k=0 step in between, and finishes with a Free. Between steps the
engine sleeps ``step_ms`` (its own verify forward).

Early taps (``early_taps``, chaos mode "taps"): when the server offers them, every step first
sends its span as an early Taps (``send_taps``: the committed rows plus the step's rejected
drafts' rows, random ones the commit's position cuts off), then the drafts request as a commit
(``commit``: no rows, pos = the committed end); the call record's wait is the commit's. A
MISSING_ROWS answer (its Taps was lost) is a miss like any other, and the checksum check is the
same: OK drafts must be those of exactly the context the reply names. With ``mispredict_p`` >= 0
the commits are predicted before the taps go, as the vLLM proposer predicts them
(``target_client.client.predicted``), a ``mispredict_p`` share of them at another end or anchor
(their own generator: the sessions' rows and anchors stay those of the reference): a predicted
request's taps stop at its predicted end, its commit goes right after the taps, and the real
commits are settled after the call's start as the proposer settles them.

Determinism: every random choice of a session (length, prompt, taps, anchors, acceptance,
k=0 steps) comes from that session's own generator seeded by (seed, engine, session number),
and sessions arrive in a fixed order, so the same seed gives the same sessions, rows and
anchors whatever the server answered. That makes a fault-free reference possible: with the
checksum drafter the engine computes the exact expected drafts of every entry from the rows it
sent (``checksum.drafts_from_digests``, context [0, pos)); with a real model the soak runs a
second fault-free pass and compares each session's draft hash.

Every call is recorded (start, wait, statuses, drafts counts, invalid drafts) and every
session summarised (all OK?, drafts checked / mismatched, draft hash, lifetime); the records
go to one JSON file that the soak parent reads.
"""

from __future__ import annotations

import array
import gc
import json
import os
import resource
import sys
import threading
import time
import traceback
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

# Columns of a call record (kept as lists for a compact JSON file).
CALL_COLUMNS = (
    "t0",  # time.monotonic() at the call (system-wide clock, comparable across processes)
    "wait_ms",
    "budget_ms",
    "entries",
    "rows",  # rows sent by the engine in this call (resends not included)
    "want",  # entries with k > 0
    "drafted",  # entries that got drafts
    "ok",
    "none",  # no answer (timeout, breaker open, unreachable)
    "expired",
    "overloaded",
    "bad_entry",
    "internal",
    "bad_drafts",  # replies with drafts of the wrong count or outside the vocabulary
    "mismatch",  # checksum drafter: OK drafts that differ from the checksum of the context the reply names
    "restarted",  # OK entries whose reply names a context starting after row 0 (the server restarted it)
    "epoch_idx",
    "run_delay_ms",  # time the calling thread sat runnable but not running during the call (host CPU)
    "proc_run_delay_ms",  # the same summed over all threads of the process (e.g. the client's I/O thread)
    # Forensics for calls over budget (where the rest of the time went):
    "cpu_ms",  # on-CPU time of the calling thread during the call
    "proc_cpu_ms",  # on-CPU time of every thread of the process (a GIL holder shows up here)
    "gc_ms",  # time this process spent in the cyclic garbage collector (holds the GIL)
    "steal_ms",  # host-wide steal time (the hypervisor ran another guest), summed over vCPUs
    "majflt",  # major page faults of the process (blocked on I/O)
    "missing_rows",  # commits answered MISSING_ROWS (early taps: their Taps never arrived)
    "psi_ms",  # host-wide time some task waited for a CPU (/proc/pressure/cpu): the servers' too
)


@dataclass
class EngineSpec:
    index: int
    endpoint: str
    out_path: str
    seed: int = 0
    sessions: int = 16  # concurrent sessions
    budget_ms: float = 20.0
    step_ms: float = 25.0  # the target's own step time between calls
    k: int = 4
    decode_steps: tuple[int, int] = (20, 60)
    prefill_rows: tuple[int, int] = (16, 128)
    long_prefill_p: float = 0.03
    long_prefill_rows: int = 2048
    k0_p: float = 0.03  # chance that a decode step is ingest-only (k=0)
    accept_p: float = 0.6
    arrivals_per_step: int = 2
    checksum: bool = True  # the server runs the checksum drafter: check drafts in process
    max_steps: int = 0  # stop after this many steps (0: run until told to stop)
    reconnect_ivl_ms: int = 10
    breaker_backoff_ms: float = 500.0
    connect_timeout_s: float = 60.0
    early_taps: bool = False  # taps right after the "forward", then a commit (see the module docstring)
    # with early taps: predicted commits right after the taps, this share of them wrong
    mispredict_p: float = -1.0  # -1: no predicted commits
    # Dump every thread's stack for a call still waiting at budget + 5 ms (the ``.stacks`` file the
    # soak reads; ``LateStacks``). Off for runs that never read the stacks.
    late_stacks: bool = True
    # "shm": rows through the client's shared-memory ring, written into regions it claims when one is
    # free (``_in_ring``), as the vLLM proposer does; "frames": in the messages
    transport: str = "frames"


@dataclass
class _Session:
    number: int
    sid: str
    rng: np.random.Generator
    steps_left: int
    end: int = 0
    k_prev: int = 0
    digest_total: int = 0
    cum: list[int] = field(default_factory=lambda: [0])  # digest sums of rows [0, i), for any named start
    steps: int = 0
    all_ok: bool = True
    checked: int = 0
    mismatched: int = 0
    draft_crc: int = 0
    first_t0: float = 0.0
    last_t1: float = 0.0
    epochs: set[str] = field(default_factory=set)
    long_prefill: bool = False
    k0_then_draft: int = 0  # k=0 steps followed by a checked drafting step
    restarted: int = 0  # OK replies naming a context that starts after row 0
    server: str = ""  # fleet: the server the session is on ("" with one server)
    first_server: str = ""
    moves: int = 0  # fleet: times it moved to another server
    miss_run: int = 0  # steps wanting drafts without them, in a row
    miss_t0: float = 0.0  # start of the first of them
    miss_expired: int = 0  # of them: answered expired
    miss_overloaded: int = 0  # ... answered overloaded
    moved_in_run: str = ""  # the server it left during the current run ("" if none)
    left: set[str] = field(default_factory=set)  # servers it moved away from
    moved_back: int = 0  # moves to a server it had left before (a fleet never does that)
    tokens: array.array | None = None  # every draft token, kept for model drafters (compared with the reference)
    # t0 of its ingest-only steps sent as early Taps: nobody waits for those, so their reply is taken
    # as OK; if the proxy dropped that Taps, rows past the client's resend buffer are lost (a long
    # prompt's) and the server restarts the session later (the report counts it touched then)
    unwaited_t0: list[float] = field(default_factory=list)
    # the first OK reply naming a later start: (its step, t0, the start named, the context end before
    # the step, the entry's pos, rows, k, whether the step went as early taps, the client's
    # ``SessionRows.lost_end`` then: >= 0 when the client itself marked the session's entries restart)
    first_restart: tuple[float, ...] = ()

    def summary(self, finished: bool) -> tuple[Any, ...]:
        # a tuple of numbers (and a tuple of tokens): the collector stops tracking it, so a
        # 30-minute run's 70,000 summaries add nothing to the engine's full collections (one of
        # those took 57 ms inside a step before)
        return (
            self.number,
            self.steps,
            int(self.all_ok),
            self.checked,
            self.mismatched,
            self.draft_crc,
            self.first_t0,
            self.last_t1,
            len(self.epochs),
            int(finished),
            int(self.long_prefill),
            self.k0_then_draft,
            self.restarted,
            tuple(self.tokens) if self.tokens is not None else (),
            self.first_server,
            self.moves,
            self.moved_back,
            tuple(self.unwaited_t0),
            self.first_restart,
        )


SESSION_COLUMNS = (
    "number",
    "steps",
    "all_ok",
    "checked",
    "mismatched",
    "draft_crc",
    "first_t0",
    "last_t1",
    "epochs",
    "finished",
    "long_prefill",
    "k0_then_draft",
    "restarted",
    "tokens",
    "first_server",
    "moves",
    "moved_back",
    "unwaited_t0",
    "first_restart",
)
# Columns of a fleet move record: a session changed server and drafted again (or never did).
MOVE_COLUMNS = (
    "t_first_miss",  # start of its first step without drafts around the move (or of the step it moved in)
    "steps_without",  # steps wanting drafts that got none, in a row, until drafts came back
    "t_back",  # end of the step that brought drafts back (-1: the session ended first)
    "number",  # the session
    "from_server",  # the server it left (index in the engine's endpoint list; -1: not in it)
    "to_server",  # the server it drafted on again (or was on when it ended)
    "expired",  # of the steps without drafts: answered expired (the server was alive, behind its budget)
    "overloaded",  # ... answered overloaded
)


_gc_ns = 0  # total time in the cyclic GC, kept by _gc_callback
_gc_started = 0


def _gc_callback(phase: str, info: dict[str, int]) -> None:
    global _gc_ns, _gc_started
    if phase == "start":
        _gc_started = time.perf_counter_ns()
    elif _gc_started:
        _gc_ns += time.perf_counter_ns() - _gc_started
        _gc_started = 0


_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def _steal_ms() -> float:
    """Host-wide steal time so far (ms, summed over vCPUs, clock-tick resolution), 0 if unknown."""
    try:
        with open("/proc/stat", "rb") as f:
            return int(f.readline().split()[8]) * _TICK_MS
    except (OSError, ValueError, IndexError):
        return 0.0


def _psi_ms(resource: str = "cpu", kind: str = "some") -> float:
    """Host-wide pressure stall time so far (ms; Linux PSI ``/proc/pressure/RESOURCE``, line ``KIND``'s
    ``total``, any process's), 0 if unknown."""
    try:
        with open(f"/proc/pressure/{resource}", "rb") as f:
            for line in f:
                if line.startswith(kind.encode()):
                    return int(line.rsplit(b"total=", 1)[1]) / 1000.0
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def _psi_cpu_ms() -> float:
    """Host-wide CPU pressure so far: time in which some runnable task waited for a CPU (the servers'
    included)."""
    return _psi_ms("cpu", "some")


def _thread_sched_ns() -> tuple[int, int]:
    """(on-CPU, run-queue wait) of the calling thread so far, in ns (/proc/thread-self/schedstat)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            v = f.read().split()
            return int(v[0]), int(v[1])
    except (OSError, ValueError, IndexError):
        return 0, 0


def _proc_sched_ns() -> tuple[int, int]:
    """(on-CPU, run-queue wait) summed over every thread of this process so far, in ns."""
    cpu = wait = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                    v = f.read().split()
                    cpu += int(v[0])
                    wait += int(v[1])
            except (OSError, ValueError, IndexError):
                pass
    except OSError:
        pass
    return cpu, wait


def _run_delay_ns() -> int:
    """Run-queue wait of the calling thread so far (ns), 0 if unknown."""
    return _thread_sched_ns()[1]


def _proc_run_delay_ns() -> int:
    """Run-queue wait summed over every thread of this process so far (ns), 0 if unknown.

    A thread preempted while it holds the GIL keeps the caller waiting without the caller itself
    being on the run queue; this sum sees that wait too."""
    return _proc_sched_ns()[1]


def _bf16_taps(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    """Rows of bf16 bit patterns of N(0, 1) values (finite, like real hidden states)."""
    x = rng.standard_normal((rows, width), dtype=np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


class LateStacks:
    """Every other thread's Python stack, written to ``file`` when a call is still running
    ``after_s`` after ``arm()`` (``disarm()`` when it returns), in faulthandler's text format.

    A thread of its own reads ``sys._current_frames()`` holding the GIL, so it never walks a frame
    that is changing under it. faulthandler's ``dump_traceback_later`` walks them without the GIL
    while they run, and now and then that segfaulted the engine (in traceback.c), the more often
    the more calls ran late, as on a loaded host. The price: the dump waits for the GIL (at most
    the interpreter's switch interval while another thread holds it), which the stack then shows.
    """

    def __init__(self, file: Any, after_s: float) -> None:
        self._file, self._after = file, after_s
        self._cv = threading.Condition()
        self._due: float | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="late-stacks", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        with self._cv:
            self._due = time.monotonic() + self._after
            self._cv.notify()

    def disarm(self) -> None:
        """Waits for a dump being written, so that whatever the caller writes next follows it."""
        with self._cv:
            self._due = None

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(5.0)

    def _run(self) -> None:
        with self._cv:
            while not self._stop:
                if self._due is None:
                    self._cv.wait()
                    continue
                left = self._due - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                self._due = None
                self._file.write(self.dump().encode("utf-8", "replace"))

    @staticmethod
    def dump() -> str:
        me = threading.get_ident()
        lines = ["Timeout (late call)!"]
        for tid, frame in sys._current_frames().items():
            if tid == me:
                continue
            lines.append(f"Thread 0x{tid:016x} (most recent call first):")
            for fs in reversed(traceback.extract_stack(frame)):
                lines.append(f'  File "{fs.filename}", line {fs.lineno} in {fs.name}')
            lines.append("")
        return "\n".join(lines) + "\n"


def engine_main(spec: EngineSpec, stop: Any, ready: Any = None, go: Any = None, progress: Any = None) -> None:
    """Process entry: connect, set ``ready``, wait for ``go``, run until ``stop`` is set or
    max_steps, write the JSON (multiprocessing Events; the start barrier keeps one engine's
    imports from competing with another's first steps). ``progress`` (a shared multiprocessing
    integer, optional) holds the steps done so far, for a parent that waits for enough of them."""
    out: dict[str, Any] = {"spec": asdict(spec), "error": None, "cpus": os.cpu_count()}
    try:
        _run(spec, stop, out, ready, go, progress)
    except BaseException:  # reported by the parent as a broken engine
        out["error"] = traceback.format_exc()
    tmp = spec.out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, spec.out_path)


def _predict(reqs: list, spans: list, verified: list, rng: np.random.Generator, wrong_p: float, vocab: int) -> list:
    """Each drafting request's predicted commit (None for the others): its real commit, or with
    probability ``wrong_p`` another anchor or another end among the span's verified rows (the last
    ``verified`` rows: a prediction errs only in how many drafts are accepted, a prefill's end is
    known)."""
    from target_client import StepRequest

    out: list = []
    for q, span, v in zip(reqs, spans, verified, strict=True):
        if not q.k:
            out.append(None)
            continue
        rows, anchor = q.rows, q.anchor
        if rng.random() < wrong_p:
            rows = int(rng.integers(len(span) - v + 1, len(span) + 1))
            anchor = anchor if rng.random() < 0.5 else int(rng.integers(0, vocab))
        out.append(StepRequest(q.session, q.pos + rows, 0, anchor, q.k))
    return out


def _in_ring(client: Any, rows: np.ndarray) -> np.ndarray:
    """``rows`` written into a region of the client's shared-memory ring it claims (sent where they
    lie; the client counts them in ``rows_in_place``), else ``rows`` as they are (not connected,
    the ring full, a fleet)."""
    claim = getattr(client, "claim_rows", None)
    buf = claim(rows.nbytes) if claim is not None and rows.nbytes else None
    if buf is None:
        return rows
    view = buf.view(rows.dtype).reshape(rows.shape)
    view[:] = rows
    return view


def _run(spec: EngineSpec, stop: Any, out: dict[str, Any], ready: Any, go: Any, progress: Any) -> None:
    from prometheus_client import CollectorRegistry

    from draft_server.drafters.checksum import drafts_from_digests, row_digest
    from protocol import Status
    from target_client import ClientConfig, DraftReply, FleetClient, StepRequest, make_client
    from target_client.client.predicted import PredictedCommits

    client = make_client(
        ClientConfig(
            endpoint=spec.endpoint,
            budget_ms=spec.budget_ms,
            name=f"soak-e{spec.index}",
            routing_id=f"soak-e{spec.index}".encode(),
            reconnect_ivl_ms=spec.reconnect_ivl_ms,
            reconnect_ivl_max_ms=max(spec.reconnect_ivl_ms, 10),
            breaker_backoff_ms=spec.breaker_backoff_ms,
            connect_timeout_s=spec.connect_timeout_s,
            registry=CollectorRegistry(),
            transport=spec.transport,
        )
    )

    def ring_rows(rows: np.ndarray) -> np.ndarray:
        return _in_ring(client, rows) if spec.transport == "shm" else rows

    calls = array.array("d")  # flat, len(CALL_COLUMNS) per call: no GC-tracked object per call
    # A call still waiting at budget + 5 ms gets every thread's Python stack dumped (``LateStacks``),
    # followed by a marker line that names the call. The soak attaches these stacks to the calls it
    # cannot explain.
    stacks = open(spec.out_path + ".stacks", "wb", buffering=0)
    late_s = (spec.budget_ms + 5.0) / 1000.0
    watch = LateStacks(stacks, late_s) if spec.late_stacks else None
    sessions_out: list[tuple[Any, ...]] = []
    epochs: list[tuple[float, str]] = []
    fleet = client if isinstance(client, FleetClient) else None
    moves: list[tuple[float, int, float, int, int, int, int, int]] = []
    servers = spec.endpoint.split(",")

    def server_index(key: str) -> int:
        return servers.index(key) if key in servers else -1

    loads: list[tuple[float, dict[str, int]]] = []  # fleet: sessions per server, every 20 steps
    try:
        welcome = client.connect(wait=True)
        assert welcome is not None
        contract = welcome.contract
        vocab, width, k = contract.vocab_size, contract.tap_width, min(spec.k, contract.block_size)
        limits = welcome.limits
        # a long prompt must fit one message with room for the rest of the batch
        row_bytes = width * contract.tap_dtype.itemsize
        fit = min(limits.max_rows_per_step, limits.max_message_bytes // row_bytes) // 2
        long_rows = min(spec.long_prefill_rows, fit)
        gc.freeze()  # imports and setup out of the collector's way: fewer, shorter pauses in the calls
        gc.callbacks.append(_gc_callback)
        if ready is not None:
            ready.set()
        if go is not None and not go.wait(spec.connect_timeout_s + 120.0):
            raise RuntimeError("the soak never gave the start signal")
        epoch_idx: dict[str, int] = {}
        guess_rng = np.random.default_rng([spec.seed, spec.index, 1 << 30])  # predictions only
        active: list[_Session] = []
        started = 0
        step_no = 0
        parent = os.getppid()
        while not stop.is_set() and (spec.max_steps <= 0 or step_no < spec.max_steps):
            if step_no % 64 == 0 and os.getppid() != parent:
                break  # the soak died: stop, never outlive it
            arrivals = 0
            while len(active) < spec.sessions and arrivals < spec.arrivals_per_step:
                rng = np.random.default_rng([spec.seed, spec.index, started])
                lo, hi = spec.decode_steps
                s = _Session(started, f"e{spec.index}-s{started}", rng, int(rng.integers(lo, hi + 1)))
                if not spec.checksum:
                    s.tokens = array.array("i")
                active.append(s)
                started += 1
                arrivals += 1
            reqs, parts, wants, spans = [], [], [], []
            for s in active:
                r = s.rng
                if s.steps == 0:
                    if r.random() < spec.long_prefill_p:
                        rows, kk = long_rows, 0  # a long prompt: ingest only, drafts next step
                        s.long_prefill = True
                    else:
                        rows, kk = int(r.integers(spec.prefill_rows[0], spec.prefill_rows[1] + 1)), k
                else:
                    accepted = 0
                    while accepted < s.k_prev and r.random() < spec.accept_p:
                        accepted += 1
                    rows = 1 + accepted
                    kk = 0 if r.random() < spec.k0_p else k
                anchor = int(r.integers(0, vocab))
                taps = _bf16_taps(r, rows, width)
                if spec.early_taps:  # the span: these rows and the rejected drafts' rows after them
                    spans.append(np.concatenate([taps, _bf16_taps(r, s.k_prev + 1 - rows, width)]) if s.steps else taps)
                reqs.append(StepRequest(s.sid, s.end, rows, anchor, kk))
                parts.append(taps)
                wants.append(kk)
            taps_all = np.ascontiguousarray(np.concatenate(parts)) if parts else None
            (tc0, rd0), (pc0, pd0) = _thread_sched_ns(), _proc_sched_ns()
            gc0, st0, mf0 = _gc_ns, _steal_ms(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            psi0 = _psi_cpu_ms()
            if watch is not None:
                watch.arm()
            guessed: list = [None] * len(reqs)
            if spec.early_taps and spec.mispredict_p >= 0:  # as the vLLM proposer: predict, then taps
                verified = [len(a) if s.steps else 1 for s, a in zip(active, spans, strict=True)]  # prefill: its end
                guessed = _predict(reqs, spans, verified, guess_rng, spec.mispredict_p, vocab)
            # a predicted request's taps stop at its predicted end; the others carry the whole span
            sent = (
                [a if g is None else a[: g.pos - q.pos] for q, a, g in zip(reqs, spans, guessed, strict=True)]
                if spec.early_taps
                else []
            )
            early = (
                spec.early_taps
                and bool(reqs)
                and client.send_taps(
                    [StepRequest(q.session, q.pos, len(a), 0, 0) for q, a in zip(reqs, sent, strict=True)],
                    ring_rows(np.ascontiguousarray(np.concatenate(sent))),
                    exact=all(g is not None or len(a) == q.rows for q, a, g in zip(reqs, spans, guessed, strict=True)),
                    commit_follows=any(g is not None for g in guessed),  # as the proposer: its predictions go next
                )
            )
            guess = None
            if early and any(g is not None for g in guessed):
                at = {q.session: (q.pos, a) for q, a in zip(reqs, spans, strict=True)}
                guess = PredictedCommits.send(
                    client,
                    [g for g in guessed if g is not None],
                    lambda sid, lo, hi, at=at: at[sid][1][lo - at[sid][0] : hi - at[sid][0]],
                )
            t0 = time.monotonic()
            if early:
                wanted = [(i, q) for i, q in enumerate(reqs) if q.k]
                commits = [StepRequest(q.session, q.pos + q.rows, 0, q.anchor, q.k) for _, q in wanted]
                got = guess.settle(client, commits) if guess is not None else client.commit(commits)
                if guess is not None:  # a predicted call lost (or answered MISSING_ROWS) is a miss of its session
                    lost = (None, Status.MISSING_ROWS)  # EXPIRED: superseded by the corrected commit, by design
                    failed = {sid for sid, r in guess.predicted_replies().items() if r.status in lost}
                    for s in active:
                        s.all_ok = s.all_ok and s.sid not in failed
                replies = [DraftReply([], Status.OK) for _ in reqs]  # an ingest-only step: acknowledged early
                for (i, _), g in zip(wanted, got, strict=True):
                    replies[i] = g
            else:
                replies = client.step(reqs, ring_rows(taps_all) if taps_all is not None else None)
            t1 = time.monotonic()
            if watch is not None:
                watch.disarm()
            if watch is not None and t1 - t0 > late_s:
                stacks.write(f"@@ call t0={t0!r} wait_ms={(t1 - t0) * 1000.0:.3f}\n".encode())
            (tc1, rd1), (pc1, pd1) = _thread_sched_ns(), _proc_sched_ns()
            gc1, st1, mf1 = _gc_ns, _steal_ms(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            psi1 = _psi_cpu_ms()
            epoch = client.epoch or ""
            by_server = fleet.epochs() if fleet is not None else {}
            if epoch not in epoch_idx:
                epoch_idx[epoch] = len(epoch_idx)
                epochs.append((t1, epoch))
            rec = dict.fromkeys(CALL_COLUMNS, 0)
            rec.update(t0=t0, wait_ms=(t1 - t0) * 1000.0, budget_ms=spec.budget_ms, entries=len(reqs))
            rec["rows"] = sum(r.rows for r in reqs)
            rec["run_delay_ms"] = (rd1 - rd0) / 1e6
            rec["proc_run_delay_ms"] = (pd1 - pd0) / 1e6
            rec.update(cpu_ms=(tc1 - tc0) / 1e6, proc_cpu_ms=(pc1 - pc0) / 1e6, gc_ms=(gc1 - gc0) / 1e6)
            rec.update(steal_ms=st1 - st0, majflt=mf1 - mf0, psi_ms=psi1 - psi0)
            rec["epoch_idx"] = epoch_idx[epoch]
            finished = []
            for s, req, taps, rep in zip(active, reqs, parts, replies, strict=True):
                if spec.checksum:
                    for i in range(req.rows):
                        s.digest_total = (s.digest_total + row_digest(taps[i], req.pos + i)) & ((1 << 64) - 1)
                        s.cum.append(s.digest_total)
                s.end += req.rows
                if early and not req.k:
                    s.unwaited_t0.append(t0)
                if s.steps == 0:
                    s.first_t0 = t0
                s.last_t1 = t1
                s.steps += 1
                if fleet is None:
                    s.epochs.add(epoch)
                else:  # the epoch of the session's own server: a restart elsewhere does not touch it
                    where = fleet.server_of(s.sid) or ""
                    s.epochs.add(f"{where}={by_server.get(where)}")
                    if not s.server:
                        s.first_server = where
                    elif where != s.server:
                        s.moves += 1
                        s.moved_back += where in s.left
                        s.left.add(s.server)
                        s.moved_in_run = s.server
                        if not s.miss_run:
                            s.miss_t0 = t0
                    s.server = where
                st = rep.status
                key = "none" if st is None else st.name.lower()
                rec[key] += 1
                if st != Status.OK:
                    s.all_ok = False
                if req.k:
                    rec["want"] += 1
                if req.k and fleet is not None:
                    if rep.tokens:
                        if s.moved_in_run:
                            frm, to = server_index(s.moved_in_run), server_index(s.server)
                            run = (s.miss_t0, s.miss_run, t1, s.number, frm, to, s.miss_expired, s.miss_overloaded)
                            moves.append(run)
                        s.miss_run, s.moved_in_run, s.miss_expired, s.miss_overloaded = 0, "", 0, 0
                    else:
                        if not s.miss_run and not s.moved_in_run:
                            s.miss_t0 = t0
                        s.miss_run += 1
                        s.miss_expired += st == Status.EXPIRED
                        s.miss_overloaded += st == Status.OVERLOADED
                if rep.tokens:
                    rec["drafted"] += 1
                    s.draft_crc = zlib.crc32(np.asarray(rep.tokens, np.int64).tobytes(), s.draft_crc)
                    if s.tokens is not None:
                        s.tokens.extend(rep.tokens)
                valid = (
                    len(rep.tokens) == req.k and all(0 <= t < vocab for t in rep.tokens)
                    if st == Status.OK
                    else not rep.tokens
                )
                if not valid:
                    rec["bad_drafts"] += 1
                if st == Status.OK and rep.start > 0:
                    rec["restarted"] += 1  # the server named a context that starts after row 0
                    s.restarted += 1
                    if not s.first_restart:
                        rows = getattr(getattr(client, "_io", None), "sessions", {}).get(s.sid)
                        lost_end = rows.lost_end if rows is not None else -2
                        before = s.end - req.rows
                        s.first_restart = (s.steps, t0, rep.start, before, req.pos, req.rows, req.k, early, lost_end)
                if spec.checksum and st == Status.OK and req.k:
                    start = max(rep.start, 0)  # the context the reply names: [start, end)
                    named = (s.digest_total - s.cum[start]) & ((1 << 64) - 1) if start <= s.end else -1
                    want = drafts_from_digests([named], start, s.end, req.anchor, req.k, vocab)
                    s.checked += 1
                    if s.k_prev == 0 and s.steps > 1:
                        s.k0_then_draft += 1
                    if list(rep.tokens) != want:
                        s.mismatched += 1
                        rec["mismatch"] += 1
                s.k_prev = req.k
                s.steps_left -= 1
                if s.steps_left <= 0:
                    finished.append(s)
            calls.extend(float(rec[c]) for c in CALL_COLUMNS)
            if finished:
                client.free([s.sid for s in finished])
                for s in finished:
                    if s.moved_in_run:  # moved, and ended before drafting again
                        frm, to = server_index(s.moved_in_run), server_index(s.server)
                        run = (s.miss_t0, s.miss_run, -1.0, s.number, frm, to, s.miss_expired, s.miss_overloaded)
                        moves.append(run)
                    sessions_out.append(s.summary(True))
                active = [s for s in active if s.steps_left > 0]
            if fleet is not None and step_no % 20 == 0:
                loads.append((t1, fleet.loads()))
            step_no += 1
            if progress is not None:
                progress.value = step_no
            if spec.step_ms:
                time.sleep(spec.step_ms / 1000.0)
        if active:  # a run cut short still frees what it holds
            client.free([s.sid for s in active])
            for s in active:
                sessions_out.append(s.summary(False))
        time.sleep(0.05)  # let the Free leave before the socket closes (LINGER 0)
        out["steps"] = step_no
        out["client_stats"] = {
            k: v for k, v in client.stats().items() if isinstance(v, int | float | str | bool) or v is None
        }
    finally:
        if watch is not None:
            watch.close()
        stacks.close()
        client.close()
        n = len(CALL_COLUMNS)
        out["calls"] = [calls[i : i + n].tolist() for i in range(0, len(calls), n)]
        out["call_columns"] = list(CALL_COLUMNS)
        out["sessions"] = sessions_out
        out["session_columns"] = list(SESSION_COLUMNS)
        out["epochs"] = epochs
        out["moves"] = [list(m) for m in moves]
        out["loads"] = loads
        out["move_columns"] = list(MOVE_COLUMNS)
