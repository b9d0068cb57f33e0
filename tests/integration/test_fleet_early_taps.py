"""Early taps and commits over a FleetClient: two real draft-server processes (checksum drafter).

The checksum drafter's drafts are a hash of every context row its server holds for the session
and their positions, so drafts equal to ``expected_drafts`` over the accepted rows prove that each
session's taps and its commit reached the same server and that the commit cut the rejected rows
by position. Shown with sessions that join at staggered steps, sessions spread over both servers,
no rows in any commit (every row went early), a server killed between a step's taps and its
commit (its sessions get no drafts that step, never wrong ones, and draft again on the other
server within two steps). Servers without early taps: tests/unit/test_fleet_client.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from draft_server.drafters.checksum import expected_drafts
from protocol import Status
from target_client import ClientConfig, DraftReply, StepRequest
from target_client.client.predicted import PredictedCommits
from target_client.fleet import FleetClient
from tests.conftest import CHECKSUM_CONTRACT, assert_on_time, random_taps, wait_for

BUDGET = 500.0  # real servers in subprocesses on a shared 2-core machine
VOCAB = CHECKSUM_CONTRACT.vocab_size
K = 4

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def make_fleet(endpoints: list[str]) -> FleetClient:
    cfg = ClientConfig(
        endpoint=",".join(endpoints), expect=CHECKSUM_CONTRACT, registry=CollectorRegistry(), budget_ms=BUDGET
    )
    fleet = FleetClient(cfg)
    fleet.connect(wait=True)
    return fleet


class Session:
    """One request as the engine sees it: the rows its server must hold, by position."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.rows: dict[int, bytes] = {}
        self.start = 0  # the first row its current server holds
        self.end = 0
        self.anchor = 0
        self.span: np.ndarray | None = None

    def want(self) -> list[int]:
        rows = {p: r for p, r in self.rows.items() if p >= self.start}
        return expected_drafts(rows, self.start, self.end, self.anchor, K, VOCAB)


def early_step(fleet: FleetClient, sessions: list[Session], n: int = K + 1, between=None) -> list[DraftReply]:
    """Taps of a span of ``n`` rows for every session, then a commit of a random number of them."""
    spans = [random_taps(s.rng, n) for s in sessions]
    reqs = [StepRequest(s.name, s.end, n, 0, 0) for s in sessions]
    assert fleet.send_taps(reqs, np.concatenate(spans))
    if between is not None:
        between()
    commits = []
    for s, arr in zip(sessions, spans, strict=True):
        acc = int(s.rng.integers(1, n + 1))
        for i in range(acc):
            s.rows[s.end + i] = arr[i].tobytes()
        s.end += acc
        s.anchor = int(s.rng.integers(0, VOCAB))
        commits.append(StepRequest(s.name, s.end, 0, s.anchor, K))
    return assert_on_time(lambda: fleet.commit(commits), BUDGET, "commit")


def test_fleet_taps_and_commits_draft_exactly_on_each_sessions_server(server_factory) -> None:
    servers = [server_factory(), server_factory()]
    fleet = make_fleet([s.endpoint for s in servers])
    try:
        assert fleet.early_taps
        sessions: list[Session] = []
        for step in range(12):
            if step % 2 == 0 and len(sessions) < 6:  # a new session every other step
                sessions.append(Session(f"s{len(sessions)}", seed=step))
            out = early_step(fleet, sessions)
            for s, r in zip(sessions, out, strict=True):
                assert r.status == Status.OK and r.start == 0 and r.tokens == s.want(), (step, s.name, r)
        loads = fleet.loads()
        assert len(loads) == 2 and all(v >= 1 for v in loads.values()), loads  # both servers hold sessions
        st = fleet.stats()
        assert st["taps_sent"] >= 12 and st["resent_rows"] == 0 and st["bad_replies"] == 0, st
        for s in sessions:  # the commits carried no rows: each server acknowledged every span early
            c = fleet._members[fleet.server_of(s.name)]
            assert wait_for(lambda c=c, s=s: c._io.sessions[s.name].rows == 0, 5)
    finally:
        fleet.close()


