"""Same-host transports against real server processes: ``ipc://`` endpoints and the shm ring.

1. One server bound to tcp and ipc at once: two clients over ipc and one over tcp step
   concurrently; every draft is the checksum drafter's proof that the server holds exactly the
   rows sent. A second server asking for the same ipc path is refused at start in one line.
2. Transport shm over ipc, two clients at once, rings small enough to wrap and to fill (those
   steps go in frames), one of them writing its rows into regions it claims (sent where they
   lie): drafts exact, nothing left in /dev/shm once the Welcome came.
3. Refusals at Hello, one line, counted on both sides: a ``--no-shm`` server, a segment the
   server cannot open (as from another host or container); "auto" goes on with frames.
4. kill -9 mid-traffic: of the client (nothing left in /dev/shm; the server unmaps the ring and
   frees the sessions after the TTL) and of the server (nothing left; the client drafts again
   within a few steps of the restart, through a new ring).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from draft_server.drafters.checksum import expected_drafts
from protocol.shm import PREFIX
from target_client import ClientConfig, ContractMismatchError, DraftClient, StepRequest
from tests.conftest import CHECKSUM_CONTRACT, ROOT, ServerProc, wait_for

VOCAB = CHECKSUM_CONTRACT.vocab_size
W = CHECKSUM_CONTRACT.tap_width


def names(pid: int) -> list[str]:
    """Ring names in /dev/shm made by process ``pid``."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"{PREFIX}{pid}-")]


def ipc_server(tmp_path, *extra: str, tcp: bool = False) -> ServerProc:
    srv = ServerProc(*extra)
    path = f"ipc://{tmp_path}/draft.sock"
    i = srv.args.index("--bind") + 1
    srv.args[i] = f"{srv.endpoint},{path}" if tcp else path
    srv.endpoint = path
    return srv.start()


class Sessions:
    """Sessions of one client and the rows it sent, to check every draft against the checksum."""

    def __init__(self, client: DraftClient, prefix: str, n: int, seed: int, claim: bool = False) -> None:
        """``claim``: write each step's rows into a region of the client's ring (``claim_rows``)
        when it gives one, as the vLLM proposer's device-to-host copy does."""
        self.client, self.prefix, self.n = client, prefix, n
        self.rng = np.random.default_rng(seed)
        self.rows: dict[str, dict[int, bytes]] = {f"{prefix}{s}": {} for s in range(n)}
        self.claim = claim
        self.claimed = 0

    def step(self, rows_per: int = 3, k: int = 4) -> list:
        reqs, parts = [], []
        for sid, have in self.rows.items():
            pos = len(have)
            taps = self.rng.integers(0, 1 << 15, (rows_per, W), dtype=np.uint16)  # finite bf16 patterns
            reqs.append(StepRequest(sid, pos, rows_per, 7, k))
            parts.append(taps)
        taps = np.concatenate(parts)
        buf = self.client.claim_rows(taps.nbytes) if self.claim else None
        if buf is not None:
            view = buf.view(np.uint16).reshape(taps.shape)
            view[:] = taps
            taps = view
            self.claimed += 1
            del buf
        replies = self.client.step(reqs, taps)
        for req, t in zip(reqs, parts, strict=True):
            for i in range(rows_per):
                self.rows[req.session][req.pos + i] = t[i].tobytes()
        return replies

    def check(self, replies: list, k: int = 4) -> int:
        """Drafts that are exactly the checksum of the rows sent (a reply with drafts must be)."""
        good = 0
        for r, (sid, have) in zip(replies, self.rows.items(), strict=True):
            if not r.tokens:
                continue
            end = len(have)
            start = r.start if r.start >= 0 else 0
            want = expected_drafts({p: have[p] for p in range(start, end)}, start, end, 7, k, VOCAB)
            assert r.tokens == want, f"{sid}: drafts differ from the rows sent"
            good += 1
        return good


def in_threads(sessions: list[Sessions], steps: int, last_rows: int = 0) -> None:
    """Each client steps in its own thread, all at once; every step must draft every session."""
    errors: list[BaseException] = []

    def run(s: Sessions) -> None:
        try:
            for i in range(steps):
                assert s.check(s.step()) == s.n, i
            if last_rows:
                assert s.check(s.step(rows_per=last_rows)) == s.n
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors


def _client(endpoint: str, **kw) -> DraftClient:
    kw.setdefault("budget_ms", 5000.0)
    c = DraftClient(ClientConfig(endpoint=endpoint, **kw))
    c.connect(wait=True)
    return c


