"""A synthetic target engine: drives a DraftClient the way a decoding engine would.

Sessions arrive (staggered), stream a prefill, then decode: each step commits 1..k+1 rows
(anchor plus accepted drafts, acceptance drawn at random), sends one Step for the whole batch,
and finishes after a random number of steps with a Free. Taps are random bf16 bit patterns
taken as zero-copy slices of a pre-made pool. Every call is recorded (wait, statuses, drafts)
for the demo, the benchmark and the soak. Uses the client only: no server code.

``early_taps`` (when the server offers them): each step first sends its whole verified span as
early taps (the committed rows and the rejected drafts' rows after them), then spends
``sample_ms`` as the target's sampling would, then commits; the record's wait is the commit's
(the critical path). With ``predicted`` the outcome is known in advance, as greedy rejection's is
from the raw logits (the vLLM proposer's predicted commits): the taps carry only the committed rows,
the commit goes right after them, and the wait is from the end of sampling to its drafts in hand.
``draft_tools.bench.early_taps_gpu`` compares the ways at K3 size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from protocol import DType, ModelContract, Status
from target_client.api import StepRequest
from target_client.client import DraftClient


def bf16_normal(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Standard-normal values as bf16 bit patterns (uint16), like real hidden states."""
    return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


@dataclass(slots=True)
class CallRecord:
    t: float  # seconds since the run started
    wait_ms: float  # how long step() took
    budget_ms: float
    sessions: int
    rows: int
    drafted: int  # entries that got drafts
    wanted: int  # entries that asked for drafts
    tokens: int
    statuses: dict[str, int]
    bad_tokens: int = 0  # drafts outside the vocab or of the wrong count (must stay 0)
    compute_ms: float = -1.0  # the server's compute for the reply (Timing.compute_ms; -1: none came)
    early_rows: int = 0  # rows the step's early taps carried (0: none went early)
    send_ms: float = 0.0  # early taps: the engine thread's time to hand over the taps and the commit
    server_ms: float = -1.0  # the reply's Timing.server_ms (receive -> reply queued; -1: none came)
    queue_ms: float = -1.0  # the reply's Timing.queue_ms (receive -> batch start)
    # predicted commits: how long before the end of sampling the commit went out on the socket (negative:
    # after it; a commit the caller's submit could not send went with the client's I/O thread's next pass)
    commit_lead_ms: float = float("nan")


@dataclass(slots=True)
class _Session:
    sid: str
    end: int = 0  # committed context end
    steps_left: int = 0
    prefilled: bool = False


