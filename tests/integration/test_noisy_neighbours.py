"""Clients must not hurt each other, and every reply tells the truth (issue 11), through real
server processes. One test per finding of the issue, each of which failed before its fix."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import zmq

from draft_tools.synthetic import bf16_normal
from protocol import ErrorCode, Free, Phase, Sampling, Status, Step, StepEntry, encode
from tests.conftest import RawPeer, ServerProc, SessionMirror, random_taps, wait_for

K = 4


def _now_ms() -> float:
    return time.monotonic() * 1000.0


# 1 -------------------------------------------------------------------------------------------


def test_a_reply_names_the_context_it_drafted_from_after_the_server_lost_it() -> None:
    """After the idle TTL released a session, the next step restarts it at its position: the reply
    says so (start = that position) and its drafts are the checksum of exactly that context."""
    srv = ServerProc("--session-ttl-s", "0.5").start()
    rng = np.random.default_rng(1)
    a = RawPeer(srv.endpoint)
    try:
        mirror = SessionMirror()
        taps = random_taps(rng, 10)
        r = a.step([StepEntry("s", 0, 10, 7, K)], taps)
        mirror.apply(0, taps, None)
        assert r.results[0].status == Status.OK and r.results[0].start == 0 and r.results[0].end == 10
        assert list(r.results[0].drafts) == mirror.expect(7, K)
        assert wait_for(lambda: srv.metrics()['draft_server_session_evictions_total{reason="ttl"}'] == 1, 10)
        more = random_taps(rng, 3)
        r = a.step([StepEntry("s", 10, 3, 9, K)], more)
        mirror.apply(10, more, None)  # the server no longer knows [0, 10): a restart at 10
        res = r.results[0]
        assert res.status == Status.OK and (res.start, res.end) == (10, 13)
        assert list(res.drafts) == mirror.expect(9, K)
        assert srv.metrics()['draft_server_session_restarts_total{cause="ttl"}'] == 1
    finally:
        a.close()
        srv.stop()


def test_a_session_flood_does_not_evict_a_calm_clients_sessions() -> None:
    """Table of 8: a flood of 60 new sessions from one client recycles its own idle sessions; the
    calm client's idle sessions (within its fair share) stay, and its drafts stay exact."""
    srv = ServerProc("--max-sessions", "8").start()
    rng = np.random.default_rng(2)
    calm, flood = RawPeer(srv.endpoint), RawPeer(srv.endpoint)
    try:
        mirrors = {sid: SessionMirror() for sid in ("c0", "c1")}
        for sid, m in mirrors.items():
            taps = random_taps(rng, 5)
            r = calm.step([StepEntry(sid, 0, 5, 1, K)], taps)
            m.apply(0, taps, None)
            assert r.results[0].status == Status.OK
        for i in range(0, 60, 6):
            flood.step([StepEntry(f"f{j}", 0, 2, 1, K) for j in range(i, i + 6)], random_taps(rng, 12))
        for sid, m in mirrors.items():
            taps = random_taps(rng, 2)
            r = calm.step([StepEntry(sid, 5, 2, 3, K)], taps)
            m.apply(5, taps, 5)
            res = r.results[0]
            assert res.status == Status.OK and res.start == 0, res
            assert list(res.drafts) == m.expect(3, K)
        assert srv.metrics()['draft_server_session_restarts_total{cause="evicted"}'] == 0
    finally:
        calm.close()
        flood.close()
        srv.stop()