@pytest.mark.timeout(120)
def test_ipc_and_tcp_on_one_server_with_concurrent_clients(tmp_path) -> None:
    srv = ipc_server(tmp_path, tcp=True)
    tcp = srv.args[srv.args.index("--bind") + 1].split(",")[0]
    clients = [_client(srv.endpoint, name="ipc-a"), _client(srv.endpoint, name="ipc-b"), _client(tcp, name="tcp")]
    try:
        in_threads([Sessions(c, f"{c.cfg.name}-", 2, i) for i, c in enumerate(clients)], steps=30)
        assert srv.metrics()["draft_server_sessions"] == 6
        second = subprocess.run(
            [sys.executable, "-m", "draft_server", "serve", "--drafter", "checksum", "--bind", srv.endpoint],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert second.returncode == 2
        line = second.stderr.strip()
        assert "\n" not in line and "address is in use" in line and srv.endpoint in line, line
        assert clients[0].step([StepRequest("ipc-a-0", 0, 0, 1, 2)], None)[0].tokens  # the first still serves
    finally:
        for c in clients:
            c.close()
        srv.kill()


@pytest.mark.timeout(120)
def test_shm_ring_two_clients_wrap_fill_and_leave_nothing(tmp_path) -> None:
    srv = ipc_server(tmp_path)
    reg = CollectorRegistry()
    # 1 MiB rings (the smallest): 16 sessions x 3 rows x 256 bytes per step wrap them every ~80 steps
    clients = [_client(srv.endpoint, name=f"shm-{i}", transport="shm", shm_ring_mib=1, registry=reg) for i in (0, 1)]
    try:
        assert all(c.welcome is not None and c.welcome.ring for c in clients)
        assert not names(os.getpid())  # mapped: the names are gone, only the mappings hold the rings
        # 200 steps each, then a prefill-sized step (1.2 MB): larger than the ring, so its rows go in a frame.
        # Client 1 writes its rows into regions it claims (sent where they lie), client 0 has them copied in.
        sessions = [Sessions(c, f"c{i}-", 16, i, claim=i == 1) for i, c in enumerate(clients)]
        in_threads(sessions, steps=200, last_rows=300)
        assert reg.get_sample_value("draft_client_shm_steps_total") >= 400
        assert sessions[1].claimed >= 150 and clients[1].stats()["rows_in_place"] == sessions[1].claimed
        assert clients[0].stats()["rows_in_place"] == 0
        assert reg.get_sample_value("draft_client_shm_fallbacks_total", {"reason": "ring_full"}) >= 2
        assert all(c._io.handshake.ring.generation >= 200 for c in clients)  # type: ignore[union-attr]
        met = srv.metrics()
        assert met["draft_server_shm_rings"] == 2 and met["draft_server_sessions"] == 32
        assert not any(k.startswith("draft_server_bad_messages_total{") and v for k, v in met.items())
    finally:
        for c in clients:
            c.close()
        srv.kill()
    assert not names(os.getpid())


@pytest.mark.timeout(120)
def test_a_reply_acknowledges_its_own_steps_ring_region(tmp_path) -> None:
    """A step whose rows fill more than half the ring still goes in place step after step: the
    server lets go of a step's region before it replies, so the reply names it free and the next
    step's claim finds room. (Held past the reply, every other claim failed and those steps' rows
    went in frames.) Two clients, staggered, drafts exact."""
    srv = ipc_server(tmp_path)
    clients = [
        DraftClient(ClientConfig(endpoint=srv.endpoint, name=f"c{i}", transport="shm", shm_ring_mib=1, budget_ms=5000))
        for i in range(2)
    ]
    try:
        for c in clients:
            assert c.connect(wait=True) is not None
        per = (300 << 10) // (W * 2)  # rows per session: about 600 KiB a step in a 1 MiB ring, two never fit
        groups = [Sessions(c, f"c{i}-", 2, seed=i, claim=True) for i, c in enumerate(clients)]
        errors: list[BaseException] = []

        def run(g: Sessions, delay: float) -> None:
            try:
                time.sleep(delay)
                for i in range(12):
                    assert g.check(g.step(rows_per=per)) == g.n, i
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(g, 0.003 * i)) for i, g in enumerate(groups)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert [g.claimed for g in groups] == [12, 12]  # every step's rows went where they were written
    finally:
        for c in clients:
            c.close()
        srv.stop()


