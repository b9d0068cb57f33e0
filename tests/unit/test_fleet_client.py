"""FleetClient against several scripted fake servers (tests/unit/client_fake_server.py), in process.

Each fake server keeps positional sessions per client and drafts ``fake_drafts(session, end,
anchor, k)``, so every draft the engine gets is checked exactly, whichever server answered and
whether the session restarted there. What is shown: sessions spread and each server gets
exactly its sessions' rows; a dead server's sessions draft again in the same step (rerouted); a
paused one's after two missed steps, and never go back once it resumes while new sessions do;
a server whose breaker opened on chance misses is back within a step or two (nudged probes);
an overloaded server sheds new sessions; Frees reach the right servers (also the one a session
left); DNS membership changes; contract refusals; connect outcomes. Every step() is held to its
budget + 5 ms net of run-queue wait (``assert_on_time``).
"""

from __future__ import annotations

import socket
import time

import msgspec
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from draft_tools.common import free_port
from protocol import FEATURE_EARLY_TAPS, DType, Phase, Status
from target_client import ClientConfig, ConnectTimeoutError, ContractMismatchError, DraftClient, StepRequest
from target_client.fleet import FleetClient, FleetOptions, make_client, rank
from tests.conftest import assert_on_time, wait_for
from tests.unit.client_fake_server import CONTRACT, FakeServer, fake_drafts

pytestmark = pytest.mark.timeout(60)

WIDTH = CONTRACT.tap_width
BUDGET = 60.0  # roomy: in-process fake servers answer in about a millisecond


def cfg(endpoint: str, **kw) -> ClientConfig:
    kw.setdefault("budget_ms", BUDGET)
    kw.setdefault("registry", CollectorRegistry())
    kw.setdefault("connect_timeout_s", 5.0)
    return ClientConfig(endpoint=endpoint, **kw)


class Engine:
    """Sessions of one synthetic engine: positions, taps, and a check of every draft."""

    def __init__(self, client, sessions: list[str], k: int = 4, seed: int = 0) -> None:
        self.client = client
        self.ends = dict.fromkeys(sessions, 0)
        self.k = k
        self.rng = np.random.default_rng(seed)
        self.rows: dict[str, dict[int, np.ndarray]] = {s: {} for s in sessions}  # rows sent, per session and pos

    def step(self, budget_ms: float = BUDGET, sessions: list[str] | None = None) -> dict[str, bool]:
        names = list(self.ends) if sessions is None else sessions
        reqs, parts = [], []
        for s in names:
            rows = int(self.rng.integers(1, 4))
            anchor = int(self.rng.integers(0, CONTRACT.vocab_size))
            reqs.append(StepRequest(s, self.ends[s], rows, anchor, self.k))
            t = self.rng.integers(0, 1 << 16, size=(rows, WIDTH), dtype=np.uint16)
            parts.append(t)
            self.rows[s][self.ends[s]] = t
        taps = np.ascontiguousarray(np.concatenate(parts))
        replies = assert_on_time(lambda: self.client.step(reqs, taps, budget_ms), budget_ms)
        drafted = {}
        for r, rep in zip(reqs, replies, strict=True):
            self.ends[r.session] += r.rows
            if rep.tokens:
                assert rep.status == Status.OK
                assert rep.tokens == fake_drafts(r.session, self.ends[r.session], r.anchor, r.k)
            drafted[r.session] = bool(rep.tokens)
        return drafted


@pytest.fixture
def servers():
    made: list[FakeServer] = []

    def make(n: int, **kw) -> list[FakeServer]:
        out = [FakeServer(**kw) for _ in range(n)]
        made.extend(out)
        return out

    yield make
    for s in made:
        if not s._stop:
            s.stop()


def fleet_of(srvs: list[FakeServer], **kw) -> FleetClient:
    opts = kw.pop("options", None)
    return FleetClient(cfg(",".join(s.endpoint for s in srvs), **kw), opts)


def sessions_on(srv: FakeServer) -> set[str]:
    return {e.session for r in srv.steps() for e in r.msg.entries}