# 2 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["dense", "paged"])
def test_nan_taps_of_one_client_never_reach_another_clients_drafts(tmp_path, attention: str) -> None:
    """A tiny DSpark model (the dense path, and the fast path's paged kernels and device staging):
    a client whose taps hold NaN/Inf shares batches with a calm client; the calm client's drafts
    equal the in-process dense drafts made without the poisoned client (float32: the paths agree)."""
    from draft_server.drafters import DraftItem, IngestItem
    from draft_server.models import load_drafter
    from draft_server.models.tiny import make_tiny
    from protocol import GREEDY

    p = make_tiny("k3", str(tmp_path / "k3"), seed=4)
    srv = ServerProc(
        "--model", p.draft, "--target-model", p.target, "--device", "cpu", "--dtype", "float32",
        "--attention", attention, "--batch-window-ms", "30", drafter="dspark",
    ).start(timeout=120)  # fmt: skip
    rng = np.random.default_rng(3)
    W = 3 * 64  # the tiny k3 contract: 3 taps x 64
    bad, calm = RawPeer(srv.endpoint), RawPeer(srv.endpoint)
    try:
        poison = bf16_normal(rng, (40, W))
        poison[::2, ::3] = 0x7FC0  # NaN
        poison[1::2, ::5] = 0x7F80  # +Inf
        clean = [bf16_normal(rng, (n, W)) for n in (9, 17)]
        bad.step([StepEntry("x", 0, 40, 1, 0)], poison)  # the poisoned context is in place first
        # both clients in one batch (batch window): the poisoned session drafts beside the calm ones
        bad.step([StepEntry("x", 40, 0, 2, 7)], None, wait=False)
        r = calm.step([StepEntry("a", 0, 9, 5, 7), StepEntry("b", 0, 17, 6, 7)], np.concatenate(clean))
        assert srv.metrics()["draft_server_nonfinite_tap_rows_total"] == 40  # every poisoned row, sampled
        local = load_drafter(p.draft, p.target, "cpu", "float32", attention="dense")
        for key, t in enumerate(clean):
            assert local.reserve(key, 0, len(t) + 8)
            local.ingest([IngestItem(key, 0, 0, t)])
        want = local.draft([DraftItem(k, 0, len(t), 5 + k, 7, GREEDY) for k, t in enumerate(clean)])
        assert [list(x.drafts) for x in r.results] == [o.tokens for o in want]
        assert all(len(set(o.tokens)) > 1 or o.tokens[0] != 0 for o in want)  # real drafts, not NaN's argmax
    finally:
        bad.close()
        calm.close()
        srv.stop()


# 3 -------------------------------------------------------------------------------------------


def test_a_row_flood_is_that_clients_overload_not_another_clients() -> None:
    """A client that queues rows past its share of the queue is answered overloaded; a calm client
    stepping meanwhile is never answered overloaded and always drafts exactly."""
    srv = ServerProc("--max-queue-rows", "4000", "--checksum-delay-ms", "30").start()
    rng = np.random.default_rng(5)
    calm, flood = RawPeer(srv.endpoint), RawPeer(srv.endpoint)
    try:
        mirror = SessionMirror()
        taps = random_taps(rng, 3)
        assert calm.step([StepEntry("c", 0, 3, 2, K)], taps).results[0].status == Status.OK
        mirror.apply(0, taps, None)
        end = 3
        flood_taps = random_taps(rng, 500)
        for i in range(24):  # 12,000 rows queued without waiting: the whole 4,000-row queue and more
            flood.step([StepEntry(f"f{i}", 0, 500, 1, K)], flood_taps, wait=False)
        for _ in range(10):
            taps = random_taps(rng, 3)
            r = calm.step([StepEntry("c", end, 3, 2, K)], taps, timeout_ms=20000)
            mirror.apply(end, taps, end)
            end += 3
            assert r.results[0].status == Status.OK, r.results[0]
            assert list(r.results[0].drafts) == mirror.expect(2, K)
        statuses = []
        while (rep := flood.recv(3000)) is not None:
            statuses += [x.status for x in rep.results]
        assert Status.OVERLOADED in statuses and Status.OK in statuses
    finally:
        calm.close()
        flood.close()
        srv.stop()


# 4 -------------------------------------------------------------------------------------------