def test_transport_refused_at_hello_in_one_line(tmp_path, monkeypatch) -> None:
    srv = ipc_server(tmp_path, "--no-shm")
    reg = CollectorRegistry()
    try:
        strict = DraftClient(ClientConfig(endpoint=srv.endpoint, transport="shm", shm_ring_mib=1, registry=reg))
        with pytest.raises(ContractMismatchError) as e:
            strict.connect(wait=True)
        msg = str(e.value)
        assert "\n" not in msg and e.value.fields == ("transport",), msg
        assert msg.endswith("transport 'shm' refused: server accepts frames"), msg
        assert strict.step([StepRequest("s", 0, 0, 1, 2)], None)[0].tokens == []  # drafting stays off
        strict.close()
        auto = _client(srv.endpoint, transport="auto", shm_ring_mib=1, registry=reg)  # goes on with frames
        s = Sessions(auto, "a-", 2, 3)
        assert s.check(s.step()) == 2 and auto._io.handshake.ring is None
        auto.close()
        assert reg.get_sample_value("draft_client_handshake_refusals_total", {"reason": "transport"}) >= 2
        assert srv.metrics()['draft_server_bad_messages_total{code="transport"}'] >= 2
        assert not names(os.getpid())
    finally:
        srv.kill()

    srv = ipc_server(tmp_path)  # shm on, but the segment cannot be opened there (another host, container)
    import target_client.client.ring as ring_mod

    made = ring_mod.create

    def elsewhere(nbytes: int, pace_s: float = 0.0):
        ann, mm = made(nbytes, pace_s)
        ring_mod.unlink(ann.name)  # as if in another /dev/shm
        return ann, mm

    monkeypatch.setattr(ring_mod, "create", elsewhere)
    try:
        c = DraftClient(ClientConfig(endpoint=srv.endpoint, transport="shm", shm_ring_mib=1, registry=reg))
        with pytest.raises(ContractMismatchError) as e:
            c.connect(wait=True)
        msg = str(e.value)
        assert "\n" not in msg and "transport 'shm' refused: cannot open shm ring /dspark-ring-" in msg, msg
        assert "another host" in msg
        c.close()
        assert srv.metrics()['draft_server_bad_messages_total{code="transport"}'] >= 1
    finally:
        srv.kill()


CLIENT = """
import sys, numpy as np
from target_client import ClientConfig, DraftClient, StepRequest
c = DraftClient(ClientConfig(endpoint=sys.argv[1], transport="shm", shm_ring_mib=1, budget_ms=2000))
c.connect(wait=True)
taps = np.ones((4 * 3, int(sys.argv[2])), np.uint16)
for i in range(10**9):
    r = c.step([StepRequest(f"s{j}", 3 * i, 3, 1, 2) for j in range(4)], taps)
    if i == 20:
        print("STEPPING", flush=True)
"""


