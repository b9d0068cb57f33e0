"""Same-host direct links (``protocol.direct``) between real clients and a real server process.

Clients on transport shm are offered a Unix SOCK_SEQPACKET link in their Welcome and send their
header-only messages over it; these tests hold every draft to the checksum of the rows sent with
several clients at once (staggered, one on frames beside them), a link broken under a client, garbage
on a link, and a server killed and restarted.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from protocol import direct
from target_client import StepRequest
from tests.conftest import wait_for
from tests.integration.test_transports import Sessions, _client, ipc_server

pytestmark = pytest.mark.skipif(not direct.available(), reason="direct links need Linux's abstract Unix sockets")


def _stepping(s: Sessions, steps: int, errors: list[BaseException], start: threading.Event | None = None) -> None:
    try:
        if start is not None:
            assert start.wait(60)
        for i in range(steps):
            assert s.check(s.step()) == s.n, i
    except BaseException as e:  # reported by the main thread
        errors.append(e)


@pytest.mark.timeout(120)
def test_shm_clients_step_over_direct_links_beside_a_frames_client_with_staggered_arrivals(tmp_path) -> None:
    srv = ipc_server(tmp_path)
    a = _client(srv.endpoint, name="a", transport="shm", shm_ring_mib=4)
    b = _client(srv.endpoint, name="b", transport="shm", shm_ring_mib=4)
    f = _client(srv.endpoint, name="f")  # transport frames: offered no link
    try:
        assert a.welcome.direct and b.welcome.direct and a.welcome.direct_token != b.welcome.direct_token  # type: ignore[union-attr]
        assert not f.welcome.direct and not f.stats()["direct_link"]  # type: ignore[union-attr]
        assert wait_for(lambda: srv.metrics()["draft_server_direct_links"] == 2)
        sa, sb, sf = Sessions(a, "a", 4, 1, claim=True), Sessions(b, "b", 3, 2), Sessions(f, "f", 2, 3)
        errors: list[BaseException] = []
        late = threading.Event()  # b and f begin once a has stepped a while: arrivals staggered
        threads = [
            threading.Thread(target=_stepping, args=(sb, 60, errors, late)),
            threading.Thread(target=_stepping, args=(sf, 60, errors, late)),
        ]
        for t in threads:
            t.start()
        for i in range(80):
            assert sa.check(sa.step()) == 4, i
            if i == 20:
                late.set()
        for t in threads:
            t.join(60)
        assert not errors, errors
        sta, stb, stf = a.stats(), b.stats(), f.stats()
        # every step and its reply went over the link (Hello and Welcome over ZeroMQ)
        assert sta["direct_link"] and sta["direct_sent"] >= 80 and sta["direct_read"] >= 80, sta
        assert stb["direct_link"] and stb["direct_sent"] >= 60 and stb["direct_read"] >= 60, stb
        assert stf["direct_sent"] == stf["direct_read"] == 0
        met = srv.metrics()
        assert met["draft_server_sessions"] == 9
        assert not any(k.startswith("draft_server_bad_messages_total{") and v for k, v in met.items())
    finally:
        for c in (a, b, f):
            c.close()
        srv.kill()


@pytest.mark.timeout(120)
def test_a_broken_link_falls_back_to_zeromq_and_garbage_on_a_link_harms_nobody(tmp_path) -> None:
    srv = ipc_server(tmp_path)
    a = _client(srv.endpoint, name="a", transport="shm", shm_ring_mib=4)
    b = _client(srv.endpoint, name="b", transport="shm", shm_ring_mib=4)
    try:
        sa, sb = Sessions(a, "a", 3, 1), Sessions(b, "b", 3, 2)
        for _ in range(5):
            assert sa.check(sa.step()) == 3 and sb.check(sb.step()) == 3
        # garbage on b's link: undecodable, no call id: dropped and counted, nothing answered, b steps on
        b._io._link.send(b"\xc1 not msgpack")
        assert wait_for(lambda: srv.metrics()["draft_server_dropped_messages_total"] >= 1)
        for _ in range(5):
            assert sb.check(sb.step()) == 3 and sa.check(sa.step()) == 3
        assert b.stats()["direct_link"]
        # a's link broken under it: its next send or read finds it so, and ZeroMQ carries on
        a._io._link.shutdown()
        sent = a.stats()["direct_sent"]
        for i in range(20):
            replies = sa.step()
            assert sa.check(replies) == 3 or i == 0, i  # the step that meets the break may go unanswered
        st = a.stats()
        assert not st["direct_link"] and st["direct_sent"] <= sent + 1, st
        assert wait_for(lambda: srv.metrics()["draft_server_direct_links"] == 1)  # the server dropped it too
        for _ in range(5):
            assert sb.check(sb.step()) == 3  # b's link untouched
        assert b.stats()["direct_link"]
    finally:
        a.close()
        b.close()
        srv.kill()


@pytest.mark.timeout(120)
def test_a_killed_server_restarted_gives_a_new_link(tmp_path) -> None:
    srv = ipc_server(tmp_path)
    c = _client(srv.endpoint, name="c", transport="shm", shm_ring_mib=1, budget_ms=50.0)
    try:
        s = Sessions(c, "s", 3, 1, claim=True)
        for _ in range(5):
            assert s.check(s.step()) == 3
        first = c.welcome.direct  # type: ignore[union-attr]
        srv.kill()
        for _ in range(3):
            s.check(s.step())  # no server: empty drafts within the budget (the link read its end)
        srv.start()
        assert wait_for(lambda: s.check(s.step()) == 3, timeout=30)
        for _ in range(5):
            assert s.check(s.step()) == 3
        read = c.stats()["direct_read"]
        for _ in range(5):
            assert s.check(s.step()) == 3
        st = c.stats()
        assert st["direct_link"] and c.welcome.direct != first and st["direct_read"] >= read + 5, st  # type: ignore[union-attr]
    finally:
        c.close()
        srv.kill()


def test_only_the_token_a_welcome_gave_binds_a_link_and_only_once() -> None:
    from draft_server.io.direct import DirectLinks

    links = DirectLinks()
    try:
        name, token = links.offer(b"id-1", b"owner-1")
        wrong = direct.connect(name, b"x" * direct.TOKEN_BYTES)
        right = direct.connect(name, token)
        again = direct.connect(name, token)  # the same token a second time
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        silent.connect("\0" + name)
        assert wait_for(lambda: (links.housekeep() or True) and len(links.links) == 1)
        assert links.links[0].ident == b"id-1" and links.links[0].owner == b"owner-1"
        for s in (wrong.sock, again.sock):  # closed by the server: end of file
            s.settimeout(5)
            assert s.recv(16) == b""
        right.sock.settimeout(5)
        assert links.send(b"id-1", b"hello") and right.sock.recv(16) == b"hello"
        assert not links.send(b"id-2", b"hello")  # no link: ZeroMQ
        assert not links.send(b"id-1", b"x" * (direct.MAX_MESSAGE + 1))  # too large: ZeroMQ
        time.sleep(1.1)  # PENDING_S: a connection that never presents a token is closed
        links.housekeep()
        silent.settimeout(5)
        assert silent.recv(16) == b""
        right.close()
        assert links.read(links.links[0]) == [] and not links.links  # end of file: dropped
        for s in (wrong, again, silent):
            s.close()  # a Link or a socket
    finally:
        links.close()


def test_a_step_larger_than_a_link_message_goes_over_zeromq(tmp_path) -> None:
    srv = ipc_server(tmp_path)
    c = _client(srv.endpoint, name="c", transport="shm", shm_ring_mib=4)
    try:
        sent = c.stats()["direct_sent"]
        # 300 sessions with 250-byte ids: a Step header over direct.MAX_MESSAGE
        reqs = [StepRequest(f"{i:03d}" + "s" * 247, 0, 0, 7, 2) for i in range(300)]
        out = c.step(reqs, None)
        assert len(out) == 300 and c.stats()["ok"] == 1
        assert c.stats()["direct_sent"] == sent  # not over the link
        assert c.step(reqs[:2], None) and c.stats()["direct_sent"] == sent + 1  # a small one is
        # order kept: a small step sent while one over the socket waits for its reply goes that way too
        # (the server is stopped until both are sent, so the big one's reply cannot come first)
        srv.pause()
        try:
            big = c.submit_step(reqs[2:], None)
            small = c.submit_step([StepRequest("other", 0, 0, 7, 2)], None)
            io = c._io
            assert wait_for(lambda: not io._cmds and sum(p.kind == "step" for p in list(io.pending.values())) == 2)
        finally:
            srv.resume()
        assert len(big.collect()) == 298 and small.collect()[0].tokens
        assert c.stats()["direct_sent"] == sent + 1
        assert c.step(reqs[:2], None) and c.stats()["direct_sent"] == sent + 2  # both answered: the link again
    finally:
        c.close()
        srv.kill()