def test_a_second_connection_with_a_live_routing_id_cannot_touch_the_first_ones_sessions() -> None:
    srv = ServerProc().start()
    rng = np.random.default_rng(6)
    ident = uuid.uuid4().bytes
    ctx = zmq.Context.instance()
    owner = RawPeer(srv.endpoint)
    owner.sock.close(0)
    owner.sock = ctx.socket(zmq.DEALER)
    owner.sock.setsockopt(zmq.LINGER, 0)
    owner.sock.setsockopt(zmq.IDENTITY, ident)
    owner.sock.connect(srv.endpoint)
    thief = RawPeer(srv.endpoint)
    thief.sock.close(0)
    thief.sock = ctx.socket(zmq.DEALER)
    thief.sock.setsockopt(zmq.LINGER, 0)
    thief.sock.setsockopt(zmq.IDENTITY, ident)
    try:
        mirror = SessionMirror()
        taps = random_taps(rng, 6)
        r = owner.step([StepEntry("s", 0, 6, 1, K)], taps)
        mirror.apply(0, taps, None)
        assert r.results[0].status == Status.OK
        thief.sock.connect(srv.endpoint)
        time.sleep(0.3)
        thief.send(Free(("s",)))
        assert thief.step([StepEntry("s", 0, 6, 1, K)], random_taps(rng, 6), timeout_ms=1500) is None  # refused
        more = random_taps(rng, 2)
        r = owner.step([StepEntry("s", 6, 2, 4, K)], more)
        mirror.apply(6, more, 6)
        assert r.results[0].status == Status.OK and r.results[0].start == 0
        assert list(r.results[0].drafts) == mirror.expect(4, K)
        assert srv.metrics()['draft_server_session_evictions_total{reason="free"}'] == 0
    finally:
        owner.close()
        thief.close()
        srv.stop()


# 5 -------------------------------------------------------------------------------------------


def test_ingest_only_rows_are_not_acknowledged_when_their_session_cannot_be_made() -> None:
    """max_sessions 1, held by a client within its share: another client's ingest-only entry for a
    new session is answered overloaded (it used to be acknowledged ok, then silently dropped)."""
    srv = ServerProc("--max-sessions", "1").start()
    rng = np.random.default_rng(7)
    a, b = RawPeer(srv.endpoint), RawPeer(srv.endpoint)
    try:
        assert a.step([StepEntry("a", 0, 4, 1, K)], random_taps(rng, 4)).results[0].status == Status.OK
        r = b.step([StepEntry("b", 0, 4, 1, 0)], random_taps(rng, 4))
        assert r.results[0].status == Status.OVERLOADED, r.results[0]
        assert wait_for(lambda: srv.metrics()["draft_server_queue_rows"] == 0, 5)
    finally:
        a.close()
        b.close()
        srv.stop()


# 6 -------------------------------------------------------------------------------------------


def _prompted(c: RawPeer, rng: np.random.Generator) -> SessionMirror:
    """Session "s" holds a 4-row prompt, sent 5 times with the sender's clock so the connection's
    fastest delivery is learned (a later Step's lateness is measured against it)."""
    mirror = SessionMirror()
    prompt = random_taps(rng, 4)
    for _ in range(5):
        r = c.step([StepEntry("s", 0, 4, 1, K)], prompt, budget_ms=200, sent_ms=_now_ms())
        assert r is not None and r.results[0].status == Status.OK
    mirror.apply(0, prompt, None)
    return mirror


def test_steps_queued_during_a_pause_expire_unread_and_their_rows_still_commit() -> None:
    srv = ServerProc().start()
    rng = np.random.default_rng(8)
    c = RawPeer(srv.endpoint)
    try:
        mirror = _prompted(c, rng)
        srv.pause()
        late = [random_taps(rng, 2) for _ in range(3)]
        for i, t in enumerate(late):  # the caller gives up on each after its 50 ms budget
            c.step([StepEntry("s", 4 + 2 * i, 2, 1, K)], t, budget_ms=50, sent_ms=_now_ms(), wait=False)
            mirror.apply(4 + 2 * i, t, 4 + 2 * i)
            time.sleep(0.25)
        srv.resume()
        got = [c.recv(5000) for _ in late]
        seen = [(g.call_id, g.results[0].status, g.results[0].message) for g in got if g]
        assert all(g is not None and g.results[0].status == Status.EXPIRED for g in got), seen
        assert all("late" in g.results[0].message for g in got)
        assert srv.metrics()['draft_server_stale_steps_total{why="unread"}'] == 3
        r = c.step([StepEntry("s", 10, 0, 3, K)], None, sent_ms=_now_ms())  # the late rows are in
        assert r.results[0].status == Status.OK and list(r.results[0].drafts) == mirror.expect(3, K)
    finally:
        c.close()
        srv.stop()


