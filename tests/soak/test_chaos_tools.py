"""The fault injectors of draft-soak: the chaos proxy and the rogue clients, against a real server.

The proxy must keep each client's identity (the server keys sessions by it), drop exactly what
it is told to in each direction and log it; the fuzz stream must be seeded and varied; the
rogue clients (fuzz burst, oversized frames, vanish, flood) must leave the server serving
exact drafts, with vanished sessions reclaimed by the TTL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from draft_tools.chaos.proxy import ChaosProxy, ProxyConfig
from draft_tools.chaos.rogue import flood as flood_rogue
from draft_tools.chaos.rogue import fuzz_messages, malformed_burst, oversized, vanish
from protocol import Pong, Status, StepEntry, StepResult
from tests.conftest import CHECKSUM_CONTRACT, RawPeer, SessionMirror, free_port, random_taps, wait_for

W = CHECKSUM_CONTRACT.tap_width


@pytest.fixture
def proxy(server) -> Iterator[ChaosProxy]:
    p = ChaosProxy(ProxyConfig(frontend=f"tcp://127.0.0.1:{free_port()}", backend=server.endpoint, seed=1))
    t = threading.Thread(target=p.run, daemon=True)
    t.start()
    yield p
    p.stop()
    t.join(5)


def test_proxy_keeps_client_identities_and_forwards_replies(server, proxy):
    a, b = RawPeer(proxy.cfg.frontend), RawPeer(proxy.cfg.frontend)
    rng = np.random.default_rng(0)
    for peer in (a, b):  # the same session name from two clients: two sessions on the server
        m = SessionMirror()
        taps = random_taps(rng, 5)
        r = peer.step([StepEntry("same", 0, 5, 9, 3)], taps)
        m.apply(0, taps, None)
        assert isinstance(r, StepResult) and list(r.results[0].drafts) == m.expect(9, 3)
    assert server.metrics()["draft_server_sessions"] == 2
    assert proxy.stats.forwarded_requests == 2 and proxy.stats.forwarded_replies == 2
    a.close()
    b.close()


def test_proxy_drops_requests_and_replies_as_told_and_logs_them(server, proxy):
    peer = RawPeer(proxy.cfg.frontend)
    from protocol import Ping

    proxy.cfg.drop_request_p = 1.0
    peer.send(Ping(1))
    assert peer.recv(300) is None
    proxy.cfg.drop_request_p, proxy.cfg.drop_reply_p = 0.0, 1.0
    peer.send(Ping(2))
    assert peer.recv(300) is None
    assert wait_for(lambda: server.metrics()['draft_server_messages_total{kind="ping"}'] == 1)  # it got there
    assert wait_for(lambda: proxy.stats.dropped_replies == 1)  # and its reply was dropped before dropping stops
    proxy.cfg.drop_reply_p = 0.0
    peer.send(Ping(3))
    r = peer.recv()
    assert isinstance(r, Pong) and r.call_id == 3
    s = proxy.stats
    assert (s.dropped_requests, s.dropped_replies) == (1, 1)
    assert [e[1] for e in s.events] == ["drop_request", "drop_reply"]
    assert all(e[2] == s.events[0][2] for e in s.events)  # logged with the client's routing id
    peer.close()


def test_proxy_delays_steps_only():
    backend_port = free_port()
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{backend_port}")
    p = ChaosProxy(
        ProxyConfig(
            frontend=f"tcp://127.0.0.1:{free_port()}",
            backend=f"tcp://127.0.0.1:{backend_port}",
            delay_p=1.0,
            delay_ms=150.0,
        )
    )
    t = threading.Thread(target=p.run, daemon=True)
    t.start()
    peer = RawPeer(p.cfg.frontend)
    try:
        from protocol import Ping, Step, encode

        peer.send(Ping(1))
        assert router.poll(2000)
        assert router.recv_multipart()[1] == encode(Ping(1))[0]  # a Ping is not held back
        t0 = time.monotonic()
        peer.send(Step(2, 50.0, (), None))
        assert router.poll(5000)
        router.recv_multipart()
        assert time.monotonic() - t0 >= 0.14  # the Step was held for delay_ms
        assert p.stats.delayed_requests == 1
    finally:
        peer.close()
        p.stop()
        t.join(5)
        router.close(0)
        ctx.term()


def test_fuzz_stream_is_seeded_and_varied():
    a = [m for m, _ in zip(fuzz_messages(5, W), range(300), strict=False)]
    b = [m for m, _ in zip(fuzz_messages(5, W), range(300), strict=False)]
    c = [m for m, _ in zip(fuzz_messages(6, W), range(300), strict=False)]
    assert a == b and a != c
    assert len({len(m) for m in a}) >= 3  # frame counts vary
    assert any(m and 0x83 <= m[0][0] <= 0x8F and b"step" in m[0][:16] for m in a)  # a msgpack map: Step headers


def test_rogues_leave_the_server_serving_exactly(server_factory):
    srv = server_factory("--session-ttl-s", "1", "--max-sessions", "32", "--max-message-mib", "1")
    burst = malformed_burst(srv.endpoint, 500, seed=3, width=W)
    assert burst["sent"] == 500
    peer = RawPeer(srv.endpoint)
    from protocol import Hello

    peer.send(Hello(1, "t", 1))
    welcome = peer.recv()
    big = oversized(srv.endpoint, 1 << 20, welcome.limits, W)
    assert big["oversized_sent"] == 1 and big["too_large_errors"] >= 1
    v = vanish(srv.endpoint, 6)
    assert v == {"sessions": 6, "ok": 6}
    f = flood_rogue(srv.endpoint, 40)
    assert f["sessions"] == 40 and f["ok"] + f["overloaded"] == 40 and f["overloaded"] >= 8
    m = SessionMirror()
    taps = random_taps(np.random.default_rng(4), 4)
    r = peer.step([StepEntry("clean", 0, 4, 2, 3)], taps)
    m.apply(0, taps, None)
    assert r.results[0].status == Status.OK and list(r.results[0].drafts) == m.expect(2, 3)
    assert srv.proc is not None and srv.proc.poll() is None
    peer.send(__import__("protocol").Free(("clean",)))
    assert wait_for(lambda: srv.metrics()["draft_server_sessions"] == 0)  # vanished ones: by TTL
    met = srv.metrics()
    assert met["draft_server_io_errors_total"] == 0 and met["draft_server_engine_errors_total"] == 0
    peer.close()


@pytest.mark.timeout(60)
def test_proxy_relays_direct_links_with_the_same_faults(server, proxy):
    """A client on shm through the proxy gets its direct link through the proxy too: steps relayed
    exactly, dropped and delayed on the link as over ZeroMQ, and drafting back once the faults stop."""
    from protocol import direct
    from target_client import ClientConfig, DraftClient
    from tests.integration.test_transports import Sessions

    if not direct.available():
        pytest.skip("direct links need Linux's abstract Unix sockets")
    c = DraftClient(ClientConfig(endpoint=proxy.cfg.frontend, budget_ms=300.0, transport="shm", shm_ring_mib=1))
    try:
        c.connect(wait=True)
        assert c.welcome.direct == proxy._name and c.stats()["direct_link"]  # type: ignore[union-attr]
        s = Sessions(c, "p", 2, 1)
        for _ in range(5):
            assert s.check(s.step()) == 2
        relayed = proxy.stats.forwarded_requests
        assert c.stats()["direct_sent"] >= 5 and relayed >= 5  # the link's steps went through the proxy
        proxy.cfg.drop_request_p = 1.0
        assert s.check(s.step()) == 0  # dropped on the link: no drafts within the budget
        assert proxy.stats.events[-1][1] == "drop_request"
        proxy.cfg.drop_request_p, proxy.cfg.delay_p, proxy.cfg.delay_ms = 0.0, 1.0, 100.0
        t0 = time.monotonic()
        assert s.check(s.step()) == 2 and time.monotonic() - t0 >= 0.09  # delayed on the link, then served
        proxy.cfg.delay_p = 0.0
        assert wait_for(lambda: s.check(s.step()) == 2)
        assert c.stats()["direct_link"]
    finally:
        c.close()