@dataclass
class SyntheticTarget:
    client: DraftClient
    contract: ModelContract
    name: str = "engine"
    sessions: int = 8  # concurrent sessions
    total_sessions: int = 0  # sessions over the whole run (0: sessions, no replacement)
    k: int = 0  # drafts per step (0: the contract's block size)
    prefill_rows: tuple[int, int] = (16, 256)
    decode_steps: tuple[int, int] = (20, 60)
    accept_p: float = 0.6  # chance each further draft is accepted
    stagger_steps: int = 1  # a new session joins every this many steps at the start
    seed: int = 0
    pool_rows: int = 8192
    early_taps: bool = False  # taps right after the "forward", a commit after sample_ms
    sample_ms: float = 0.0  # the target's sampling between its forward and the commit (busy wait)
    predicted: bool = False  # with early taps: commit right after the taps, collect after sampling
    whole_spans: bool = False  # predicted, but the taps carry the whole span (as before 2026-12-05: a baseline)
    hint: bool = True  # predicted: the taps say their commit follows (``Step.commit_follows``; off: a baseline)
    # predicted, as one message: the step's rows and drafts as the single message, sent before sampling and
    # collected after it (what a predicted span's taps and commits amount to; an experiment, 2026-12-05)
    one_message: bool = False
    # how a step's taps become its rows: "" the pool's rows as they are (no copy); "host" through the
    # vLLM proposer's encoder (``WireEncoder``: a fresh copy, from ``taps_device`` into page-locked
    # memory when it is a GPU); "ring" the same encoder writing straight into the client's shm ring
    # (``DraftClient.claim_rows``), a fresh copy when it gives no region
    encode: str = ""
    taps_device: str = "cpu"  # with ``encode``: where the pool of taps lives (the target's device)
    records: list[CallRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.k = self.k or self.contract.block_size
        self.total_sessions = self.total_sessions or self.sessions
        layout = getattr(self.client, "row_layout", None)  # the wire format's rows (projected: narrower)
        if layout is not None and layout[0] != DType.BF16:
            raise ValueError(f"the synthetic engine makes bf16 rows, not {layout[0].value}")
        self.width = layout[1] if layout is not None else self.contract.tap_width
        self.pool = bf16_normal(self.rng, (self.pool_rows, self.width))
        self._pool_off = 0
        self._device_pool = None
        if self.encode not in ("", "host", "ring"):
            raise ValueError(f"encode must be '', 'host' or 'ring', got {self.encode!r}")
        if self.encode:
            import torch

            from target_client.vllm.wire import WireEncoder

            bits = torch.from_numpy(self.pool.view(np.int16)).view(torch.bfloat16)
            self._device_pool = bits.to(self.taps_device)
            self._encoder = WireEncoder("bf16", pinned_mib=256 if self._device_pool.is_cuda else 0)
        self._started = 0
        self._active: list[_Session] = []

    def _taps(self, rows: int) -> np.ndarray | None:
        if rows == 0:
            return None
        if rows > self.pool_rows:
            return bf16_normal(self.rng, (rows, self.width))
        if self._pool_off + rows > self.pool_rows:
            self._pool_off = 0
        lo = self._pool_off
        self._pool_off += rows
        if self._device_pool is None:
            return self.pool[lo : lo + rows]
        claim = getattr(self.client, "claim_rows", None) if self.encode == "ring" else None
        return self._encoder(self._device_pool[lo : lo + rows], claim=claim)

    def _admit(self, step_no: int) -> None:
        while (
            len(self._active) < self.sessions
            and self._started < self.total_sessions
            and (
                (self._started < self.sessions and step_no >= self._started * self.stagger_steps)
                or self._started >= self.sessions
            )
        ):
            lo, hi = self.decode_steps
            s = _Session(f"{self.name}-s{self._started}", steps_left=int(self.rng.integers(lo, hi + 1)))
            self._active.append(s)
            self._started += 1

    @property
    def done(self) -> bool:
        return self._started >= self.total_sessions and not self._active

    def step(self, step_no: int, t0: float) -> CallRecord | None:
        """One engine step for every active session; returns its record (None when idle)."""
        self._admit(step_no)
        if not self._active:
            return None
        reqs: list[StepRequest] = []
        spans: list[StepRequest] = []  # early taps: the verified span, rejected rows included
        for s in self._active:
            span = 0
            if not s.prefilled:
                rows = span = int(self.rng.integers(self.prefill_rows[0], self.prefill_rows[1] + 1))
                s.prefilled = True
            else:  # anchor of the last step plus the drafts it accepted
                accepted = 0
                while accepted < self.k and self.rng.random() < self.accept_p:
                    accepted += 1
                rows, span = 1 + accepted, 1 + self.k
            anchor = int(self.rng.integers(0, self.contract.vocab_size))
            reqs.append(StepRequest(s.sid, s.end, rows, anchor, self.k))
            spans.append(StepRequest(s.sid, s.end, span, 0, 0))
            s.end += rows
        total_rows = sum(r.rows for r in reqs)
        early = self.early_taps and getattr(self.client, "early_taps", False)
        trim = self.predicted and not self.whole_spans
        if trim:  # the outcome is known: the taps carry only the committed rows (exact)
            spans = [StepRequest(r.session, r.pos, r.rows, 0, 0) for r in reqs]
        early_rows = sum(r.rows for r in spans)
        sent = time.perf_counter()
        send_ms = 0.0
        lead_ms = float("nan")
        follows = self.predicted and self.hint
        one = self.predicted and self.one_message
        if one or (early and self.client.send_taps(spans, self._taps(early_rows), exact=trim, commit_follows=follows)):
            commits = [StepRequest(r.session, r.pos + r.rows, 0, r.anchor, r.k) for r in reqs]
            if one:  # the rows and the predicted drafts as the single message, before sampling
                ticket = self.client.submit_step(reqs, self._taps(total_rows))
                early_rows = total_rows
            else:
                ticket = self.client.submit_commit(commits) if self.predicted else None
            send_ms = (time.perf_counter() - sent) * 1000.0
            until = time.perf_counter() + self.sample_ms / 1000.0
            while time.perf_counter() < until:  # the target samples meanwhile
                pass
            start, mono = time.perf_counter(), time.monotonic()
            replies = ticket.collect() if ticket is not None else self.client.commit(commits)
            if ticket is not None and (at := getattr(ticket, "sent_at", 0.0)):
                lead_ms = (mono - at) * 1000.0
        else:
            early_rows = 0
            taps = self._taps(total_rows)
            start = time.perf_counter()
            replies = self.client.step(reqs, taps)
        wait_ms = (time.perf_counter() - start) * 1000.0
        statuses: dict[str, int] = {}
        drafted = tokens = bad = 0
        for r in replies:
            key = r.status.name.lower() if r.status is not None else "none"
            statuses[key] = statuses.get(key, 0) + 1
            if r.tokens:
                drafted += 1
                tokens += len(r.tokens)
                if len(r.tokens) != self.k or not all(0 <= t < self.contract.vocab_size for t in r.tokens):
                    bad += 1
            elif r.status == Status.OK:
                bad += 1  # OK with k>0 must carry k drafts
        rec = CallRecord(
            t=start - t0,
            wait_ms=wait_ms,
            budget_ms=self.client.budget_ms if hasattr(self.client, "budget_ms") else 0.0,
            sessions=len(reqs),
            rows=total_rows,
            drafted=drafted,
            wanted=len(reqs),
            tokens=tokens,
            statuses=statuses,
            bad_tokens=bad,
            compute_ms=timing.compute_ms if (timing := getattr(self.client, "last_timing", None)) and drafted else -1.0,
            early_rows=early_rows,
            send_ms=send_ms,
            server_ms=timing.server_ms if timing and drafted else -1.0,
            queue_ms=timing.queue_ms if timing and drafted else -1.0,
            commit_lead_ms=lead_ms,
        )
        self.records.append(rec)
        finished = []
        for s in self._active:
            s.steps_left -= 1
            if s.steps_left <= 0:
                finished.append(s)
        if finished:
            self.client.free([s.sid for s in finished])
            self._active = [s for s in self._active if s.steps_left > 0]
        return rec

    def run(self, max_steps: int = 1_000_000, duration_s: float | None = None, step_interval_s: float = 0.0) -> None:
        t0 = time.perf_counter()
        for step_no in range(max_steps):
            if self.done or (duration_s is not None and time.perf_counter() - t0 > duration_s):
                break
            self.step(step_no, t0)
            if step_interval_s:
                time.sleep(step_interval_s)
        if self._active:  # a run cut short still frees what it holds
            self.client.free([s.sid for s in self._active])
            self._active = []


def summarize(records: list[CallRecord]) -> dict:
    """Latency percentiles and throughput of a list of call records."""
    if not records:
        return {"calls": 0}
    waits = np.array([r.wait_ms for r in records])
    span = max(r.t + r.wait_ms / 1000 for r in records) - min(r.t for r in records)
    tokens = sum(r.tokens for r in records)
    statuses: dict[str, int] = {}
    for r in records:
        for k, v in r.statuses.items():
            statuses[k] = statuses.get(k, 0) + v
    return {
        "calls": len(records),
        "entries": sum(r.sessions for r in records),
        "rows": sum(r.rows for r in records),
        "drafted_entries": sum(r.drafted for r in records),
        "fallback_entries": sum(r.wanted - r.drafted for r in records),
        "tokens": tokens,
        "bad_tokens": sum(r.bad_tokens for r in records),
        "wait_ms_p50": float(np.percentile(waits, 50)),
        "wait_ms_p90": float(np.percentile(waits, 90)),
        "wait_ms_p99": float(np.percentile(waits, 99)),
        "wait_ms_max": float(waits.max()),
        "calls_per_s": len(records) / span if span > 0 else 0.0,
        "tokens_per_s": tokens / span if span > 0 else 0.0,
        "statuses": statuses,
    }