def test_sessions_spread_and_each_server_gets_exactly_its_rows(servers):
    srvs = servers(3)
    with fleet_of(srvs) as fc:
        assert fc.connect(wait=True) is not None
        assert fc.contract == CONTRACT and fc.servers == sorted(s.endpoint for s in srvs)
        names = [f"s{i}" for i in range(60)]
        eng = Engine(fc, names)
        for _ in range(3):
            assert all(eng.step().values())
        by_server = {s.endpoint: sessions_on(s) for s in srvs}
        assert set().union(*by_server.values()) == set(names)
        assert sum(len(v) for v in by_server.values()) == len(names)  # no session on two servers
        for ep, got in by_server.items():
            assert 12 <= len(got) <= 28, {k: len(v) for k, v in by_server.items()}
            assert all(fc.server_of(s) == ep for s in got)
        for srv in srvs:  # every Step carried exactly its own entries' rows, in entry order
            for rec in srv.steps():
                expect = np.concatenate([eng.rows[e.session][e.pos] for e in rec.msg.entries])
                assert np.array_equal(rec.taps, expect)
        st = fc.stats()
        assert st["servers"] == 3 and st["servers_usable"] == 3 and st["sessions"] == 60 and st["placed"] == 60
        assert st["moves"] == st["sheds"] == 0 and st["fleet_steps"] == 3 and st["calls"] == 9


def test_dead_server_sessions_are_rerouted_within_the_same_step(servers):
    srvs = servers(3)
    with fleet_of(srvs, options=FleetOptions(load_slack=1e9)) as fc:  # no load bound: pure rendezvous order
        fc.connect(wait=True)
        eng = Engine(fc, [f"s{i}" for i in range(45)])
        assert all(eng.step().values())
        dead = srvs[0]
        victims = sessions_on(dead)
        assert victims
        dead.stop()
        time.sleep(0.25)  # the TCP connections drop (a kill -9 looks the same); 0.25 s: a loaded 2-core CI box
        drafted = eng.step()
        assert all(drafted.values()), [s for s, d in drafted.items() if not d]  # rerouted in this step
        assert all(fc.server_of(s) != dead.endpoint for s in victims)
        for s in victims:  # each went to its next server in rendezvous order
            assert fc.server_of(s) == rank(s, [x.endpoint for x in srvs])[1]
        st = fc.stats()
        assert st["moves"] >= len(victims) and st["reroutes"] >= 1
        assert all(eng.step().values())


def test_paused_server_sessions_move_after_two_missed_steps_and_stay_moved(servers):
    srvs = servers(3)
    with fleet_of(srvs) as fc:
        fc.connect(wait=True)
        names = [f"s{i}" for i in range(45)]
        eng = Engine(fc, names)
        assert all(eng.step().values())
        paused = srvs[1]
        victims = sessions_on(paused)
        paused.policy = lambda step, n: "drop"  # a SIGSTOPped server: nothing comes back
        paused.answer_pings = False
        missed = {s: 0 for s in victims}
        for _ in range(3):
            drafted = eng.step(budget_ms=30.0)
            assert all(d for s, d in drafted.items() if s not in victims)  # the others never notice
            for s in victims:
                if not drafted[s]:
                    missed[s] += 1
        assert max(missed.values()) <= 2, missed  # at most 2 steps without drafts
        assert all(eng.step().values())
        assert all(fc.server_of(s) != paused.endpoint for s in victims)
        paused.policy = lambda step, n: "ok"  # SIGCONT
        paused.answer_pings = True
        assert wait_for(lambda: fc.stats()["per_server"][paused.endpoint]["usable"], 5.0)
        for _ in range(2):
            assert all(eng.step().values())
        assert all(fc.server_of(s) != paused.endpoint for s in victims)  # moved sessions stay
        newcomers = [f"n{i}" for i in range(45)]
        eng2 = Engine(fc, newcomers, seed=1)
        assert all(eng2.step().values())
        assert any(fc.server_of(s) == paused.endpoint for s in newcomers)  # new ones go there again


def test_a_server_out_on_chance_misses_is_back_in_a_step_or_two_for_the_next_failure(servers):
    a, b = srvs = servers(2)
    with fleet_of(srvs) as fc:
        fc.connect(wait=True)
        names = [f"s{i}" for i in range(20)]
        eng = Engine(fc, names)
        assert all(eng.step().values())
        b.policy = lambda step, n: "drop"  # two lost replies in a row: b's breaker opens, its sessions move
        for _ in range(3):
            eng.step(budget_ms=30.0)
        assert all(fc.server_of(s) == a.endpoint for s in names)
        b.policy = lambda step, n: "ok"  # b was fine all along; a's turn to fail now
        eng.step()  # the fleet nudges b's client: its open breaker probes at the fast period
        a.policy = lambda step, n: "drop"
        a.answer_pings = False
        missed = dict.fromkeys(names, 0)
        for _ in range(4):
            for s, d in eng.step(budget_ms=30.0).items():
                missed[s] += not d
        assert max(missed.values()) <= 2, missed  # b took them back within 2 steps, not after 500 ms
        assert all(fc.server_of(s) == b.endpoint for s in names)


