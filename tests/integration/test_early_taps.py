"""Early taps and commits (``protocol.Phase``) against real draft-server processes.

The checksum drafter's drafts are a hash of every context row and its position, so drafts equal
to ``expected_drafts`` over the accepted rows prove the server drafted from exactly them: the
rejected rows an early Taps carried were cut by the commit's position. Faults between a Taps and
its Commit go through the chaos proxy (in a thread, its drop rates switched per step): a lost
Taps is answered MISSING_ROWS (never drafts from the rows it has) and the next step resends the
rows; a lost Commit costs that step's drafts only; a server restart in between and a preemption
(Free) in between answer MISSING_ROWS, and the next step drafts again.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from draft_server.drafters.checksum import expected_drafts
from draft_tools.chaos.proxy import ChaosProxy, ProxyConfig
from protocol import Status
from target_client import ClientConfig, DraftClient, DraftReply, StepRequest
from target_client.client.predicted import PredictedCommits
from tests.conftest import CHECKSUM_CONTRACT, free_port, random_taps, wait_for

BUDGET = 500.0  # a real server in a subprocess on a shared 2-core machine
VOCAB = CHECKSUM_CONTRACT.vocab_size
K = 4

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def make_client(endpoint: str, **kw) -> DraftClient:
    kw.setdefault("budget_ms", BUDGET)
    c = DraftClient(ClientConfig(endpoint=endpoint, expect=CHECKSUM_CONTRACT, registry=CollectorRegistry(), **kw))
    c.connect(wait=True)
    return c


class Engine:
    """One request as a target engine sees it: verify steps of k+1 rows, some accepted."""

    def __init__(self, client: DraftClient, session: str = "r1", seed: int = 0) -> None:
        self.client = client
        self.session = session
        self.rng = np.random.default_rng(seed)
        self.rows: dict[int, bytes] = {}  # what the server must hold: accepted rows by position
        self.start = 0
        self.end = 0

    def taps(self, n: int, sent: int | None = None) -> tuple[int, np.ndarray]:
        """A span of ``n`` rows at the current end, of which the first ``sent`` (default all) go now
        as early taps (fewer: predicted, ``exact``, their commit right behind them); (pos, rows)."""
        pos, arr = self.end, random_taps(self.rng, n)
        m = n if sent is None else sent
        predicted = sent is not None
        assert self.client.send_taps(
            [StepRequest(self.session, pos, m, 0, 0)], arr[:m], exact=predicted, commit_follows=predicted
        )
        return pos, arr

    def commit(self, pos: int, arr: np.ndarray, accepted: int, budget_ms: float = BUDGET) -> DraftReply:
        """Commit ``accepted`` of the span's rows; the rest were rejected drafts."""
        for i in range(accepted):
            self.rows[pos + i] = arr[i].tobytes()
        self.end = pos + accepted
        self.anchor = int(self.rng.integers(0, VOCAB))
        return self.client.commit([StepRequest(self.session, self.end, 0, self.anchor, K)], budget_ms)[0]

    def want(self) -> list[int]:
        rows = {p: r for p, r in self.rows.items() if p >= self.start}
        return expected_drafts(rows, self.start, self.end, self.anchor, K, VOCAB)

    def step(self, n: int = K + 1, accepted: int | None = None) -> DraftReply:
        pos, arr = self.taps(n)
        acc = int(self.rng.integers(1, n + 1)) if accepted is None else accepted
        return self.commit(pos, arr, acc)


@pytest.fixture
def proxied(server):
    port = free_port()
    proxy = ChaosProxy(ProxyConfig(frontend=f"tcp://127.0.0.1:{port}", backend=server.endpoint, seed=1))
    t = threading.Thread(target=proxy.run, daemon=True)
    t.start()
    yield proxy, f"tcp://127.0.0.1:{port}"
    proxy.stop()
    t.join(5)


def test_taps_then_commit_drafts_from_exactly_the_accepted_rows(server) -> None:
    client = make_client(server.endpoint)
    try:
        assert client.early_taps and "early_taps" in client.welcome.features
        eng = Engine(client)
        r = eng.step(n=17, accepted=17)  # a prompt
        assert r.status == Status.OK and r.tokens == eng.want() and r.start == 0
        for _ in range(25):
            r = eng.step()
            assert r.status == Status.OK and r.tokens == eng.want(), (r, eng.end)
        st = client.stats()
        assert st["taps_sent"] == 26 and st["resent_rows"] == 0 and st["bad_replies"] == 0
        assert wait_for(lambda: client.stats()["sessions"] == 1 and client._io.sessions["r1"].rows == 0, 5)
        # the single message still works on the same session, by position
        arr = random_taps(eng.rng, 2)
        for i in range(2):
            eng.rows[eng.end + i] = arr[i].tobytes()
        out = client.step([StepRequest("r1", eng.end, 2, 7, K)], arr)[0]
        eng.end, eng.anchor = eng.end + 2, 7
        assert out.status == Status.OK and out.tokens == eng.want()
    finally:
        client.close()