def test_a_newer_step_supersedes_a_sessions_queued_drafting() -> None:
    """While the engine is busy (a slow draft batch), two steps for one session queue up: the
    older one's drafting is answered expired (superseded), the newer one drafts."""
    srv = ServerProc("--checksum-delay-ms", "400").start()
    rng = np.random.default_rng(9)
    c, other = RawPeer(srv.endpoint), RawPeer(srv.endpoint)
    try:
        c.step([StepEntry("s", 0, 4, 1, K)], random_taps(rng, 4))
        other.step([StepEntry("o", 0, 1, 1, K)], random_taps(rng, 1), wait=False)  # the engine sleeps 400 ms
        time.sleep(0.1)
        c.step([StepEntry("s", 4, 1, 1, K)], random_taps(rng, 1), wait=False)
        first = c.call_id
        c.step([StepEntry("s", 5, 1, 2, K)], random_taps(rng, 1), wait=False)
        replies = {r.call_id: r for r in (c.recv(5000), c.recv(5000)) if r is not None}
        assert replies[first].results[0].status == Status.EXPIRED
        assert "superseded" in replies[first].results[0].message
        assert replies[first + 1].results[0].status == Status.OK
        assert srv.metrics()['draft_server_stale_steps_total{why="superseded"}'] == 1
    finally:
        c.close()
        other.close()
        srv.stop()


# 7 -------------------------------------------------------------------------------------------


def test_draft_probabilities_reach_the_client_through_the_real_server(tmp_path) -> None:
    from draft_server.models.tiny import make_tiny
    from target_client import ClientConfig, DraftClient, StepRequest

    p = make_tiny("qwen3", str(tmp_path / "q"), seed=5)
    srv = ServerProc(
        "--model", p.draft, "--target-model", p.target, "--device", "cpu", "--dtype", "float32", drafter="dspark"
    ).start(timeout=120)  # fmt: skip
    client = DraftClient(ClientConfig(endpoint=srv.endpoint, budget_ms=5000.0))
    try:
        w = client.connect(wait=True)
        assert w is not None
        taps = bf16_normal(np.random.default_rng(10), (12, w.contract.tap_width))
        sampling = Sampling(temperature=0.8, seed=3, return_probs=3)
        (rep,) = client.step([StepRequest("s", 0, 12, 4, 5, sampling)], taps)
        assert rep.status == Status.OK and len(rep.tokens) == 5
        assert rep.probs is not None and rep.probs.shape == (5, 3) and rep.prob_ids is not None
        assert np.all(rep.probs >= 0) and np.all(rep.probs.sum(-1) <= 1.0 + 1e-5)
        assert np.all(np.diff(rep.probs, axis=-1) <= 0)  # top-n, descending
    finally:
        client.close()
        srv.stop()


# 8 -------------------------------------------------------------------------------------------


def test_every_step_is_answered_exactly_once() -> None:
    """Ingest-only and drafting entries mixed, many steps in flight: one reply per call id."""
    srv = ServerProc().start()
    rng = np.random.default_rng(11)
    c = RawPeer(srv.endpoint)
    try:
        for i in range(200):
            entries = [StepEntry(f"s{j}", i, 1, 1, (i + j) % 2 * K) for j in range(3)]
            c.step(entries, random_taps(rng, 3), wait=False)
        seen: dict[int, int] = {}
        while (rep := c.recv(2000)) is not None:
            seen[rep.call_id] = seen.get(rep.call_id, 0) + 1
        assert sorted(seen) == list(range(1, 201)) and set(seen.values()) == {1}
    finally:
        c.close()
        srv.stop()