def test_overloaded_server_sheds_new_sessions_to_their_next_server(servers):
    srvs = servers(3)
    full = srvs[2]
    full.policy = lambda step, n: "overloaded"
    full.retry_after_ms = 500.0
    with fleet_of(srvs) as fc:
        fc.connect(wait=True)
        names = [f"s{i}" for i in range(45)]
        eng = Engine(fc, names)
        first = eng.step()
        shed = [s for s in names if not first[s]]
        assert shed and all(fc.server_of(s) != full.endpoint for s in shed)
        assert fc.stats()["sheds"] == len(shed)
        assert all(eng.step().values())
        more = Engine(fc, [f"n{i}" for i in range(30)], seed=2)
        assert all(more.step().values())  # within the retry hint no new session tries it
        frees = [s for r in full.received if r.kind == "free" for s in r.msg.sessions]
        assert sorted(frees) == sorted(shed)  # freed where they were shed


def test_free_reaches_each_sessions_server(servers):
    srvs = servers(2)
    with fleet_of(srvs) as fc:
        fc.connect(wait=True)
        names = [f"s{i}" for i in range(20)]
        eng = Engine(fc, names)
        eng.step()
        where = {s: fc.server_of(s) for s in names}
        fc.free(names)
        for srv in srvs:
            mine = {s for s, ep in where.items() if ep == srv.endpoint}
            assert wait_for(
                lambda srv=srv, mine=mine: (
                    {x for r in srv.received if r.kind == "free" for x in r.msg.sessions} == mine
                ),
                5.0,
            )
        assert fc.stats()["sessions"] == 0 and fc.server_of("s0") is None
        assert fc.ping(500.0) is not None


def test_dns_name_membership_follows_the_lookups(servers):
    port = free_port()
    srvs = [FakeServer(port=port, host=f"127.0.0.{i}") for i in (1, 2, 3)]
    try:
        table = {"draft.test": ["127.0.0.1", "127.0.0.2"]}

        def dns(host, p, type=0):
            if host not in table:
                raise socket.gaierror(socket.EAI_NONAME, "unknown")
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, p)) for ip in table[host]]

        opts = FleetOptions(resolve_every_s=0.05, gone_grace_s=5.0)
        with FleetClient(cfg(f"dns+tcp://draft.test:{port}"), opts, resolver=dns) as fc:
            fc.connect(wait=True)
            assert fc.servers == [f"tcp://127.0.0.{i}:{port}" for i in (1, 2)]
            names = [f"s{i}" for i in range(40)]
            eng = Engine(fc, names)
            assert all(eng.step().values())
            table["draft.test"] = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]  # scale out
            third = f"tcp://127.0.0.3:{port}"
            assert wait_for(lambda: third in fc.servers and fc.stats()["per_server"][third]["usable"], 5.0)
            assert all(eng.step().values())
            assert all(fc.server_of(s) != third for s in names)  # existing sessions stay
            new = Engine(fc, [f"n{i}" for i in range(40)], seed=3)
            assert all(new.step().values())
            assert any(fc.server_of(f"n{i}") == third for i in range(40))
            del table["draft.test"]  # a failed lookup keeps what is known
            time.sleep(0.2)
            assert len(fc.servers) == 3 and fc.stats()["resolve_failures"] >= 1
            table["draft.test"] = ["127.0.0.1", "127.0.0.3"]  # 127.0.0.2 scaled in
            second = f"tcp://127.0.0.2:{port}"
            on_second = [s for s in [*names, *new.ends] if fc.server_of(s) == second]
            assert on_second
            assert wait_for(lambda: fc.stats()["per_server"].get(second, {}).get("gone", True), 5.0)
            assert all(eng.step().values()) and all(new.step().values())  # moved off it
            assert wait_for(lambda: second not in fc.servers, 5.0)  # closed once it holds none
    finally:
        for s in srvs:
            s.stop()