def predicted_step(eng: Engine, hit: bool) -> tuple[str, DraftReply]:
    """One verify step as the vLLM proposer runs it with predicted commits (``PredictedCommits``):
    taps of the rows up to the predicted end, then at once the commit the step is predicted to make;
    after "sampling", the real outcome settled: the predicted call's drafts when it matches (``hit``),
    else a commit at the real end or, when more rows were accepted than predicted, the rows past the
    predicted end (never sent yet) with it."""
    n = K + 1
    acc_p, anchor_p = int(eng.rng.integers(1, n + 1)), int(eng.rng.integers(0, VOCAB))
    pos, arr = eng.taps(n, sent=acc_p)
    guess = PredictedCommits.send(
        eng.client, [StepRequest(eng.session, pos + acc_p, 0, anchor_p, K)], lambda _, lo, hi: arr[lo - pos : hi - pos]
    )
    assert guess is not None
    acc, anchor = acc_p, anchor_p
    while not hit and (acc, anchor) == (acc_p, anchor_p):
        acc = int(eng.rng.integers(1, n + 1))
        anchor = anchor_p if eng.rng.random() < 0.3 else int(eng.rng.integers(0, VOCAB))
    for i in range(acc):
        eng.rows[pos + i] = arr[i].tobytes()
    eng.end, eng.anchor = pos + acc, anchor
    reply = guess.settle(eng.client, [StepRequest(eng.session, pos + acc, 0, anchor, K)])[0]
    assert (guess.hits, guess.misses) == ((1, 0) if hit else (0, 1))
    return ("hit" if hit else "rows again" if acc > acc_p else "commit"), reply


