"""A burst larger than the budget: drafting comes back by itself, from every committed row.

Found on the H200 (``draft_tools.bench.early_taps_gpu``, K3, 50 ms budget): from 16 sessions up,
the first step's prefill taps (16 x 256 rows x 71,680 bytes = 294 MB) took longer than the budget
to get in, the next four steps waited behind it and missed too, the breaker opened, and drafting
never came back in the run; on a CPU repro it came back only after the trial backoff, with the
rows of the steps the breaker had held back given up (the server restarted the sessions at a gap,
so the drafts came from part of the context). Now a step that misses while its session's burst is
unproven leaves that session catching up (``target_client.client.resend``): its steps send their
rows ingest-only without waiting, and it drafts again once the server has taken the burst in.

The server here (``draft_tools.chaos.serve --ingest-us-per-row``, the checksum drafter) spends
0.3 ms per ingested row: 8 sessions x 256 rows take about six of client A's 100 ms budgets, two
sessions joining later with 512 rows each take more than one (a new request's prompt inside a
running batch), while decode steps of a few rows stay cheap. Client B, started while A's burst is
being ingested, has a roomy budget and short prompts. The checksum drafter's drafts are a hash of
every context row and its position, so every draft equal to ``expected_drafts`` over the session's
whole committed context from position 0 proves nothing committed was lost; that is what a run
without the slow burst drafts too. No timed assertions: every loop is bounded by steps.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from draft_server.drafters.checksum import expected_drafts
from protocol import Status
from target_client import ClientConfig, DraftClient, DraftReply, StepRequest
from tests.conftest import CHECKSUM_CONTRACT, ServerProc, random_taps

VOCAB = CHECKSUM_CONTRACT.vocab_size
K = 3
BUDGET_A = 100.0  # the bursting client's: its burst takes about six of them
BUDGET_B = 2000.0  # the other client's: roomy enough to wait out A's burst batch on this server
INGEST_US_PER_ROW = 300.0
FORWARD_S = 0.015  # the target's forward between steps
RESEND_RATIO_A = 4.0  # a step of A resends up to 4 x its new rows (see the test)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


@dataclass
class Session:
    name: str
    prefill: int
    rows: dict[int, bytes] = field(default_factory=dict)  # committed rows by position
    end: int = 0
    steps: int = 0


@dataclass
class Record:
    session: Session
    end: int  # committed context end the drafts follow
    anchor: int
    reply: DraftReply


class Engine:
    """A target engine's steps over staggered sessions: a prefill step, then verify steps that
    commit the anchor plus 0..K accepted drafts (early taps: the whole K+1 span goes first, its
    rejected rows included, then a commit)."""

    def __init__(self, client: DraftClient, early: bool, seed: int) -> None:
        self.client = client
        self.early = early
        self.rng = np.random.default_rng(seed)
        self.active: list[Session] = []
        self.steps: list[list[Record]] = []

    def join(self, name: str, prefill: int) -> None:
        self.active.append(Session(name, prefill))

    def step(self) -> list[Record]:
        plan = []  # (session, pos, span rows, committed rows, anchor)
        for s in self.active:
            if s.steps == 0:
                span = committed = s.prefill
            else:
                span, committed = K + 1, 1 + int(self.rng.integers(0, K + 1))
            plan.append((s, s.end, span, committed, int(self.rng.integers(0, VOCAB))))
        taps = random_taps(self.rng, sum(p[2] for p in plan))
        if self.early:
            spans = [StepRequest(s.name, pos, span, 0, 0) for s, pos, span, _, _ in plan]
            assert self.client.send_taps(spans, taps)
            replies = self.client.commit([StepRequest(s.name, pos + c, 0, a, K) for s, pos, _, c, a in plan])
        else:
            off, parts, reqs = 0, [], []
            for s, pos, span, c, a in plan:  # the single message carries the committed rows only
                parts.append(taps[off : off + c])
                off += span
                reqs.append(StepRequest(s.name, pos, c, a, K))
            replies = self.client.step(reqs, np.ascontiguousarray(np.concatenate(parts)))
        out, off = [], 0
        for (s, pos, span, c, a), reply in zip(plan, replies, strict=True):
            for i in range(c):
                s.rows[pos + i] = taps[off + i].tobytes()
            off += span
            s.end = pos + c
            s.steps += 1
            out.append(Record(s, s.end, a, reply))
        self.steps.append(out)
        return out


def check_drafts(eng: Engine) -> int:
    """Every drafted reply equals the drafts of the session's whole committed context; their count."""
    n = 0
    for recs in eng.steps:
        for r in recs:
            if not r.reply.tokens:
                continue
            why = f"session {r.session.name} at {r.end}: drafted from context start {r.reply.start}, not 0"
            assert r.reply.status == Status.OK and r.reply.start == 0, why
            rows = {p: b for p, b in r.session.rows.items() if p < r.end}
            assert r.reply.tokens == expected_drafts(rows, 0, r.end, r.anchor, K, VOCAB), (r.session.name, r.end)
            n += 1
    return n