def test_a_server_serving_another_contract_takes_no_sessions(servers):
    srvs = servers(3)
    odd = srvs[0]
    odd.contract = msgspec.structs.replace(CONTRACT, vocab_size=2000)
    with fleet_of(srvs, expect=CONTRACT) as fc:
        fc.connect(wait=True)
        eng = Engine(fc, [f"s{i}" for i in range(30)])
        for _ in range(2):
            assert all(eng.step().values())
        assert not odd.steps()
        assert fc.stats()["per_server"][odd.endpoint]["gate"] == "breaker_open"


def test_connect_raises_when_every_server_refuses_or_none_answers(servers):
    srvs = servers(2)
    for s in srvs:
        s.contract = msgspec.structs.replace(CONTRACT, tap_dtype=DType.F16)
    with fleet_of(srvs, expect=CONTRACT) as fc, pytest.raises(ContractMismatchError):
        fc.connect(wait=True)
    nobody = f"tcp://127.0.0.1:{free_port()},tcp://127.0.0.1:{free_port()}"
    with FleetClient(cfg(nobody, connect_timeout_s=0.3)) as fc:
        t0 = time.monotonic()
        with pytest.raises(ConnectTimeoutError):
            fc.connect(wait=True)
        assert time.monotonic() - t0 < 2.0
        eng = Engine(fc, ["a", "b"])
        assert not any(eng.step(budget_ms=20.0).values())  # no server: empty drafts at once, no raise


def test_caller_bugs_raise_before_anything_is_sent(servers):
    srvs = servers(2)
    with fleet_of(srvs) as fc:
        fc.connect(wait=True)
        with pytest.raises(ValueError):
            fc.step([StepRequest("a", 0, 2, 1, 4)], np.zeros((1, WIDTH), np.uint16))
        with pytest.raises(ValueError):
            fc.step([StepRequest("a", 0, 1, 1, 4), StepRequest("a", 1, 1, 1, 4)], np.zeros((2, WIDTH), np.uint16))
        assert not any(s.steps() for s in srvs)
        assert fc.step([], None) == []


async def test_astep(servers):
    srvs = servers(2)
    with fleet_of(srvs) as fc:
        fc.connect(wait=True)
        taps = np.zeros((2, WIDTH), np.uint16)
        reps = await fc.astep([StepRequest("a", 0, 1, 5, 3), StepRequest("b", 0, 1, 6, 3)], taps)
        assert reps[0].tokens == fake_drafts("a", 1, 5, 3) and reps[1].tokens == fake_drafts("b", 1, 6, 3)


def test_make_client_picks_by_the_setting(servers):
    (srv,) = servers(1)
    one = make_client(cfg(srv.endpoint))
    many = make_client(cfg(f"{srv.endpoint},{srv.endpoint.replace('127.0.0.1', 'localhost')}"))
    try:
        assert isinstance(one, DraftClient) and isinstance(many, FleetClient)
    finally:
        one.close()
        many.close()


def test_early_taps_only_when_every_welcomed_server_takes_them(servers):
    # A fleet in a rolling upgrade: one server without early taps turns them off for the engine
    # (send_taps False, nothing sent; the caller sends the single message). With both, each
    # session's span goes to its own server, and the commit after it too, with no rows.
    srvs = servers(2)
    srvs[0].features = (FEATURE_EARLY_TAPS,)
    names = [f"e{i}" for i in range(12)]
    taps = np.random.default_rng(1).integers(0, 1 << 16, size=(len(names) * 3, WIDTH), dtype=np.uint16)
    spans = [StepRequest(s, 0, 3, 0, 0) for s in names]
    with fleet_of(srvs) as fc:
        assert fc.connect(wait=True) is not None
        assert wait_for(lambda: all(c.welcome is not None for c in fc._members.values()))
        assert not fc.early_taps
        assert not fc.send_taps(spans, taps)
        time.sleep(0.05)
        assert not srvs[0].steps() and not srvs[1].steps()
    srvs[1].features = (FEATURE_EARLY_TAPS,)
    with fleet_of(srvs) as fc:
        assert fc.connect(wait=True) is not None
        assert wait_for(lambda: all(c.welcome is not None for c in fc._members.values()))
        assert fc.early_taps
        assert fc.send_taps(spans, taps)
        assert wait_for(lambda: sum(len(sessions_on(s)) for s in srvs) == len(names))
        for srv in srvs:
            got = sessions_on(srv)
            assert got and all(fc.server_of(s) == srv.endpoint for s in got)
            for rec in srv.steps():
                assert all(e.phase == Phase.TAPS and e.k == 0 for e in rec.msg.entries)
                expect = np.concatenate([taps[names.index(e.session) * 3 :][:3] for e in rec.msg.entries])
                assert np.array_equal(rec.taps, expect)
        before = {s.endpoint: len(s.steps()) for s in srvs}
        fc.commit([StepRequest(s, 2, 0, 7, 4) for s in names])
        for srv in srvs:
            commits = srv.steps()[before[srv.endpoint] :]
            assert commits and all(rec.taps is None for rec in commits)
            assert {e.session for rec in commits for e in rec.msg.entries} == sessions_on(srv)
            assert all(e.phase == Phase.COMMIT and e.rows == 0 for rec in commits for e in rec.msg.entries)