def test_predicted_commits_draft_exactly_and_a_wrong_prediction_is_corrected(server) -> None:
    # two engines (clients) in threads, staggered, two requests each; every step either keeps its
    # predicted commit or corrects it in one of the three ways, and every draft is checked
    clients = [make_client(server.endpoint) for _ in range(2)]
    errors: list[str] = []
    seen: dict[str, int] = {}

    def engine(ci: int) -> None:
        engines = [Engine(clients[ci], f"r{j}", seed=10 * ci + j) for j in range(2)]
        try:
            time.sleep(0.005 * ci)
            for e in engines:
                r = e.step(n=9, accepted=9)  # a prompt
                if r.tokens != e.want():
                    errors.append(f"client {ci} {e.session} prompt: {r}")
            for it in range(30):
                for e in engines:
                    how, r = predicted_step(e, hit=bool(e.rng.random() < 0.5))
                    seen[how] = seen.get(how, 0) + 1
                    if r.status != Status.OK or r.tokens != e.want():
                        errors.append(f"client {ci} {e.session} step {it} ({how}): {r.status} {r.tokens} != {e.want()}")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(f"client {ci}: {exc!r}")

    threads = [threading.Thread(target=engine, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors[:5]
        assert set(seen) == {"hit", "rows again", "commit"} and min(seen.values()) >= 10, seen
    finally:
        for c in clients:
            c.close()


def test_a_span_over_the_size_limit_is_declined_and_the_single_message_drafts(server) -> None:
    """``early_taps_max_mib``: a span larger than the limit (rows in frames) is not sent (send_taps
    False, counted; a commit then finds no rows: MISSING_ROWS), the caller's single message of the
    accepted rows drafts exactly; a span within the limit goes early, and 0 turns the limit off."""
    row = CHECKSUM_CONTRACT.tap_width * 2
    client = make_client(server.endpoint, early_taps_max_mib=4.5 * row / 2**20)  # spans of <= 4 rows go early
    try:
        eng = Engine(client, session="big", seed=3)
        r = eng.step(n=4, accepted=4)  # within the limit: early
        assert r.status == Status.OK and r.tokens == eng.want()
        arr = random_taps(eng.rng, K + 1)
        assert not client.send_taps([StepRequest("big", eng.end, K + 1, 0, 0)], arr)
        assert client.stats()["early_taps_declined"] == 1 and client.stats()["taps_sent"] == 1
        miss = client.commit([StepRequest("big", eng.end + 2, 0, 5, K)])[0]
        assert miss.status == Status.MISSING_ROWS and not miss.tokens  # nothing went out
        for i in range(2):  # the single message: the two accepted rows
            eng.rows[eng.end + i] = arr[i].tobytes()
        out = client.step([StepRequest("big", eng.end, 2, 5, K)], arr[:2])[0]
        eng.end, eng.anchor = eng.end + 2, 5
        assert out.status == Status.OK and out.tokens == eng.want()
        # an exact span (predicted: only rows the step commits) goes early whatever its size
        pos, arr = eng.taps(K + 1, sent=K + 1)
        r = eng.commit(pos, arr, K + 1)
        assert r.status == Status.OK and r.tokens == eng.want()
        assert client.stats()["early_taps_declined"] == 1 and client.stats()["taps_sent"] == 2
    finally:
        client.close()
    unlimited = make_client(server.endpoint, early_taps_max_mib=0.0)
    try:
        eng = Engine(unlimited, session="any", seed=4)
        assert eng.step(n=64, accepted=64).tokens == eng.want()  # 0: no limit
        assert unlimited.stats()["early_taps_declined"] == 0
    finally:
        unlimited.close()
    with pytest.raises(ValueError, match="early_taps_max_mib"):
        ClientConfig(endpoint=server.endpoint, early_taps_max_mib=-1.0)


def lose_next(proxy: ChaosProxy, phase: str, eng: Engine) -> tuple[int, np.ndarray]:
    """The next early Taps (phase "taps") or Commit ("commit") never reaches the server; sends the taps."""
    dropped = proxy.stats.dropped_requests
    proxy.cfg.phases = (phase,)
    proxy.cfg.phase_drop_p = 1.0
    pos, arr = eng.taps(K + 1)
    if phase == "taps":
        assert wait_for(lambda: proxy.stats.dropped_requests == dropped + 1, 5)
        proxy.cfg.phase_drop_p = 0.0
    return pos, arr


def test_lost_taps_answer_missing_rows_then_resend(server, proxied) -> None:
    proxy, endpoint = proxied
    client = make_client(endpoint)
    try:
        eng = Engine(client, seed=1)
        assert eng.step(n=9, accepted=9).tokens == eng.want()
        pos, arr = lose_next(proxy, "taps", eng)
        r = eng.commit(pos, arr, 3)
        assert r.status == Status.MISSING_ROWS and r.tokens == [] and r.start == 0 and r.message
        # the next step's Taps carries the missing rows again: full context, exact drafts
        r = eng.step()
        assert r.status == Status.OK and r.tokens == eng.want() and r.start == 0
        assert client.stats()["resent_rows"] == 3
        assert client.stats()["breaker_opens"] == 0
        m = server.metrics()
        assert m.get('draft_server_entries_total{status="missing_rows"}') == 1
    finally:
        client.close()


def test_lost_commit_costs_its_step_only(server, proxied) -> None:
    proxy, endpoint = proxied
    client = make_client(endpoint)
    try:
        eng = Engine(client, seed=2)
        assert eng.step(n=5, accepted=5).tokens == eng.want()
        pos, arr = lose_next(proxy, "commit", eng)
        r = eng.commit(pos, arr, 2, budget_ms=60.0)
        assert r.status is None and r.tokens == []  # no answer within the budget
        proxy.cfg.phase_drop_p = 0.0
        for _ in range(3):
            r = eng.step()
            assert r.status == Status.OK and r.tokens == eng.want()
    finally:
        client.close()


def test_server_restart_between_taps_and_commit(server) -> None:
    client = make_client(server.endpoint, restart_resend_rows=0)
    try:
        eng = Engine(client, seed=3)
        assert eng.step(n=12, accepted=12).tokens == eng.want()
        pos, arr = eng.taps(K + 1)
        assert wait_for(lambda: client._io.sessions["r1"].rows == 0, 5)  # acknowledged by the old server
        server.restart()
        r = None
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:  # until the client talks to the new server
            r = eng.commit(pos, arr, 2)
            if r.status is not None:
                break
            eng.end = pos
            time.sleep(0.02)
        assert r is not None and r.status == Status.MISSING_ROWS and r.tokens == [] and r.start == -1
        # the next step's rows start a session after the gap, said by its start; drafts from those rows
        eng.start = eng.end
        r = eng.step()
        assert r.status == Status.OK and r.start == eng.start and r.tokens == eng.want()
        assert client.stats()["epoch_changes"] == 1
    finally:
        client.close()


def test_preemption_between_taps_and_commit(server) -> None:
    client = make_client(server.endpoint)
    try:
        eng = Engine(client, seed=4)
        assert eng.step(n=6, accepted=6).tokens == eng.want()
        pos, arr = eng.taps(K + 1)
        client.free(["r1"])  # the engine preempted the request (ordered after the Taps)
        r = eng.commit(pos, arr, 3)
        assert r.status == Status.MISSING_ROWS and r.tokens == []
        # recomputed from position 0 on resume: the whole context again, exact drafts
        eng.rows, eng.end = {}, 0
        r = eng.step(n=pos + 3, accepted=pos + 3)
        assert r.status == Status.OK and r.start == 0 and r.tokens == eng.want()
    finally:
        client.close()


def test_commit_after_failed_taps_carries_the_rows(server, proxied) -> None:
    """A Taps call that failed (no reply within its budget) no longer counts as carrying its rows:
    the commit sends them, and drafts come from the full context in that same step."""
    proxy, endpoint = proxied
    client = make_client(endpoint, budget_ms=40.0)
    try:
        eng = Engine(client, seed=5)
        r = eng.step(n=4, accepted=4)
        assert r.tokens == eng.want()
        pos, arr = lose_next(proxy, "taps", eng)
        assert wait_for(lambda: not client._io.pending, 2)  # the Taps call expired unanswered
        r = eng.commit(pos, arr, 4, budget_ms=BUDGET)
        assert r.status == Status.OK and r.tokens == eng.want()
        assert client.stats()["breaker_opens"] == 0
    finally:
        client.close()


def test_lost_commit_then_lost_taps_never_drafts_from_rejected_rows(server, proxied) -> None:
    """The server still holds the rejected rows of a span whose commit was lost; the next Taps is
    lost too: the next commit names that Taps call, which never reached the session, so the
    answer is MISSING_ROWS, not drafts from the stale rows."""
    proxy, endpoint = proxied
    client = make_client(endpoint)
    try:
        eng = Engine(client, seed=6)
        assert eng.step(n=5, accepted=5).tokens == eng.want()
        pos, arr = lose_next(proxy, "commit", eng)
        assert eng.commit(pos, arr, 1, budget_ms=60.0).status is None  # lost: the server keeps [pos, pos + K + 1)
        proxy.cfg.phase_drop_p = 0.0
        pos, arr = lose_next(proxy, "taps", eng)
        r = eng.commit(pos, arr, 2, budget_ms=BUDGET)  # pos + 2 lies inside the stale span
        assert r.status == Status.MISSING_ROWS and r.tokens == []
        r = eng.step()  # resent: exact again
        assert r.status == Status.OK and r.tokens == eng.want()
    finally:
        client.close()


def test_resend_that_lost_its_oldest_rows_never_drafts_from_a_stale_span(server, proxied) -> None:
    """The server holds a span whose commit was lost (rejected rows from pos + 1 on); the next two
    Taps are lost too, and the resend buffer (5 rows here) cannot keep every accepted row since:
    it gives up the oldest, never acknowledged. The next step's Taps starts after them, where the
    server still holds the stale span's rejected rows: before, it overwrote from there and the commit
    drafted from a context holding them (draft-soak --chaos pause,taps,drop: one session's drafts
    wrong from a SIGCONT until it ended). Now that Taps restarts the session at its first row (said
    by the reply's start), and drafts come from exactly the rows from there."""
    proxy, endpoint = proxied
    client = make_client(endpoint, resend_rows_limit=K + 1)
    try:
        eng = Engine(client, seed=7)
        assert eng.step(n=5, accepted=5).tokens == eng.want()
        pos, arr = lose_next(proxy, "commit", eng)  # the span [5, 10) arrives; its commit does not
        assert wait_for(lambda: client._io.sessions["r1"].rows == 0, 5)  # the span acknowledged
        assert eng.commit(pos, arr, 1, budget_ms=60.0).status is None  # the server keeps rows 6..9 (rejected)
        proxy.cfg.phase_drop_p = 0.0
        for _ in range(2):  # spans at 6 and 9 lost, 3 rows of each accepted: 6 rows to resend, 5 kept
            pos, arr = lose_next(proxy, "taps", eng)
            r = eng.commit(pos, arr, 3, budget_ms=BUDGET)
            assert r.status == Status.MISSING_ROWS and r.tokens == []
        r = eng.step(accepted=2)  # resends rows 9..11 (the rows 6..8 are gone) with the new span at 12
        assert r.status == Status.OK and r.start == 9, r  # the stale rows 6..8 are not context
        eng.start = r.start
        assert r.tokens == eng.want()
        for _ in range(3):  # and the session goes on from there
            r = eng.step()
            assert r.status == Status.OK and r.start == 9 and r.tokens == eng.want()
    finally:
        client.close()
