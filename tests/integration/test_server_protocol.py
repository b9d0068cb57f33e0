"""The server over a real socket, message by message: handshake, positions, bad input, limits.

Uses a bare DEALER (no DraftClient) so every byte on the wire is the test's choice.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from protocol import (
    PROTOCOL_VERSION,
    DType,
    Error,
    ErrorCode,
    Free,
    Hello,
    Ping,
    Pong,
    Sampling,
    Status,
    Step,
    StepEntry,
    StepResult,
    TensorSpec,
    Welcome,
    encode,
)
from tests.conftest import CHECKSUM_CONTRACT, RawPeer, SessionMirror, random_taps

W = CHECKSUM_CONTRACT.tap_width


@pytest.fixture
def peer(server):
    p = RawPeer(server.endpoint)
    yield p
    p.close()


def test_hello_welcome_and_contract_mismatch(server, peer):
    peer.send(Hello(PROTOCOL_VERSION, "t", call_id=1))
    w = peer.recv()
    assert isinstance(w, Welcome) and w.call_id == 1
    assert w.contract == CHECKSUM_CONTRACT and w.epoch == server.epoch
    assert w.contract_id == CHECKSUM_CONTRACT.fingerprint()
    wrong = CHECKSUM_CONTRACT.__class__(**{**_fields(CHECKSUM_CONTRACT), "target_hidden_size": 128})
    peer.send(Hello(PROTOCOL_VERSION, "t", call_id=2, expect=wrong))
    e = peer.recv()
    assert isinstance(e, Error) and e.code == ErrorCode.CONTRACT_MISMATCH and e.call_id == 2
    assert "target_hidden_size" in e.message
    peer.send(Hello(PROTOCOL_VERSION + 1, "t", call_id=3))
    e = peer.recv()
    assert isinstance(e, Error) and e.code == ErrorCode.UNSUPPORTED_VERSION


def _fields(c):
    return {f: getattr(c, f) for f in c.__struct_fields__}


def test_positions_append_overwrite_gap_restart(peer):
    rng = np.random.default_rng(0)
    m = SessionMirror()

    def step(pos, rows, anchor, k=4):
        taps = random_taps(rng, rows) if rows else None
        r = peer.step([StepEntry("s", pos, rows, anchor, k)], taps)
        assert isinstance(r, StepResult), r
        res = r.results[0]
        assert res.status == Status.OK, res
        if taps is not None:
            m.apply(pos, taps, known_end=res.end if m.rows else None)
        assert res.end == pos + rows
        assert list(res.drafts) == m.expect(anchor, k)

    step(0, 10, 5)  # new session
    step(10, 3, 6)  # append
    step(11, 4, 7)  # overwrite after a rejected block
    step(15, 2, 8)  # append again
    step(30, 2, 9)  # gap: restart at 30
    step(30, 1, 9)  # overwrite at the very start
    step(5, 3, 1)  # before start: restart at 5


def test_k0_then_drafting_and_prefill_chunks(server_factory):
    srv = server_factory("--prefill-chunk-rows", "64", "--max-batch-rows", "256")
    peer = RawPeer(srv.endpoint)
    rng = np.random.default_rng(1)
    m = SessionMirror()
    taps = random_taps(rng, 1000)
    r = peer.step([StepEntry("p", 0, 1000, 3, 0)], taps)  # prefill, ingest only
    assert r.results[0].status == Status.OK and r.results[0].drafts == () and r.results[0].end == 1000
    m.apply(0, taps, None)
    taps2 = random_taps(rng, 1)
    r = peer.step([StepEntry("p", 1000, 1, 11, 8)], taps2)
    m.apply(1000, taps2, 1000)
    assert r.results[0].status == Status.OK
    assert list(r.results[0].drafts) == m.expect(11, 8)
    met = srv.metrics()
    assert met["draft_server_prefill_chunks_total"] >= 1000 // 64
    peer.close()


def test_bad_entries_are_scoped_to_the_entry(peer):
    rng = np.random.default_rng(2)
    entries = [
        StepEntry("good", 0, 2, 1, 3),
        StepEntry("neg", -5, 1, 1, 3),
        StepEntry("bigk", 0, 1, 1, 9),
        StepEntry("anchor", 0, 1, 10**9, 3),
        StepEntry("", 0, 1, 1, 3),
        StepEntry("temp", 0, 1, 1, 3, Sampling(temperature=-1.0)),
        StepEntry("good", 2, 1, 1, 3),  # duplicate session in one step
        StepEntry("huge", 2**40, 0, 1, 1),
    ]
    taps = random_taps(rng, sum(e.rows for e in entries))
    r = peer.step(entries, taps)
    st = [x.status for x in r.results]
    assert st[0] == Status.OK and len(r.results[0].drafts) == 3
    assert all(s == Status.BAD_ENTRY for s in st[1:])
    assert "negative position" in r.results[1].message
    assert "k=9" in r.results[2].message
    assert "anchor" in r.results[3].message
    assert "twice" in r.results[6].message
    assert "max_position" in r.results[7].message


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("budget0", ErrorCode.BAD_MESSAGE),
        ("budgetneg", ErrorCode.BAD_MESSAGE),
        ("budgetnan", ErrorCode.BAD_MESSAGE),
        ("dtype", ErrorCode.BAD_FRAMES),
        ("rows", ErrorCode.BAD_FRAMES),
        ("missing", ErrorCode.BAD_FRAMES),
        ("extra", ErrorCode.BAD_FRAMES),
        ("short", ErrorCode.BAD_FRAMES),
        ("kind", ErrorCode.UNKNOWN_KIND),
        ("types", ErrorCode.BAD_MESSAGE),
    ],
)
def test_malformed_steps_get_typed_errors(peer, case, code):
    taps = np.zeros((2, W), np.uint16)
    e = (StepEntry("a", 0, 2, 1, 2),)
    good = TensorSpec(DType.BF16, (2, W), 0)
    msg, payloads = Step(7, 50.0, e, good), [taps]
    if case == "budget0":
        msg = Step(7, 0.0, e, good)
    elif case == "budgetneg":
        msg = Step(7, -3.0, e, good)
    elif case == "budgetnan":
        msg = Step(7, float("nan"), e, good)
    elif case == "dtype":
        msg = Step(7, 50.0, e, TensorSpec(DType.F32, (2, W), 0))
    elif case == "rows":
        msg = Step(7, 50.0, e, TensorSpec(DType.BF16, (3, W), 0))
    elif case == "missing":
        payloads = []
    elif case == "extra":
        payloads = [taps, taps]
    elif case == "short":
        payloads = [taps[:1]]
    if case == "kind":
        peer.send_raw([b"\x82\xa4kind\xa5hello\xa7call_id\x07"[:0] + b"\x82\xa4kind\xa4nope\xa7call_id\x07"])
    elif case == "types":
        peer.send_raw([b"\x83\xa4kind\xa4step\xa7call_id\x07\xa9budget_ms\xa3abc"])
    else:
        peer.send(msg, payloads)
    r = peer.recv()
    assert isinstance(r, Error), r
    assert r.code == code and r.call_id == 7, r


def test_garbage_is_dropped_and_counted_and_others_keep_working(server, peer):
    for junk in [b"", b"\xff\xfe", b"not msgpack at all", b"\x93\x01\x02\x03"]:
        peer.send_raw([junk])
    assert peer.recv(300) is None  # nothing to answer to
    met = server.metrics()
    assert met["draft_server_dropped_messages_total"] >= 4
    r = peer.step([StepEntry("x", 0, 1, 1, 2)], random_taps(np.random.default_rng(3), 1))
    assert r.results[0].status == Status.OK


def test_ping_free_and_ttl(server_factory):
    srv = server_factory("--session-ttl-s", "0.5")
    peer = RawPeer(srv.endpoint)
    rng = np.random.default_rng(4)
    peer.send(Ping(99))
    p = peer.recv()
    assert isinstance(p, Pong) and p.call_id == 99 and p.healthy and p.epoch == srv.epoch
    for sid in ["a", "b", "c"]:
        assert peer.step([StepEntry(sid, 0, 2, 1, 1)], random_taps(rng, 2)).results[0].status == Status.OK
    assert srv.metrics()["draft_server_sessions"] == 3
    peer.send(Free(("a", "b")))
    deadline = time.monotonic() + 5
    while srv.metrics()["draft_server_sessions"] != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.metrics()["draft_server_sessions"] == 1
    while srv.metrics()["draft_server_sessions"] != 0 and time.monotonic() < deadline + 5:
        time.sleep(0.1)
    met = srv.metrics()
    assert met["draft_server_sessions"] == 0
    assert met['draft_server_session_evictions_total{reason="free"}'] == 2
    assert met['draft_server_session_evictions_total{reason="ttl"}'] == 1
    peer.close()


def test_sessions_are_per_client_identity(server):
    a, b = RawPeer(server.endpoint), RawPeer(server.endpoint)
    rng = np.random.default_rng(5)
    ma, mb = SessionMirror(), SessionMirror()
    ta, tb = random_taps(rng, 4), random_taps(rng, 4)
    ra = a.step([StepEntry("same", 0, 4, 1, 3)], ta)
    rb = b.step([StepEntry("same", 0, 4, 1, 3)], tb)
    ma.apply(0, ta, None)
    mb.apply(0, tb, None)
    assert list(ra.results[0].drafts) == ma.expect(1, 3)
    assert list(rb.results[0].drafts) == mb.expect(1, 3)
    b.send(Free(("same",)))
    time.sleep(0.1)
    t = random_taps(rng, 1)
    ra = a.step([StepEntry("same", 4, 1, 2, 3)], t)
    ma.apply(4, t, 4)
    assert list(ra.results[0].drafts) == ma.expect(2, 3)  # b's free did not touch a's session
    a.close()
    b.close()


def test_queue_bound_answers_overloaded_per_entry(server_factory):
    srv = server_factory("--max-queue-rows", "100", "--checksum-delay-ms", "300")
    peer = RawPeer(srv.endpoint)
    rng = np.random.default_rng(6)
    # first call occupies the engine (300 ms draft); the second is partly over the queue bound
    peer.call_id = 100
    peer.send(Step(1, 5000.0, (StepEntry("a", 0, 1, 1, 1),), TensorSpec(DType.BF16, (1, W), 0)), [random_taps(rng, 1)])
    time.sleep(0.05)
    entries = [StepEntry("b", 0, 60, 1, 1), StepEntry("c", 0, 60, 1, 1)]
    r = peer.step(entries, random_taps(rng, 120))
    assert r.results[0].status == Status.OK
    assert r.results[1].status == Status.OVERLOADED and r.results[1].retry_after_ms > 0
    peer.close()


def test_session_capacity_evicts_idle_lru_then_overloads(server_factory):
    srv = server_factory("--max-sessions", "2")
    peer = RawPeer(srv.endpoint)
    rng = np.random.default_rng(7)
    for sid in ["a", "b", "c"]:  # c evicts a (idle, least recently used)
        assert peer.step([StepEntry(sid, 0, 1, 1, 1)], random_taps(rng, 1)).results[0].status == Status.OK
    met = srv.metrics()
    assert met["draft_server_sessions"] == 2
    assert met['draft_server_session_evictions_total{reason="lru"}'] == 1
    peer.close()


def test_oversized_message_refused_at_socket_server_survives(server_factory):
    srv = server_factory("--max-message-mib", "1")
    bad = RawPeer(srv.endpoint)
    bad.send_raw([encode(Ping(1))[0], b"\0" * (3 << 20)])
    assert bad.recv(500) is None  # over twice the cap: the socket drops it (and the connection)
    good = RawPeer(srv.endpoint)
    r = good.step([StepEntry("x", 0, 1, 1, 2)], random_taps(np.random.default_rng(8), 1))
    assert r.results[0].status == Status.OK
    bad.close()
    good.close()


def test_expired_budget_keeps_rows(server_factory):
    srv = server_factory("--checksum-delay-ms", "200")
    peer = RawPeer(srv.endpoint)
    rng = np.random.default_rng(9)
    m = SessionMirror()
    t0 = random_taps(rng, 3)
    assert peer.step([StepEntry("s", 0, 3, 1, 2)], t0).results[0].status == Status.OK
    m.apply(0, t0, None)
    # the engine is now slow; a 1 ms budget cannot be met: EXPIRED, but rows are kept
    peer.send(
        Step(50, 5000.0, (StepEntry("other", 0, 1, 1, 1),), TensorSpec(DType.BF16, (1, W), 0)), [random_taps(rng, 1)]
    )
    time.sleep(0.02)
    t1 = random_taps(rng, 2)
    r = peer.step([StepEntry("s", 3, 2, 4, 2)], t1, budget_ms=1.0)
    assert r.results[0].status == Status.EXPIRED and r.results[0].drafts == ()
    m.apply(3, t1, 3)
    r = peer.step([StepEntry("s", 5, 0, 6, 3)], None)
    assert r.results[0].status == Status.OK
    assert list(r.results[0].drafts) == m.expect(6, 3)  # proves rows 3,4 were ingested
    peer.close()