def fully_drafted(recs: list[Record]) -> bool:
    return all(len(r.reply.tokens) == K for r in recs)


def client(endpoint: str, name: str, budget_ms: float, resend_ratio: float = 1.0) -> DraftClient:
    c = DraftClient(
        ClientConfig(
            endpoint=endpoint,
            budget_ms=budget_ms,
            name=name,
            expect=CHECKSUM_CONTRACT,
            registry=CollectorRegistry(),
            resend_ratio=resend_ratio,
        )
    )
    c.connect(wait=True)
    return c


class BurstServer(ServerProc):
    """The real server with every ingest slowed per row (``draft_tools.chaos.serve``)."""

    def __init__(self) -> None:
        super().__init__("--ingest-us-per-row", str(INGEST_US_PER_ROW))
        self.args[self.args.index("draft_server")] = "draft_tools.chaos.serve"


@pytest.mark.parametrize("early", [True, False], ids=["early_taps", "single_message"])
def test_drafting_resumes_after_a_burst_larger_than_the_budget_from_every_committed_row(early: bool) -> None:
    srv = BurstServer().start()
    # A's steps that carry a joining prompt miss for every session in them, and on a loaded machine two
    # or three such misses in a row leave more unacknowledged rows than a step's default resend room
    # (ClientConfig.resend_ratio: 1 x its new rows); the rows past it are given up and the sessions
    # restarted, as designed (tests/unit/test_client_resend.py). Room for a few missed steps keeps this
    # test on what it is for: the bursts themselves lose nothing.
    a = client(srv.endpoint, "burst", BUDGET_A, resend_ratio=RESEND_RATIO_A)
    b = client(srv.endpoint, "steady", BUDGET_B)
    assert a.early_taps and b.early_taps
    eng_a, eng_b = Engine(a, early, seed=1), Engine(b, early, seed=2)
    for i in range(8):
        eng_a.join(f"a{i}", 256)  # 2,048 rows in one step: about 0.6 s on this server
    started = threading.Event()
    errors: list[BaseException] = []

    def run_b() -> None:
        try:
            started.wait(30)
            for i in range(2):
                eng_b.join(f"b{i}", 16)
            for _ in range(60):
                eng_b.step()
                time.sleep(FORWARD_S)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    t = threading.Thread(target=run_b)
    t.start()
    try:
        for n in range(400):
            eng_a.step()
            started.set()  # B arrives while A's burst is still going in
            if n in (40, 60):
                eng_a.join(f"a{len(eng_a.active)}", 512)  # a new prompt inside the running batch
            done = n > 80 and all(fully_drafted(s) for s in eng_a.steps[-10:])
            if done and not t.is_alive():
                break
            time.sleep(FORWARD_S)
        t.join(60)
        assert not errors, errors
        # drafting came back for every session of both clients
        assert all(fully_drafted(s) for s in eng_a.steps[-10:]), [
            [len(r.reply.tokens) for r in s] for s in eng_a.steps[-10:]
        ]
        assert all(fully_drafted(s) for s in eng_b.steps[-10:])
        assert all(any(len(r.reply.tokens) == K for r in s) for s in eng_a.steps[-1:])
        # ... from every committed row: each draft is the whole context's, no session restarted
        # (a machine far slower than this test assumes makes a catching-up session's unacknowledged
        # rows outgrow its resend buffer, and the client then restarts the session: the stats say so)
        st_a, st_b = a.stats(), b.stats()
        restarts = {k: v for k, v in srv.metrics().items() if k.startswith("draft_server_session_restarts_total")}
        try:
            assert check_drafts(eng_a) > 0 and check_drafts(eng_b) > 0
        except AssertionError as e:
            raise AssertionError(f"{e}; server restarts {restarts}; client A {st_a}") from None
        assert not any(restarts.values()), restarts
        # the bursts cost their own steps, not the breaker: it never opened, for either client
        assert st_a["breaker_opens"] == 0 and st_b["breaker_opens"] == 0, (st_a, st_b)
        assert st_a["catching_up_entries"] > 0
    finally:
        t.join(10)
        a.close()
        b.close()
        srv.kill()