# 9 -------------------------------------------------------------------------------------------


def test_invalid_utf8_in_a_session_id_gets_an_error_naming_the_call() -> None:
    srv = ServerProc().start()
    c = RawPeer(srv.endpoint)
    try:
        header = encode(Step(77, 100.0, (StepEntry("AAAA", 0, 0, 1, 0),), None))[0]
        raw = bytes(header).replace(b"AAAA", b"A\xff\xfeA")
        c.send_raw([raw])
        err = c.recv(5000)
        assert err is not None and err.call_id == 77 and err.code == ErrorCode.BAD_MESSAGE
    finally:
        c.close()
        srv.stop()


def test_the_message_cap_follows_the_largest_valid_step_and_a_refusal_is_answered_and_counted() -> None:
    """The default cap is the largest valid Step (tap width x max_rows_per_step and the entries'
    header), not 2 GiB; a message over it gets a TOO_LARGE error naming its call, and a metric."""
    srv = ServerProc("--max-rows-per-step", "64", "--max-entries-per-step", "8").start()
    c = RawPeer(srv.endpoint)
    try:
        from protocol import PROTOCOL_VERSION, Hello

        c.send(Hello(PROTOCOL_VERSION, "t", 1))
        w = c.recv(5000)
        assert w.limits.max_message_bytes == 64 * 128 * 2 + 8 * (256 + 64) + (64 << 10)
        big = np.zeros((4 * 64, 64), np.uint16)  # 4x the rows a step may carry, in bytes
        header = encode(Step(9, 100.0, (StepEntry("s", 0, 256, 1, 0),), None))[0]
        c.send_raw([bytes(header), big.tobytes() * 2])
        err = c.recv(5000)
        assert err is not None and err.call_id == 9 and err.code == ErrorCode.TOO_LARGE
        assert srv.metrics()['draft_server_bad_messages_total{code="too_large"}'] == 1
    finally:
        c.close()
        srv.stop()


def test_an_early_span_read_late_and_overtaken_is_refused_not_acknowledged() -> None:
    """An early-taps span read past its budget (its ``sent_ms`` long before this connection's
    fastest delivery) for a session that already took a newer call is not applied. The engine says
    so: MISSING_ROWS. The router used to answer every entry of such a Step EXPIRED at once ("rows
    applied"), before the engine refused the rows, so the client dropped rows the server never
    held. The commit then drafts from the newer span."""
    srv = ServerProc().start()
    rng = np.random.default_rng(10)
    c = RawPeer(srv.endpoint)
    try:
        mirror = _prompted(c, rng)
        c.call_id = 100
        span = random_taps(rng, 3)
        r = c.step([StepEntry("s", 4, 3, 1, 0, phase=Phase.TAPS)], span, sent_ms=_now_ms())  # call 101
        mirror.apply(4, span, 4)
        assert r.results[0].status == Status.OK
        c.call_id = 50  # an older call of the connection, held back on the way and read late
        stale = random_taps(rng, 3)
        r = c.step([StepEntry("s", 4, 3, 1, 0, phase=Phase.TAPS)], stale, budget_ms=50, sent_ms=_now_ms() - 5000)
        assert r.results[0].status == Status.MISSING_ROWS, r.results[0]
        m = srv.metrics()
        assert m['draft_server_stale_steps_total{why="unread"}'] == 1
        assert m['draft_server_stale_steps_total{why="reordered"}'] == 1
        c.call_id = 101
        r = c.step([StepEntry("s", 7, 0, 3, K, phase=Phase.COMMIT, after=101)], None, sent_ms=_now_ms())
        assert r.results[0].status == Status.OK and list(r.results[0].drafts) == mirror.expect(3, K)
    finally:
        c.close()
        srv.stop()