def test_a_fleet_declines_a_span_too_large_for_frames_unless_it_is_exact(servers):
    # early_taps_max_mib: a span over it (rows in frames) is declined on every server, nothing sent;
    # the same span marked exact (only rows the step commits: predicted commits) goes, each part to
    # its session's server
    srvs = servers(2)
    for srv in srvs:
        srv.features = (FEATURE_EARLY_TAPS,)
    names = [f"x{i}" for i in range(8)]
    taps = np.random.default_rng(2).integers(0, 1 << 16, size=(len(names) * 3, WIDTH), dtype=np.uint16)
    spans = [StepRequest(s, 0, 3, 0, 0) for s in names]
    with fleet_of(srvs, early_taps_max_mib=WIDTH * 2 / 2**20) as fc:  # one row fits, three do not
        assert fc.connect(wait=True) is not None
        assert wait_for(lambda: all(c.welcome is not None for c in fc._members.values()) and fc.early_taps)
        assert not fc.send_taps(spans, taps)
        time.sleep(0.05)
        assert not srvs[0].steps() and not srvs[1].steps()
        assert fc.send_taps(spans, taps, exact=True)
        assert wait_for(lambda: sum(len(sessions_on(s)) for s in srvs) == len(names))
        assert all(e.phase == Phase.TAPS for s in srvs for rec in s.steps() for e in rec.msg.entries)
        assert fc.stats()["early_taps_declined"] >= 1


def test_taps_whose_commits_follow_say_so_on_the_wire_and_only_they(servers):
    # send_taps(commit_follows=True) (predicted commits): each server's Taps Step carries the hint, so
    # it waits for the commits instead of ingesting the rows alone; plain taps and the commits do not
    srvs = servers(2)
    for srv in srvs:
        srv.features = (FEATURE_EARLY_TAPS,)
    names = [f"f{i}" for i in range(6)]
    rng = np.random.default_rng(3)
    with fleet_of(srvs) as fc:
        assert fc.connect(wait=True) is not None
        assert wait_for(lambda: all(c.welcome is not None for c in fc._members.values()) and fc.early_taps)
        spans = [StepRequest(s, 0, 2, 0, 0) for s in names]
        assert fc.send_taps(spans, rng.integers(0, 1 << 16, size=(12, WIDTH), dtype=np.uint16))
        ticket = fc.submit_commit([StepRequest(s, 2, 0, 5, 4) for s in names])
        ticket.collect()
        spans = [StepRequest(s, 2, 3, 0, 0) for s in names]
        taps = rng.integers(0, 1 << 16, size=(18, WIDTH), dtype=np.uint16)
        assert fc.send_taps(spans, taps, exact=True, commit_follows=True)
        fc.submit_commit([StepRequest(s, 5, 0, 5, 4) for s in names]).collect()
        assert wait_for(lambda: sum(len(s.steps()) for s in srvs) == 8)  # taps and commits, two steps, two servers
        for srv in srvs:
            steps = srv.steps()
            assert [(rec.msg.entries[0].phase, rec.msg.commit_follows) for rec in steps] == [
                (Phase.TAPS, False),
                (Phase.COMMIT, False),
                (Phase.TAPS, True),
                (Phase.COMMIT, False),
            ]
