"""Named regression tests, one per failure mode of the predecessor (reference/predecessor.md §4, §5, §6).

Each test names the failure it guards against and cites the section of predecessor.md that
describes it. They run against a real `draft-server serve` subprocess (checksum drafter) over
real sockets; drafts are checked exactly with ``SessionMirror`` (the checksum drafter's drafts
prove which rows the server holds at which positions). The only timing assertion is the
product's: a step() returns within its budget + 5 ms.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import numpy as np
import pytest

from draft_tools.chaos.proxy import ChaosProxy, ProxyConfig
from protocol import Error, ErrorCode, Free, Ping, Pong, Status, Step, StepEntry, StepResult
from target_client import ClientConfig, DraftClient, StepRequest
from tests.conftest import RawPeer, SessionMirror, free_port, random_taps, wait_for

K = 4
from tests.conftest import assert_on_time  # noqa: E402

ROOMY_MS = 2000.0  # for calls that must be answered, on a loaded machine


def client_for(endpoint: str, budget_ms: float = ROOMY_MS, **kw) -> DraftClient:
    from prometheus_client import CollectorRegistry

    kw.setdefault("registry", CollectorRegistry())
    c = DraftClient(ClientConfig(endpoint=endpoint, budget_ms=budget_ms, **kw))
    c.connect(wait=True)
    return c


def timed_step(client: DraftClient, reqs, taps, budget_ms: float | None = None):
    budget = budget_ms if budget_ms is not None else client.budget_ms
    return assert_on_time(lambda: client.step(reqs, taps, budget_ms), budget)


class Track:
    """One session as the engine sees it: its end, and the mirror of what the server must hold."""

    def __init__(self, sid: str, rng: np.random.Generator) -> None:
        self.sid, self.rng, self.end, self.mirror = sid, rng, 0, SessionMirror()

    def request(self, rows: int, k: int = K) -> tuple[StepRequest, np.ndarray]:
        taps = random_taps(self.rng, rows)
        req = StepRequest(self.sid, self.end, rows, int(self.rng.integers(0, 1000)), k)
        self.mirror.apply(self.end, taps, known_end=self.end if self.mirror.rows else None)
        self.end += rows
        return req, taps

    def expect(self, req: StepRequest) -> list[int]:
        return self.mirror.expect(req.anchor, req.k)


def test_two_concurrent_requests_with_staggered_arrival(server):
    """predecessor.md §4 (1) and §6 Testing: "B2: second deferred, then a 30 s zmq.error.Again".

    One request worked, two hung: the batch-of-two path was never exercised. Here a second
    session joins a running one in the same Step (a batch of two at once), and a third arrives
    from another client while both decode; every draft must be exactly right, every call on time.
    """
    rng = np.random.default_rng(1)
    a, b = client_for(server.endpoint), client_for(server.endpoint)
    s1, s2, s3 = Track("first", rng), Track("second", rng), Track("third", rng)
    errors: list[BaseException] = []

    def other_client() -> None:
        try:
            for step in range(12):
                req, taps = s3.request(8 if step == 0 else 1 + step % (K + 1))
                out = timed_step(b, [req], taps)
                assert out[0].status == Status.OK and out[0].tokens == s3.expect(req)
        except BaseException as e:
            errors.append(e)

    t = None
    for step in range(12):
        tracks = [s1] if step < 3 else [s1, s2]  # the second request arrives at step 3
        reqs, parts = [], []
        for tr in tracks:
            req, taps = tr.request(16 if tr.end == 0 else 1 + step % (K + 1))
            reqs.append(req)
            parts.append(taps)
        out = timed_step(a, reqs, np.ascontiguousarray(np.concatenate(parts)))
        for req, tr, rep in zip(reqs, tracks, out, strict=True):
            assert rep.status == Status.OK, (step, tr.sid, rep)
            assert rep.tokens == tr.expect(req), f"{tr.sid} at step {step}: wrong context on the server"
        if step == 4:
            t = threading.Thread(target=other_client)
            t.start()
    assert t is not None
    t.join(60)
    assert not errors, errors
    met = server.metrics()
    # drafted batches of two or more happened: the mean batch size is above one
    assert met["draft_server_batch_sessions_sum"] > met["draft_server_batch_sessions_count"]
    a.close()
    b.close()


def test_long_prefill_arriving_while_others_decode(server):
    """predecessor.md §4 (2) and §6 Prefill: head-of-line blocking by an 8k-token prefill.

    The newcomer's prefill travelled in the same PROPOSE as the running request's decode and
    was ingested eagerly in front of it. Here an 8,192-row prefill arrives from another client
    while a session decodes with a tight budget: the decoding session keeps getting exact drafts
    on every step, the prefill is ingested in chunks, and the newcomer then drafts exactly.
    """
    rng = np.random.default_rng(2)
    dec_client, pre_client = client_for(server.endpoint), client_for(server.endpoint)
    dec, new = Track("decoding", rng), Track("newcomer", rng)
    req, taps = dec.request(32)
    assert timed_step(dec_client, [req], taps)[0].tokens == dec.expect(req)
    chunks_before = server.metrics()["draft_server_prefill_chunks_total"]
    big_req, big_taps = new.request(8192, k=0)  # ingest only: answered at once, ingested in chunks
    out = timed_step(pre_client, [big_req], big_taps)
    assert out[0].status == Status.OK and out[0].tokens == []
    ok_during = 0
    for _ in range(20):
        req, taps = dec.request(1 + int(rng.integers(0, K + 1)))
        rep = timed_step(dec_client, [req], taps, budget_ms=500.0)[0]
        assert rep.status == Status.OK and rep.tokens == dec.expect(req)
        ok_during += 1
    req, taps = new.request(1)
    rep = timed_step(pre_client, [req], taps)[0]
    assert rep.status == Status.OK and rep.tokens == new.expect(req)  # all 8,193 rows, in order
    assert server.metrics()["draft_server_prefill_chunks_total"] - chunks_before >= 8192 // 512 - 1
    assert ok_during == 20
    dec_client.close()
    pre_client.close()


def test_reply_lost_after_server_applied_rows(server):
    """predecessor.md §4 (4): REQ/REP lockstep after a timeout; "the abandoned request still runs
    and mutates KV; its late reply is dropped".

    A fault-injecting proxy drops one reply after the server applied its rows. The client gives
    up at its budget, then resends those rows with the next step; positions make the resend an
    overwrite, so the server's context is exactly what was sent once (no duplicated rows).
    """
    port = free_port()
    proxy = ChaosProxy(ProxyConfig(frontend=f"tcp://127.0.0.1:{port}", backend=server.endpoint, seed=3))
    pt = threading.Thread(target=proxy.run, daemon=True)
    pt.start()
    try:
        c = client_for(f"tcp://127.0.0.1:{port}", budget_ms=300.0, breaker_failures=100)
        tr = Track("lost", np.random.default_rng(3))
        req, taps = tr.request(12)
        assert timed_step(c, [req], taps)[0].tokens == tr.expect(req)
        applied = server.metrics()["draft_server_rows_ingested_total"]
        proxy.cfg.drop_reply_p = 1.0  # the next reply is lost on its way back
        req, taps = tr.request(3)
        rep = timed_step(c, [req], taps)[0]
        assert rep.tokens == [] and rep.status is None
        assert wait_for(lambda: server.metrics()["draft_server_rows_ingested_total"] == applied + 3)  # applied
        proxy.cfg.drop_reply_p = 0.0
        req, taps = tr.request(2)
        rep = timed_step(c, [req], taps)[0]
        assert rep.status == Status.OK and rep.tokens == tr.expect(req)  # exactly 12 + 3 + 2 rows
        st = c.stats()
        assert st["resent_rows"] == 3 and st["timeouts"] == 1
        assert proxy.stats.dropped_replies == 1
        c.close()
    finally:
        proxy.stop()
        pt.join(5)


def test_zero_and_negative_budget(server):
    """predecessor.md §5 review of #588: "timeout_ms <= 0 makes ZMQ block forever; validate it".

    A budget of 0, a negative one or NaN is a caller bug: the client refuses it at once
    (ValueError, nothing sent), its config refuses it, and the server answers a raw Step
    carrying one with a typed error, then keeps serving.
    """
    c = client_for(server.endpoint)
    tr = Track("budget", np.random.default_rng(4))
    req, taps = tr.request(4)
    sent_before = server.metrics()['draft_server_messages_total{kind="step"}']
    for bad in (0, 0.0, -1.0, -5, float("nan"), float("inf")):
        t0 = time.monotonic()
        with pytest.raises(ValueError):
            c.step([req], taps, budget_ms=bad)
        assert time.monotonic() - t0 < 1.0  # refused at once, never a blocking wait
        with pytest.raises(ValueError):
            ClientConfig(endpoint=server.endpoint, budget_ms=bad)
    with pytest.raises(ValueError):
        c.ping(timeout_ms=0)
    assert server.metrics()['draft_server_messages_total{kind="step"}'] == sent_before
    peer = RawPeer(server.endpoint)
    for i, bad in enumerate((0.0, -3.0, float("nan"))):
        peer.call_id = 100 + i
        peer.send(Step(peer.call_id, bad, (StepEntry("x", 0, 1, 1, 1),), None))
        r = peer.recv()
        assert isinstance(r, Error) and r.code == ErrorCode.BAD_MESSAGE and r.call_id == peer.call_id
    peer.close()
    assert timed_step(c, [req], taps)[0].tokens == tr.expect(req)  # the session is unharmed
    c.close()


def test_server_restart_mid_generation(server_factory):
    """predecessor.md §6 Restarts and Testing ("a paused or killed server"), §3 server_id.

    The server is killed while a call is in flight (its drafting is slow on purpose) and
    restarted on the same port. No call waits past its budget + 5 ms, the client sees the new
    epoch, and drafting is back within 2 steps of the first step after READY. A session that
    starts after the restart drafts exactly.
    """
    srv = server_factory("--checksum-delay-ms", "40")
    budget = 150.0
    c = client_for(srv.endpoint, budget_ms=budget, breaker_failures=3)
    rng = np.random.default_rng(5)
    tr = Track("mid", rng)
    req, taps = tr.request(8)
    assert timed_step(c, [req], taps)[0].status == Status.OK
    old_epoch = c.epoch
    result: list = []
    req, taps = tr.request(2)
    t = threading.Thread(target=lambda: result.append(timed_step(c, [req], taps)))
    t.start()
    time.sleep(0.01)  # the call is in flight: the server is inside its 40 ms draft batch
    srv.kill()
    t.join(10)
    assert result and result[0][0].tokens == []
    for _ in range(4):  # server down: fallbacks within budget, rows buffered
        req, taps = tr.request(1 + int(rng.integers(0, K + 1)))
        assert timed_step(c, [req], taps)[0].tokens == []
    srv.start()  # READY printed
    steps_without = 0
    for _ in range(40):
        req, taps = tr.request(1 + int(rng.integers(0, K + 1)))
        rep = timed_step(c, [req], taps)[0]
        if rep.tokens:
            assert len(rep.tokens) == K and rep.status == Status.OK
            break
        steps_without += 1
        time.sleep(0.03)  # the target's own step time
    assert steps_without < 2, f"drafting came back only after {steps_without} steps"
    assert c.epoch != old_epoch and c.stats()["epoch_changes"] == 1
    fresh = Track("after-restart", rng)
    for _ in range(3):
        req, taps = fresh.request(6)
        rep = timed_step(c, [req], taps)[0]
        assert rep.status == Status.OK and rep.tokens == fresh.expect(req)
    c.close()


def test_k0_step_then_drafting(server):
    """predecessor.md §5 review of #465 (CodeRabbit, Major): "a step with depth 0 returns before
    updating remote continuity, so stale KV can be reused".

    Steps with k=0 (rows only, and even no rows at all) must still extend the session, so the
    next drafting step sees every row, in order.
    """
    c = client_for(server.endpoint)
    tr = Track("k0", np.random.default_rng(6))
    req, taps = tr.request(5, k=0)
    out = timed_step(c, [req], taps)
    assert out[0].status == Status.OK and out[0].tokens == []
    req, taps = tr.request(3, k=0)
    assert timed_step(c, [req], taps)[0].tokens == []
    empty = StepRequest(tr.sid, tr.end, 0, 7, 0)  # k=0 and no rows: a no-op
    assert timed_step(c, [empty], None)[0].status == Status.OK
    req, taps = tr.request(2, k=K)
    rep = timed_step(c, [req], taps)[0]
    assert rep.status == Status.OK and rep.tokens == tr.expect(req)  # context is 5 + 3 + 2 rows
    for k in (0, K, 0, 1, K):
        req, taps = tr.request(1 + k % 3, k=k)
        rep = timed_step(c, [req], taps)[0]
        assert rep.status == Status.OK and rep.tokens == (tr.expect(req) if k else [])
    c.close()


def test_stale_ids_freed_and_reenabled_after_timeouts(server_factory):
    """predecessor.md §3 Fail-closed: "after a timeout, stale IDs were never freed" (7f37e34 later
    freed and re-enabled them); §6 Failure scope.

    Steps time out (the server is slower than the budget); the sessions are not disabled: once
    the budget allows, they draft again, and a Free releases them on the server.
    """
    srv = server_factory("--checksum-delay-ms", "60")
    c = client_for(srv.endpoint, budget_ms=20.0, breaker_failures=100)
    rng = np.random.default_rng(7)
    tracks = [Track(f"stale{i}", rng) for i in range(3)]
    for _ in range(3):
        parts = [tr.request(2) for tr in tracks]
        out = timed_step(c, [p[0] for p in parts], np.ascontiguousarray(np.concatenate([p[1] for p in parts])))
        assert all(r.tokens == [] and r.status in (None, Status.EXPIRED) for r in out)
    parts = [tr.request(1) for tr in tracks]
    out = timed_step(c, [p[0] for p in parts], np.concatenate([p[1] for p in parts]), budget_ms=ROOMY_MS)
    for (req, _), tr, rep in zip(parts, tracks, out, strict=True):
        assert rep.status == Status.OK and rep.tokens == tr.expect(req)  # re-enabled, full context
    assert wait_for(lambda: srv.metrics()["draft_server_sessions"] == 3)
    c.free([tr.sid for tr in tracks])
    assert wait_for(lambda: srv.metrics()["draft_server_sessions"] == 0)
    assert srv.metrics()['draft_server_session_evictions_total{reason="free"}'] == 3
    c.close()


def test_reset_or_free_of_unknown_id_is_a_noop(server):
    """predecessor.md §5 (7f37e34): "make RESET of an unknown ID a no-op".

    Freeing sessions the server never saw (or already freed) changes nothing: no error, no
    effect on live sessions, whose drafts stay exact.
    """
    c = client_for(server.endpoint)
    tr = Track("live", np.random.default_rng(8))
    req, taps = tr.request(6)
    assert timed_step(c, [req], taps)[0].tokens == tr.expect(req)
    c.free(["never-seen", "other", "live-not"])
    peer = RawPeer(server.endpoint)
    peer.send(Free(("live", "ghost")))  # another client's Free cannot touch this client's session
    peer.send(Ping(1))
    assert isinstance(peer.recv(), Pong)
    assert wait_for(lambda: server.metrics()["draft_server_sessions"] == 1)
    req, taps = tr.request(2)
    assert timed_step(c, [req], taps)[0].tokens == tr.expect(req)
    c.free([tr.sid])
    c.free([tr.sid])  # twice: the second is a no-op
    assert wait_for(lambda: server.metrics()["draft_server_sessions"] == 0)
    met = server.metrics()
    assert met["draft_server_io_errors_total"] == 0 and met["draft_server_engine_errors_total"] == 0
    peer.close()
    c.close()


def test_receive_failure_is_not_fatal_and_health_tells_the_truth(server):
    """predecessor.md §4 (5): "ZMQ thread dead while status says ready" (a failed receive ended
    the loop), and §6 Server: health that reflects whether the loop is alive.

    Empty frames, a lone identity-less frame, garbage, wrong frame counts, an unknown kind and
    a frame over MAXMSGSIZE must each be refused without ending the I/O thread; /healthz stays
    green and the server answers the next client exactly.
    """
    peer = RawPeer(server.endpoint)
    for frames in ([b""], [b"", b""], [b"\xc1"], [b"\x00" * 100, b"x", b"y"], [b"\x82\xa4kind\xa3zzz\xa7call_id\x05"]):
        peer.send_raw(frames)
    peer.send(Step(9, 50.0, (StepEntry("s", 0, 2, 1, 1),), None))  # rows announced, no tensor
    r = peer.recv()
    while r is not None and r.call_id != 9:  # the unknown kind's error (call 5) may come first
        r = peer.recv()
    assert isinstance(r, Error) and r.code == ErrorCode.BAD_FRAMES
    peer.close()
    c = client_for(server.endpoint)
    tr = Track("after", np.random.default_rng(9))
    req, taps = tr.request(3)
    assert timed_step(c, [req], taps)[0].tokens == tr.expect(req)
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/healthz", timeout=5).read())
    assert health["healthy"] is True
    met = server.metrics()
    assert met["draft_server_io_errors_total"] == 0 and met["draft_server_healthy"] == 1
    assert (
        met["draft_server_dropped_messages_total"]
        + sum(v for k, v in met.items() if k.startswith("draft_server_bad_messages_total{"))
        >= 5
    )
    c.close()


def test_oversized_frame_is_refused_at_the_socket(server_factory):
    """predecessor.md §6 Startup/validation and DESIGN §4 Bad input: cap message size at the socket.

    A message over MAXMSGSIZE costs the sender its connection, never the server its memory or
    its I/O thread; other clients keep drafting.
    """
    srv = server_factory("--max-message-mib", "1")
    c = client_for(srv.endpoint)
    tr = Track("ok", np.random.default_rng(10))
    rogue = RawPeer(srv.endpoint)
    rogue.send_raw([b"\x00" * (2 << 20)])
    rogue.send(Ping(3))  # may be lost with the dropped connection; the point is the server lives
    req, taps = tr.request(4)
    assert timed_step(c, [req], taps)[0].tokens == tr.expect(req)
    assert srv.proc is not None and srv.proc.poll() is None
    assert srv.metrics()["draft_server_io_errors_total"] == 0
    rogue.close()
    c.close()


def test_capacity_checked_at_handshake_client_refuses_rows_beyond_limits(server_factory):
    """predecessor.md §5 (7f37e34 "check max_context_tokens at init") and §2 Capacity (64-row
    staging: bigger prefill chunks failed until raised).

    The Welcome carries the server's limits; the client refuses a step beyond them locally
    (ValueError, a caller bug, nothing sent) instead of a remote failure, and steps within the
    limits draft exactly.
    """
    srv = server_factory("--max-rows-per-step", "64", "--max-entries-per-step", "4")
    c = client_for(srv.endpoint)
    assert c.limits is not None and c.limits.max_rows_per_step == 64 and c.limits.max_entries_per_step == 4
    tr = Track("cap", np.random.default_rng(11))
    before = srv.metrics()['draft_server_messages_total{kind="step"}']
    big = StepRequest(tr.sid, 0, 65, 1, K)
    with pytest.raises(ValueError, match="max_rows_per_step"):
        c.step([big], random_taps(np.random.default_rng(0), 65))
    many = [StepRequest(f"m{i}", 0, 0, 1, 0) for i in range(5)]
    with pytest.raises(ValueError, match="max_entries_per_step"):
        c.step(many, None)
    assert srv.metrics()['draft_server_messages_total{kind="step"}'] == before  # nothing was sent
    req, taps = tr.request(64)
    assert timed_step(c, [req], taps)[0].tokens == tr.expect(req)
    c.close()


def test_admission_is_per_request_not_per_batch(server_factory):
    """predecessor.md §2 Capacity ("every error is an ok:false reply") and §3 Fail-closed (any
    exception disabled every request of the batch); §6 Failure scope: admit or reject per request.

    One Step with a bad entry, entries beyond session capacity and good entries: each gets its
    own status, and the good ones get exact drafts.
    """
    srv = server_factory("--max-sessions", "2")
    peer = RawPeer(srv.endpoint)
    rng = np.random.default_rng(12)
    good = [SessionMirror(), SessionMirror()]
    taps = random_taps(rng, 3 + 3 + 3)
    entries = [
        StepEntry("g0", 0, 3, 11, K),
        StepEntry("bad", 0, 3, 10**9, K),  # anchor outside the vocabulary
        StepEntry("g1", 0, 3, 12, K),
    ]
    r = peer.step(entries, taps)
    assert isinstance(r, StepResult)
    good[0].apply(0, taps[0:3], None)
    good[1].apply(0, taps[6:9], None)
    assert [e.status for e in r.results] == [Status.OK, Status.BAD_ENTRY, Status.OK]
    assert list(r.results[0].drafts) == good[0].expect(11, K)
    assert list(r.results[2].drafts) == good[1].expect(12, K)
    # a third session while both are busy in the same step: overloaded alone, the others drafted
    t2 = random_taps(rng, 3)
    r = peer.step([StepEntry("g0", 3, 1, 5, K), StepEntry("g1", 3, 1, 6, K), StepEntry("g2", 0, 1, 7, K)], t2)
    good[0].apply(3, t2[0:1], 3)
    good[1].apply(3, t2[1:2], 3)
    assert [e.status for e in r.results] == [Status.OK, Status.OK, Status.OVERLOADED]
    assert list(r.results[0].drafts) == good[0].expect(5, K)
    assert list(r.results[1].drafts) == good[1].expect(6, K)
    assert r.results[2].retry_after_ms > 0
    peer.close()


def test_every_wait_is_bounded_by_the_budget_while_the_server_is_paused(server):
    """predecessor.md §3 Timeouts (30 s receive timeout; queue.join, Event.wait, barrier without
    deadline) and §6 Client: waits bounded and short, set by the draft budget.

    While the server is stopped (SIGSTOP) every step returns within its budget + 5 ms with no
    drafts; after SIGCONT drafting comes back by itself.
    """
    budget = 40.0
    c = client_for(server.endpoint, budget_ms=budget, breaker_backoff_ms=100.0)
    rng = np.random.default_rng(13)
    tr = Track("paused", rng)
    req, taps = tr.request(4)
    assert timed_step(c, [req], taps, budget_ms=ROOMY_MS)[0].status == Status.OK
    server.pause()
    try:
        for _ in range(10):
            req, taps = tr.request(1)
            assert timed_step(c, [req], taps)[0].tokens == []
    finally:
        server.resume()
    back = False
    for _ in range(100):
        req, taps = tr.request(1)
        if timed_step(c, [req], taps)[0].tokens:
            back = True
            break
        time.sleep(0.02)
    assert back, "drafting did not come back after SIGCONT"
    c.close()


def test_threads_sharing_one_client_never_deadlock(server):
    """predecessor.md §4 (6): "gate or barrier deadlock, or two threads on one socket" (the main
    thread, a reply thread and an ingest worker shared one REQ socket under a lock).

    Eight threads step through one DraftClient at once, each with its own sessions: no call
    waits past its budget + 5 ms and every draft is exact.
    """
    c = client_for(server.endpoint, budget_ms=ROOMY_MS)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            tr = Track(f"t{i}", np.random.default_rng(100 + i))
            for step in range(15):
                req, taps = tr.request(6 if step == 0 else 1 + step % (K + 1), k=0 if step % 5 == 4 else K)
                rep = timed_step(c, [req], taps)[0]
                assert rep.status == Status.OK and rep.tokens == (tr.expect(req) if req.k else [])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a caller thread is stuck"
    assert not errors, errors[:2]
    assert c.stats()["io_thread_alive"] is True
    c.close()


def test_startup_validates_budget_staging_and_limits():
    """predecessor.md §6 Startup: "validate the timeout, staging size, max_model_len and window at
    startup" (the predecessor failed at request time instead: 64-row staging, max_model_len).

    A server refuses to start, with one clear line and exit code 2, on a budget limit of 0, a
    prefill chunk larger than its batch, or zero capacity.
    """
    import subprocess
    import sys

    from tests.conftest import ROOT

    for flags, word in (
        (["--max-budget-ms", "0"], "max_budget_ms"),
        (["--prefill-chunk-rows", "8192", "--max-batch-rows", "4096"], "prefill_chunk_rows"),
        (["--max-sessions", "0"], "max_sessions"),
        (["--max-position", "-1"], "max_position"),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "draft_server", "serve", "--drafter", "checksum", "--metrics-port", "-1", *flags],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 2, (flags, p.stdout, p.stderr)
        assert word in p.stderr and "READY" not in p.stdout


def test_a_hung_engine_turns_health_red_and_clients_fall_back(server_factory):
    """predecessor.md §4 (1) "the server hangs in synchronize() holding the engine lock, and every
    later RPC times out" while /v1/status looked fine; §6 Server: a per-step watchdog and health
    that reflects whether the loop is alive.

    An engine iteration far over the watchdog (a 1.5 s draft batch, standing in for a hung
    kernel) turns /healthz red (503) and the watchdog counter up; meanwhile clients fall back
    within their budget; when the batch ends, health is green again and drafting resumes.
    """
    import urllib.error

    srv = server_factory("--checksum-delay-ms", "1500", "--watchdog-s", "0.3")
    c = client_for(srv.endpoint, budget_ms=50.0, breaker_failures=100)
    tr = Track("hung", np.random.default_rng(14))
    req, taps = tr.request(2)
    assert timed_step(c, [req], taps)[0].tokens == []  # the batch that hangs
    assert wait_for(lambda: srv.metrics()["draft_server_watchdog_fired_total"] == 1, timeout=5)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/healthz", timeout=5)
    assert err.value.code == 503 and json.loads(err.value.read())["healthy"] is False
    for _ in range(3):
        req, taps = tr.request(1)
        assert timed_step(c, [req], taps)[0].tokens == []  # fallback within budget, never a hang

    def green() -> bool:
        try:
            return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/healthz").read())["healthy"]
        except urllib.error.HTTPError:
            return False

    assert wait_for(green, timeout=15)
    c.close()
