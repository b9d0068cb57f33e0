"""End to end over real sockets: DraftClients against a draft-server process, with faults.

The issue-2 must-shows: many sessions from two clients with staggered arrivals and a long
prefill beside decoding (drafts prove the rows); a paused, then killed and restarted server
(no call ever waits past its budget + 5 ms, drafting resumes by itself); a slow server
(fallback, never a raise); zero live sessions at the end (read from /metrics).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from protocol import Status
from target_client import ClientConfig, DraftClient, StepRequest
from tests.conftest import CHECKSUM_CONTRACT, SessionMirror, host_delay_ms, random_taps, wait_for

K = 4
SLACK_MS = 5.0


def assert_within_budget(e: Engine, budget: float) -> None:
    """Every call returned within budget + 5 ms of the client's own time.

    On an oversubscribed host a thread can sit runnable on the run queue while other processes
    hold both cores, or stand still in a garbage collection or while the hypervisor runs another
    guest; that time (``tests.conftest.host_delay_ms``, read per call) is the host's doing, not
    the client's, and is taken out. Such calls must stay rare (< 2%).
    """
    over = [(w, d) for w, d in zip(e.waits, e.host_delays, strict=True) if w > budget + SLACK_MS]
    for w, d in over:
        assert w - d <= budget + SLACK_MS, f"{e.name}: a call waited {w:.1f} ms ({d:.1f} ms host time)"
    assert len(over) <= max(1, len(e.waits) // 50), f"{e.name}: {len(over)} of {len(e.waits)} calls over budget"


class Engine:
    """A fake target engine: n sessions, staggered, each step commits 1..K+1 rows."""

    def __init__(self, name: str, endpoint: str, n: int, budget_ms: float, seed: int, **cfg) -> None:
        self.client = DraftClient(ClientConfig(endpoint=endpoint, budget_ms=budget_ms, name=name, **cfg))
        self.name, self.n, self.budget_ms = name, n, budget_ms
        self.rng = np.random.default_rng(seed)
        self.mirrors = {f"{name}-{i}": SessionMirror() for i in range(n)}
        self.ends = dict.fromkeys(self.mirrors, 0)
        self.waits: list[float] = []
        self.host_delays: list[float] = []  # host time taken from this process during each call (ms)
        self.log: list[tuple[int, str, Status | None, list[int], list[int] | None]] = []
        self.errors: list[BaseException] = []

    def step(self, step_no: int, prefill: dict[str, int] | None = None, verify: bool = True) -> None:
        reqs, chunks = [], []
        for i, sid in enumerate(self.mirrors):
            if step_no < i:  # staggered arrival: session i joins at step i
                continue
            rows = (prefill or {}).get(sid) or (8 if self.ends[sid] == 0 else 1 + int(self.rng.integers(0, K + 1)))
            k = 0 if prefill and sid in prefill else K
            taps = random_taps(self.rng, rows)
            reqs.append(StepRequest(sid, self.ends[sid], rows, int(self.rng.integers(0, 1000)), k))
            chunks.append(taps)
        if not reqs:
            return
        taps = np.ascontiguousarray(np.concatenate(chunks))
        h0, t = host_delay_ms(), time.perf_counter()
        replies = self.client.step(reqs, taps)
        self.waits.append((time.perf_counter() - t) * 1000)
        self.host_delays.append(host_delay_ms() - h0)
        for r, rep, rows in zip(reqs, replies, chunks, strict=True):
            m = self.mirrors[r.session]
            m.apply(r.pos, rows, known_end=r.pos if m.rows else None)
            self.ends[r.session] += r.rows
            expect = m.expect(r.anchor, r.k) if (verify and r.k) else None
            self.log.append((step_no, r.session, rep.status, rep.tokens, expect))

    def run(self, steps: int, **kw) -> None:
        try:
            for s in range(steps):
                self.step(s, **kw)
        except BaseException as e:  # surfaced by the test thread
            self.errors.append(e)

    def close(self) -> None:
        self.client.free(list(self.mirrors))
        self.client.close()


@pytest.mark.timeout(120)
def test_two_clients_sixteen_sessions_long_prefill_while_decoding(server):
    a = Engine("A", server.endpoint, 8, budget_ms=2000.0, seed=1)
    b = Engine("B", server.endpoint, 8, budget_ms=2000.0, seed=2)
    for e in (a, b):
        e.client.connect(wait=True)
    long_taps_sid = "A-7"
    steps = 24

    def run_a() -> None:
        try:
            for s in range(steps):
                # session A-7 streams a 4,096-row prefill (ingest only) at its first step
                a.step(s, prefill={long_taps_sid: 4096} if s == 7 else None)
        except BaseException as e:
            a.errors.append(e)

    ta = threading.Thread(target=run_a)
    tb = threading.Thread(target=b.run, args=(steps,))
    ta.start()
    time.sleep(0.05)  # staggered clients too
    tb.start()
    ta.join()
    tb.join()
    assert not a.errors and not b.errors, (a.errors, b.errors)
    decode_steps = 0
    for e in (a, b):
        for step_no, sid, status, tokens, expect in e.log:
            if expect is None:
                continue
            decode_steps += 1
            assert status == Status.OK, (step_no, sid, status)
            assert tokens == expect, f"{sid} step {step_no}: server context differs from what was sent"
    assert decode_steps > 300
    a.close()
    b.close()
    assert wait_for(lambda: server.metrics()["draft_server_sessions"] == 0)
    met = server.metrics()
    assert met["draft_server_prefill_chunks_total"] >= 4096 // 512 - 1  # the last chunk rides a decode batch
    assert met['draft_server_entries_total{status="ok"}'] >= decode_steps


@pytest.mark.timeout(180)
def test_pause_then_kill_and_restart_every_call_within_budget(server):
    budget = 50.0
    engines = [
        Engine(n, server.endpoint, 4, budget_ms=budget, seed=i, breaker_backoff_ms=100.0) for i, n in enumerate("PQ")
    ]
    for e in engines:
        e.client.connect(wait=True)
    stop = threading.Event()
    calls: list[list[tuple[float, float, Status | None, int]]] = [[], []]  # (start, end, status, drafts)

    def drive(idx: int, e: Engine) -> None:
        s = 0
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                e.step(s, verify=False)
                st = e.log[-1]
                calls[idx].append((t0, time.monotonic(), st[2], len(st[3])))
                s += 1
                time.sleep(0.005)
        except BaseException as ex:
            e.errors.append(ex)

    threads = [threading.Thread(target=drive, args=(i, e)) for i, e in enumerate(engines)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    t_pause = time.monotonic()
    server.pause()
    t_stopped = time.monotonic()  # a step begun after this cannot be answered until SIGCONT
    time.sleep(2.0)
    t_resume = time.monotonic()
    server.resume()
    time.sleep(1.5)
    old_epoch = server.epoch
    t_kill = time.monotonic()
    server.kill()
    time.sleep(0.5)
    server.start()
    t_restart = time.monotonic()
    time.sleep(3.0)
    stop.set()
    for t in threads:
        t.join(10)
    for e in engines:
        assert not e.errors, e.errors
        assert_within_budget(e, budget)
    assert server.epoch != old_epoch
    for rec in calls:
        before = [(st, n) for a, b, st, n in rec if b < t_pause]
        paused = [(st, n) for a, b, st, n in rec if a > t_stopped and b < t_resume]
        resumed = [(st, n) for a, b, st, n in rec if a > t_resume and b < t_kill]
        restarted = [(st, n) for a, b, st, n in rec if a > t_restart]
        assert any(st == Status.OK and n == K for st, n in before)
        assert paused and all(n == 0 for st, n in paused)  # no drafts while the server is stopped
        assert any(st == Status.OK and n == K for st, n in resumed), "drafting did not resume after SIGCONT"
        tail = restarted[-20:]
        assert tail and all(st == Status.OK and n == K for st, n in tail), "drafting did not resume after restart"
    for e in engines:
        assert e.client.stats()["epoch_changes"] >= 1
        e.close()
    assert wait_for(lambda: server.metrics()["draft_server_sessions"] == 0)


@pytest.mark.timeout(120)
def test_slow_server_clients_fall_back_and_never_raise(server_factory):
    srv = server_factory("--checksum-delay-ms", "120", "--max-queue-rows", "64")
    budget = 30.0
    engines = [Engine(n, srv.endpoint, 6, budget_ms=budget, seed=i) for i, n in enumerate("XY")]
    for e in engines:
        e.client.connect(wait=True)
    threads = [threading.Thread(target=e.run, args=(15,), kwargs={"verify": False}) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    statuses: dict[Status | None, int] = {}
    for e in engines:
        assert not e.errors, e.errors
        assert_within_budget(e, budget)
        for _, _, st, tokens, _ in e.log:
            statuses[st] = statuses.get(st, 0) + 1
            assert tokens == [] or len(tokens) == K
    fallbacks = sum(n for st, n in statuses.items() if st != Status.OK)
    assert fallbacks > 0.5 * sum(statuses.values())  # mostly misses: the server is far slower than the budget
    met = srv.metrics()
    assert (
        met['draft_server_entries_total{status="expired"}'] + met['draft_server_entries_total{status="overloaded"}'] > 0
    )
    for e in engines:
        e.close()
    assert wait_for(lambda: srv.metrics()["draft_server_sessions"] == 0, timeout=20)


def test_ttl_reclaims_sessions_of_a_client_that_vanished(server_factory):
    srv = server_factory("--session-ttl-s", "1")
    e = Engine("V", srv.endpoint, 5, budget_ms=2000.0, seed=3)
    e.client.connect(wait=True)
    e.run(6)
    assert not e.errors
    assert srv.metrics()["draft_server_sessions"] == 5
    e.client.close()  # gone without Free
    assert wait_for(lambda: srv.metrics()["draft_server_sessions"] == 0, timeout=10)
    assert srv.metrics()['draft_server_session_evictions_total{reason="ttl"}'] == 5


def test_checksum_contract_matches_fixture():
    from draft_server.drafters.checksum import ChecksumDrafter

    assert ChecksumDrafter().contract == CHECKSUM_CONTRACT