@pytest.mark.timeout(120)
def test_kill_9_client_leaves_no_segment_and_the_server_lets_go(tmp_path) -> None:
    srv = ipc_server(tmp_path, "--session-ttl-s", "1")
    try:
        p = subprocess.Popen(
            [sys.executable, "-c", CLIENT, srv.endpoint, str(W)], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        assert p.stdout is not None and p.stdout.readline().strip() == "STEPPING"
        assert srv.metrics()["draft_server_shm_rings"] == 1
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        assert not names(p.pid)
        assert wait_for(lambda: srv.metrics()["draft_server_shm_rings"] == 0, 15)  # unmapped after the TTL
        assert wait_for(lambda: srv.metrics()["draft_server_sessions"] == 0, 15)
    finally:
        srv.kill()


@pytest.mark.timeout(120)
def test_kill_9_server_leaves_no_segment_and_drafting_comes_back_through_a_new_ring(tmp_path) -> None:
    srv = ipc_server(tmp_path)
    reg = CollectorRegistry()
    c = _client(srv.endpoint, transport="shm", shm_ring_mib=1, budget_ms=50.0, registry=reg)
    try:
        s = Sessions(c, "s", 4, 1, claim=True)  # rows written in place: the old ring's stay valid until resent
        for _ in range(10):
            assert s.check(s.step()) == 4
        first = c.welcome.ring  # type: ignore[union-attr]
        server_pid = srv.pid
        srv.kill()  # SIGKILL, mid-traffic
        for _ in range(3):
            s.check(s.step())  # no server: empty drafts within the budget
        srv.start()
        shm_before = reg.get_sample_value("draft_client_shm_steps_total")
        back = None
        for i in range(40):
            if s.check(s.step()) == 4:
                back = i
                break
            time.sleep(0.01)
        assert back is not None and back <= 8, f"drafting back after {back} steps"
        assert c.welcome.ring != first  # type: ignore[union-attr]  # a new segment through the re-Hello
        for _ in range(5):
            assert s.check(s.step()) == 4
        assert reg.get_sample_value("draft_client_shm_steps_total") > shm_before  # rows through the ring again
        assert c.stats()["rows_in_place"] >= 5  # into the new ring too
        # the killed server left no segment; the old ring and the one in use are unlinked (a step that
        # missed its budget after the restart may have made a spare, named until used or let go: close()
        # removes it, checked below)
        mine = {"/" + n for n in names(os.getpid())}
        assert first not in mine and c.welcome.ring not in mine and not names(server_pid)  # type: ignore[union-attr]
    finally:
        c.close()
        srv.kill()
    assert not names(os.getpid())


@pytest.mark.timeout(180)
def test_a_spare_ring_made_while_the_server_is_down_is_named_at_once_after_its_restart(tmp_path, monkeypatch) -> None:
    """Two clients with rows in place. The server is killed: at a client's first missed step it makes
    the ring a re-Hello will need on a thread of its own (a 64 MiB ring takes 40-65 ms on the 2-core
    VM, several target steps), so after the restart the Hello names that spare at once. Then the
    server is paused: the spares made meanwhile stay while steps answered in time on the same rings
    follow the last miss closely, and go once one is answered ``SPARE_KEEP_S`` after it. And a
    server back within the breaker's misses (killed and restarted after 2) finds the spare too."""
    import target_client.client.handshake as hs_mod

    keep_s = 1.5
    monkeypatch.setattr(hs_mod, "SPARE_KEEP_S", keep_s)
    srv = ipc_server(tmp_path)
    clients = [_client(srv.endpoint, transport="shm", shm_ring_mib=1, budget_ms=50.0, name=f"c{i}") for i in (0, 1)]
    sessions = [Sessions(c, f"c{i}-", 3, 10 + i, claim=True) for i, c in enumerate(clients)]
    me = os.getpid()

    def step_all() -> list[int]:
        return [s.check(s.step()) for s in sessions]

    def until_drafting() -> int:
        for i in range(60):
            if step_all() == [3, 3]:
                return i
            time.sleep(0.01)
        raise AssertionError("no drafts after the server came back")

    try:
        for _ in range(5):
            assert step_all() == [3, 3]
        assert not names(me)  # the mapped rings' names are gone
        srv.kill()
        for _ in range(6):  # misses: the breakers open
            step_all()
        assert wait_for(lambda: len(names(me)) == 2), names(me)  # a spare each, named in /dev/shm until used
        spares = {"/" + n for n in names(me)}
        srv.start()
        until_drafting()
        for c in clients:
            assert c.welcome is not None and c.welcome.ring in spares, (c.welcome, spares)
            assert c.stats()["spare_rings_used"] == 1
        for _ in range(3):
            assert step_all() == [3, 3]
        assert not spares & {"/" + n for n in names(me)}  # used: unlinked (a late miss may have made another)

        srv.pause()
        try:
            for _ in range(6):
                step_all()
            assert wait_for(lambda: len(names(me)) == 2), names(me)
        finally:
            srv.resume()
        until_drafting()
        resumed = time.monotonic()
        for _ in range(3):
            assert step_all() == [3, 3]
        if time.monotonic() - resumed < keep_s / 2:  # (a slow machine may be past it already)
            assert len(names(me)) == 2, names(me)  # kept: the last miss is recent
        time.sleep(max(0.0, resumed + keep_s - time.monotonic()))
        assert step_all() == [3, 3]
        assert wait_for(lambda: not names(me)), names(me)  # no restart: the spares were let go
        assert [c.stats()["spare_rings_used"] for c in clients] == [1, 1]

        opens = [c.stats()["breaker_opens"] for c in clients]  # >= 2: the kill and the pause before
        assert min(opens) >= 2, opens
        srv.kill()
        for _ in range(2):  # two misses each: the breakers are still closed
            step_all()
        assert [c.stats()["breaker_opens"] for c in clients] == opens
        assert wait_for(lambda: len(names(me)) == 2), names(me)  # the spares are there already
        srv.start()
        until_drafting()
        assert [c.stats()["spare_rings_used"] for c in clients] == [2, 2]
        assert all(c.stats()["rows_in_place"] >= 8 for c in clients)  # counted over both rings
    finally:
        for c in clients:
            c.close()
        srv.kill()
    assert not names(me)