def test_predicted_commits_over_the_fleet_draft_exactly_kept_or_corrected(server_factory) -> None:
    # every step: taps up to each session's predicted end, then at once its predicted commit
    # (PredictedCommits over the fleet: each to its session's server); after "sampling" some
    # predictions hold, others are corrected by a commit at the real end or, accepted past the
    # prediction, by the rows past it
    servers = [server_factory(), server_factory()]
    fleet = make_fleet([s.endpoint for s in servers])
    rng = np.random.default_rng(7)
    seen: dict[str, int] = {}
    try:
        sessions = [Session(f"s{i}", seed=40 + i) for i in range(4)]
        n = K + 1
        for step in range(16):
            spans = [random_taps(s.rng, n) for s in sessions]
            at = {s.name: (s.end, arr) for s, arr in zip(sessions, spans, strict=True)}
            guessed = [(int(rng.integers(1, n + 1)), int(rng.integers(0, VOCAB))) for _ in sessions]
            # the taps carry each span up to its predicted end (exact), as the vLLM proposer sends them
            sent = [StepRequest(s.name, s.end, a, 0, 0) for s, (a, _) in zip(sessions, guessed, strict=True)]
            rows = np.concatenate([arr[:a] for arr, (a, _) in zip(spans, guessed, strict=True)])
            assert fleet.send_taps(sent, rows, exact=True)
            predicted, commits = [], []
            for s, arr, (acc_p, anchor_p) in zip(sessions, spans, guessed, strict=True):
                predicted.append(StepRequest(s.name, s.end + acc_p, 0, anchor_p, K))
                acc, anchor = acc_p, anchor_p
                if rng.random() < 0.5:  # wrong: another accepted count, or another anchor
                    acc, anchor = (
                        (int(rng.integers(1, n + 1)), anchor_p) if rng.random() < 0.7 else (acc_p, anchor_p + 1)
                    )
                how = "hit" if (acc, anchor) == (acc_p, anchor_p) else "rows again" if acc > acc_p else "commit"
                seen[how] = seen.get(how, 0) + 1
                for i in range(acc):
                    s.rows[s.end + i] = arr[i].tobytes()
                s.end += acc
                s.anchor = anchor
                commits.append(StepRequest(s.name, s.end, 0, anchor, K))
            guess = PredictedCommits.send(
                fleet, predicted, lambda sid, lo, hi, at=at: at[sid][1][lo - at[sid][0] : hi - at[sid][0]]
            )
            assert guess is not None
            out = guess.settle(fleet, commits)
            for s, r in zip(sessions, out, strict=True):
                assert r.status == Status.OK and r.start == 0 and r.tokens == s.want(), (step, s.name, r)
        assert len(fleet.loads()) == 2 and set(seen) == {"hit", "rows again", "commit"}, (fleet.loads(), seen)
        assert fleet.stats()["bad_replies"] == 0
    finally:
        fleet.close()


def test_a_server_killed_between_taps_and_commit(server_factory) -> None:
    servers = [server_factory(), server_factory()]
    fleet = make_fleet([s.endpoint for s in servers])
    try:
        sessions = [Session(f"k{i}", seed=10 + i) for i in range(6)]
        for _ in range(3):
            for s, r in zip(sessions, early_step(fleet, sessions), strict=True):
                assert r.status == Status.OK and r.tokens == s.want()
        victim = servers[0]
        on_victim = {s.name for s in sessions if fleet.server_of(s.name) == victim.endpoint}
        assert on_victim and len(on_victim) < len(sessions), fleet.loads()

        def kill() -> None:
            victim.kill()

        out = early_step(fleet, sessions, between=kill)
        for s, r in zip(sessions, out, strict=True):
            if s.name in on_victim:
                assert r.tokens == [] and r.status != Status.OK  # no drafts, never wrong ones
            else:
                assert r.status == Status.OK and r.tokens == s.want()
        back: dict[str, int] = {}
        for step in range(1, 6):
            out = early_step(fleet, sessions)
            for s, r in zip(sessions, out, strict=True):
                if r.status != Status.OK:
                    assert r.tokens == []
                    continue
                if s.name in on_victim and s.name not in back:
                    back[s.name] = step
                    assert fleet.server_of(s.name) == servers[1].endpoint
                    s.start = r.start  # the new server restarted it at its first row there
                assert r.tokens == s.want(), (step, s.name, r)
        assert set(back) == on_victim and max(back.values()) <= 2, back
    finally:
        fleet.close()
