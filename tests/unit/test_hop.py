"""The hop's mechanisms, one at a time (issue 12, RPC overhead): no timed assertions.

* ``protocol.telemetry.Deferred``: queued metric updates are applied exactly once, whoever
  flushes, and a registry's collection (a scrape, ``get_sample_value``) applies them first;
* the server's replies: the engine sends a reply itself when the socket is free, queues it for
  the I/O thread when that thread holds the socket (never lost, never reordered behind a later
  one), wakes the I/O thread when its send may have taken the edge of a message still unread,
  and drops it quietly once the router is stopped; the engine is rung only when it idles;
* the client: a step goes out from the caller's own thread when the loop is free, and from the
  I/O thread when a pass of that thread holds it.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import zmq
from prometheus_client import CollectorRegistry, Counter, Histogram

from draft_server.app import DraftServer
from draft_server.config import ServerConfig
from draft_server.drafters.checksum import ChecksumDrafter
from protocol import Ping, Pong, decode_reply, encode
from protocol.telemetry import Deferred
from target_client import ClientConfig, DraftClient, StepRequest
from tests.conftest import wait_for
from tests.unit.client_fake_server import FakeServer, fake_drafts

pytestmark = pytest.mark.timeout(30)


# ---------------------------------------------------------------- Deferred


def test_deferred_updates_are_applied_exactly_once_by_concurrent_flushers() -> None:
    reg = CollectorRegistry()
    d = Deferred(bound=1 << 30)  # only the flushers below apply anything
    c = Counter("hop_updates", "test", registry=reg)
    n, writers = 20_000, 2
    stop = threading.Event()

    def write() -> None:
        for _ in range(n):
            d.later(c.inc, 1)

    def flush() -> None:
        while not stop.is_set():
            d.flush()

    flushers = [threading.Thread(target=flush) for _ in range(3)]
    ws = [threading.Thread(target=write) for _ in range(writers)]
    for t in flushers + ws:
        t.start()
    for t in ws:
        t.join()
    stop.set()
    for t in flushers:
        t.join()
    d.flush()
    assert len(d) == 0
    assert reg.get_sample_value("hop_updates_total") == n * writers


def test_a_flush_returns_only_once_an_update_another_flusher_is_applying_is_done() -> None:
    """A scrape's flush that finds the queue empty while another thread applies a long update (the
    server's NaN sample) waits for it: it never reads the metric before that update lands."""
    d = Deferred()
    started, done = threading.Event(), []

    def slow(v) -> None:
        started.set()
        threading.Event().wait(0.2)
        done.append(v)

    d.later(slow, 1)
    t = threading.Thread(target=d.flush)
    t.start()
    assert started.wait(5)
    d.flush()  # the queue is empty now; the update is still being applied
    assert done == [1]
    t.join()


def test_a_registry_applies_what_is_queued_before_it_reads() -> None:
    reg = CollectorRegistry()
    d = Deferred()
    reg.register(d)  # type: ignore[arg-type]  # first, as both sides register it
    h = Histogram("hop_wait_seconds", "test", buckets=(0.001, 0.01), registry=reg)
    for v in (0.0005, 0.002, 0.5):
        d.later(h.observe, v)
    assert h._sum.get() == 0.0  # queued, not applied yet
    assert reg.get_sample_value("hop_wait_seconds_count") == 3.0  # the collection applied them
    assert reg.get_sample_value("hop_wait_seconds_bucket", {"le": "0.001"}) == 1.0
    assert len(d) == 0


def test_the_queue_never_grows_past_its_bound() -> None:
    reg = CollectorRegistry()
    d = Deferred(bound=8)
    c = Counter("hop_bounded", "test", registry=reg)
    for _ in range(100):
        d.later(c.inc, 1)
    assert len(d) <= 8
    assert c._value.get() + len(d) == 100


# ---------------------------------------------------------------- server: who sends a reply


@pytest.fixture
def router():
    """A server's router with no I/O thread running (the test plays it), and a DEALER peer."""
    srv = DraftServer(ServerConfig(bind="tcp://127.0.0.1:0", metrics_port=-1, drafter="checksum"), ChecksumDrafter())
    r = srv.router
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.ROUTING_ID, b"dc-peer")
    peer.connect(r.endpoint)
    yield r, peer
    peer.close(0)
    ctx.term()
    r.stop()


def _ident(r, peer) -> bytes:
    """Send a Ping and read it as the I/O thread would, so the router knows the peer's route."""
    peer.send_multipart(encode(Ping(call_id=1)))
    assert r._sock.poll(5000, zmq.POLLIN)
    frames = r._sock.recv_multipart()
    return frames[0]


def _got(peer, first_ms: int = 5000) -> list[int]:
    """Call ids of the replies the peer has now (after waiting up to ``first_ms`` for the first)."""
    ids = []
    if peer.poll(first_ms, zmq.POLLIN):
        while peer.poll(200, zmq.POLLIN):
            ids.append(decode_reply(peer.recv_multipart()[0]).call_id)
    return ids


def _woken(r) -> bool:
    try:
        return bool(os.read(r._wake_pipe.fd, 4096))
    except BlockingIOError:
        return False


def _pong(r, call_id: int) -> Pong:
    return r._pong(call_id)


def test_a_reply_sent_from_another_thread_goes_out_at_once_when_the_socket_is_free(router) -> None:
    r, peer = router
    ident = _ident(r, peer)
    _woken(r)
    t = threading.Thread(target=r.queue_reply, args=(ident, _pong(r, 7)))  # as the engine does
    t.start()
    t.join()
    assert _got(peer) == [7]  # no I/O thread runs: the engine's thread sent it
    assert not r._outbox and not _woken(r)


def test_a_reply_that_finds_the_socket_busy_a_moment_waits_and_goes_out_from_its_thread(router, monkeypatch) -> None:
    # left to the I/O thread, a reply waits for the GIL the engine (on to its next batch) holds: one
    # in ten 64-entry replies on the 2-core VM. So the engine waits for a pass holding the socket
    # (``_REPLY_WAIT_S``, here long enough for any machine) and sends the reply itself
    from draft_server.io import router as router_mod

    monkeypatch.setattr(router_mod, "_REPLY_WAIT_S", 10.0)
    r, peer = router
    ident = _ident(r, peer)
    _woken(r)
    senders: list[int] = []
    send = r._send
    r._send = lambda *a: (senders.append(threading.get_ident()), send(*a))[1]  # type: ignore[method-assign]
    held = threading.Event()

    def io_pass() -> None:  # a short pass of the I/O thread
        with r._lock:
            held.set()
            threading.Event().wait(0.05)

    t = threading.Thread(target=io_pass)
    t.start()
    assert held.wait(5)
    r.queue_reply(ident, _pong(r, 6))
    t.join()
    assert _got(peer) == [6] and senders == [threading.get_ident()] and not r._outbox


def test_a_reply_that_finds_the_socket_busy_is_queued_and_sent_first_by_the_next_pass(router) -> None:
    r, peer = router
    ident = _ident(r, peer)
    _woken(r)
    held, go = threading.Event(), threading.Event()

    def io_pass() -> None:  # the I/O thread in the middle of a pass
        with r._lock:
            held.set()
            go.wait(5)
            r._serve()

    t = threading.Thread(target=io_pass)
    t.start()
    assert held.wait(5)
    r.queue_reply(ident, _pong(r, 8))  # the engine: the socket is busy
    assert len(r._outbox) == 1 and _woken(r)  # queued, and the I/O thread told
    go.set()
    t.join()
    r.queue_reply(ident, _pong(r, 9))  # a later reply, sent directly
    assert _got(peer) == [8, 9]  # never lost, and in order


def test_the_engine_wakes_the_io_thread_when_a_message_waits_unread_after_its_send(router) -> None:
    r, peer = router
    ident = _ident(r, peer)
    _woken(r)
    peer.send_multipart(encode(Ping(call_id=2)))  # arrives; the I/O thread (not running) has not read it
    assert r._sock.poll(5000, zmq.POLLIN)  # (this read of the socket's state takes the FD's edge too)
    r.queue_reply(ident, _pong(r, 10))
    assert _woken(r)  # the message is the I/O thread's: the engine's send rang it
    assert _got(peer) == [10]


def test_a_reply_after_stop_is_dropped_quietly(router) -> None:
    r, peer = router
    ident = _ident(r, peer)
    r.stop()
    r.queue_reply(ident, _pong(r, 11))  # no exception, no send on a closed socket
    assert _got(peer, first_ms=300) == []


def test_the_engine_is_rung_only_while_it_idles() -> None:
    srv = DraftServer(ServerConfig(bind="tcp://127.0.0.1:0", metrics_port=-1, drafter="checksum"), ChecksumDrafter())
    try:
        eng = srv.engine

        def rings() -> bytes:
            try:
                return os.read(eng._bell.fd, 4096)
            except BlockingIOError:
                return b""

        eng.wake()  # busy (not waiting): nothing to ring
        assert rings() == b""
        eng._idle = True
        eng.wake()
        eng.wake()  # rung once: the first ring ends the idle state
        assert rings() == b"\0" and not eng._idle
    finally:
        srv.router.stop()


# ---------------------------------------------------------------- client: who sends a step


@pytest.fixture
def fake():
    srv = FakeServer()
    yield srv
    srv.stop()


def _client(endpoint: str) -> DraftClient:
    return DraftClient(ClientConfig(endpoint=endpoint, budget_ms=2000.0, registry=CollectorRegistry()))


def _record_senders(c: DraftClient) -> list[int]:
    senders: list[int] = []
    send = c._io._try_send

    def recording(frames, *a, **k) -> bool:
        senders.append(threading.get_ident())
        return send(frames, *a, **k)

    c._io._try_send = recording  # type: ignore[method-assign]
    return senders


def _taps(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).integers(0, 1 << 16, size=(rows, 32), dtype=np.uint16)


def test_a_step_goes_out_from_the_callers_thread_when_the_loop_is_free(fake) -> None:
    c = _client(fake.endpoint)
    try:
        c.connect(wait=True)
        senders = _record_senders(c)
        for pos in range(8):
            out = c.step([StepRequest("a", 2 * pos, 2, anchor=5, k=4)], _taps(2))
            assert out[0].tokens == fake_drafts("a", 2 * pos + 2, 5, 4)
        # a step that finds a pass of the I/O thread holding the loop is that thread's to send (the
        # next test), but one that finds the loop free goes out at once, from the caller's thread
        assert len(senders) == 8 and senders.count(threading.get_ident()) >= 4, senders
    finally:
        c.close()


def test_a_step_goes_out_from_the_io_thread_when_a_pass_of_it_holds_the_loop(fake) -> None:
    c = _client(fake.endpoint)
    try:
        c.connect(wait=True)
        senders = _record_senders(c)
        wakes: list[int] = []
        wake = c._io._wake
        c._io._wake = lambda: (wakes.append(threading.get_ident()), wake())[1]  # type: ignore[method-assign]
        box: list = []
        with c._io._lock:  # a pass of the I/O thread longer than a caller waits for it
            t = threading.Thread(target=lambda: box.append(c.step([StepRequest("b", 0, 1, anchor=3, k=2)], _taps(1))))
            t.start()
            assert wait_for(lambda: t.ident in wakes)  # the caller gave up waiting and woke the I/O thread
            assert c._io._cmds and not senders  # queued for the I/O thread, nothing sent yet
        t.join(10)
        assert box and box[0][0].tokens == fake_drafts("b", 1, 3, 2)
        assert senders == [c._io.thread.ident]
    finally:
        c.close()


def test_a_step_waits_for_a_short_pass_of_the_io_thread_and_goes_out_from_the_callers_thread(fake, monkeypatch) -> None:
    # the I/O thread's next pass would need the GIL, which a caller back at its own work (a target
    # sampling) holds: a predicted commit left to it went out after the sampling. So a caller waits
    # for the pass holding the loop to end (``_CALLER_WAIT_S``, here long enough for any machine)
    from target_client.client import io_loop

    monkeypatch.setattr(io_loop, "_CALLER_WAIT_S", 10.0)
    c = _client(fake.endpoint)
    try:
        c.connect(wait=True)
        senders = _record_senders(c)
        box: list = []
        with c._io._lock:
            t = threading.Thread(target=lambda: box.append(c.step([StepRequest("b", 0, 1, anchor=3, k=2)], _taps(1))))
            t.start()
            assert wait_for(lambda: bool(c._io._cmds))
            threading.Event().wait(0.05)  # the caller is in its wait for the loop by now
            assert not senders
        t.join(10)
        assert box and box[0][0].tokens == fake_drafts("b", 1, 3, 2)
        assert senders == [t.ident]  # not the I/O thread's
    finally:
        c.close()


def _record_readers(c: DraftClient) -> list[int]:
    """Threads that read replies (a pass's ``_on_bufs``)."""
    readers: list[int] = []
    on_bufs = c._io._on_bufs

    def recording(bufs, now) -> None:
        readers.append(threading.get_ident())
        on_bufs(bufs, now)

    c._io._on_bufs = recording  # type: ignore[method-assign]
    return readers


def test_a_waiting_caller_reads_its_own_reply(fake) -> None:
    c = _client(fake.endpoint)
    try:
        c.connect(wait=True)
        readers = _record_readers(c)
        for pos in range(8):
            out = c.step([StepRequest("c", pos, 1, anchor=4, k=3)], _taps(1))
            assert out[0].tokens == fake_drafts("c", pos + 1, 4, 3)
        # a reply may still reach the I/O thread (it is told to leave the socket to the caller only
        # once the first step is out, and it looks at the socket on its own timers), but back to
        # back the caller owns the socket and reads its own replies: no hop through the I/O thread
        assert readers.count(threading.get_ident()) >= 4, readers
        assert c._io._owner == threading.get_ident()  # sticky between its steps
    finally:
        c.close()


def test_the_io_thread_takes_the_socket_back_from_a_caller_that_stopped(fake) -> None:
    c = _client(fake.endpoint)
    try:
        c.connect(wait=True)
        assert c.step([StepRequest("d", 0, 1, anchor=4, k=3)], _taps(1))[0].tokens
        assert wait_for(lambda: c._io._owner is None)  # reclaimed once the owner idled
        readers = _record_readers(c)
        assert c.ping(2000.0) is not None  # a Pong: the I/O thread reads it (no caller watches)
        assert readers == [c._io.thread.ident]
    finally:
        c.close()


def test_concurrent_callers_of_one_client_all_get_their_drafts(fake) -> None:
    # one of them watches the socket at a time; the others' replies reach them through its passes
    # (or through the I/O thread's, once it leaves while they still wait)
    c = _client(fake.endpoint)
    errors: list[str] = []
    try:
        c.connect(wait=True)

        def caller(name: str) -> None:
            for pos in range(40):
                out = c.step([StepRequest(name, pos, 1, anchor=6, k=2)], _taps(1))
                if out[0].tokens != fake_drafts(name, pos + 1, 6, 2):
                    errors.append(f"{name}@{pos}: {out[0].tokens} ({out[0].status}, {c.stats()['timeouts']} timeouts)")

        threads = [threading.Thread(target=caller, args=(f"t{i}",)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:5]
        assert c.stats()["ok"] == 160 and c.stats()["bad_replies"] == 0
    finally:
        c.close()


# ---------------------------------------------------------------- server: who reads a Step


@pytest.fixture
def running():
    """A started server (checksum drafter; ``delay`` ms per draft call, set per test) and a DEALER peer."""
    made: list = []

    def make(delay_ms: float = 0.0):
        cfg = ServerConfig(bind="tcp://127.0.0.1:0", metrics_port=-1, drafter="checksum")
        srv = DraftServer(cfg, ChecksumDrafter(delay_ms=delay_ms))
        srv.start()
        ctx = zmq.Context()
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(srv.endpoint)
        made.append((srv, ctx, peer))
        return srv, peer

    yield make
    for srv, ctx, peer in made:
        peer.close(0)
        ctx.term()
        srv.stop()


def _readers(srv) -> list[str]:
    """Names of the threads that read the server's messages."""
    names: list[str] = []
    on_message = srv.router._on_message

    def recording(*a) -> None:
        names.append(threading.current_thread().name)
        on_message(*a)

    srv.router._on_message = recording
    return names


def _step(call_id: int, session: str = "s", k: int = 3):
    from protocol import Step, StepEntry

    return encode(Step(call_id=call_id, budget_ms=5000.0, entries=(StepEntry(session, 0, 0, 1, k),)))


def test_a_step_that_finds_the_engine_idle_is_read_on_the_engines_thread(running) -> None:
    srv, peer = running()
    names = _readers(srv)
    assert wait_for(lambda: srv.router._engine_owns)  # idle: the engine watches the socket
    for i in range(1, 6):
        peer.send_multipart(_step(i))
        assert _got(peer) == [i]
        assert wait_for(lambda: srv.router._engine_polling)  # idle again before the next one
    assert names == ["draft-engine"] * 5  # no hop through the I/O thread


def test_the_io_thread_takes_the_socket_back_during_a_long_batch(running) -> None:
    srv, peer = running(delay_ms=1500.0)  # every draft call takes 1.5 s
    names = _readers(srv)
    assert wait_for(lambda: srv.router._engine_polling)
    peer.send_multipart(_step(1))
    assert wait_for(lambda: names == ["draft-engine"])  # read by the idle engine, which now drafts
    peer.send_multipart(encode(Ping(call_id=2)))
    assert _got(peer) == [2]  # the Pong first: the I/O thread read the Ping while the engine drafted
    assert names == ["draft-engine", "draft-io"]
    assert _got(peer) == [1]


def _nan_step(call_id: int, session: str, nan_rows: int) -> list:
    """A Step of one entry with 3 rows (checksum contract), its first ``nan_rows`` rows NaN."""
    from draft_tools.synthetic import bf16_normal
    from protocol import DType, Step, StepEntry, spec_for
    from tests.conftest import CHECKSUM_CONTRACT

    taps = bf16_normal(np.random.default_rng(call_id), (3, CHECKSUM_CONTRACT.tap_width))
    taps[:nan_rows] = 0x7FC0
    entry = StepEntry(session, 0, 3, 1, 2)
    return encode(Step(call_id=call_id, budget_ms=5000.0, entries=(entry,), taps=spec_for(taps, DType.BF16, 0)), [taps])


def test_the_idle_engine_samples_rows_for_nan_after_its_reply(running, monkeypatch) -> None:
    """The NaN/Inf sample (only a metric reads it) is off the idle engine's hop: a Step the idle
    engine reads itself is answered first and sampled after, on its thread; one the I/O thread reads
    beside a long batch is sampled there at once. Both are counted."""
    from draft_server.io import router as router_mod
    from protocol import StepResult

    srv, peer = running(delay_ms=800.0)  # each draft call takes 0.8 s: a second Step finds the engine busy
    events: list[tuple[str, str]] = []
    sample, send = router_mod.nonfinite_rows, srv.router._send

    def sampling(taps, dtype):
        events.append(("sample", threading.current_thread().name))
        return sample(taps, dtype)

    def sending(ident, msg, payloads=()):
        if isinstance(msg, StepResult):
            events.append((f"reply {msg.call_id}", threading.current_thread().name))
        send(ident, msg, payloads)

    monkeypatch.setattr(router_mod, "nonfinite_rows", sampling)
    srv.router._send = sending
    names = _readers(srv)
    assert wait_for(lambda: srv.router._engine_polling)  # idle: the engine reads the next Step itself
    peer.send_multipart(_nan_step(1, "a", 2))
    assert wait_for(lambda: names == ["draft-engine"])  # read by the idle engine, which now drafts
    assert wait_for(lambda: not srv.router._engine_owns)  # the I/O thread watches during the batch
    peer.send_multipart(_nan_step(2, "b", 1))
    assert wait_for(lambda: len(events) == 4, timeout=10.0)
    assert names == ["draft-engine", "draft-io"]
    assert events.index(("reply 1", "draft-engine")) < events.index(("sample", "draft-engine"))
    io_sample = events.index(("sample", "draft-io"))
    assert io_sample < next(i for i, e in enumerate(events) if e[0] == "reply 2")
    srv.metrics.later.flush()  # as a scrape does
    assert srv.metrics.nonfinite_rows._value.get() == 3


def test_a_failing_nan_sample_costs_a_metric_not_a_scrape(running, monkeypatch) -> None:
    """The sample runs wherever the queued updates are flushed (the engine after its replies, a scrape):
    should it fail, that is logged and counted, and neither a scrape nor the next Step notices."""
    from draft_server.io import router as router_mod

    def broken(taps, dtype):
        raise RuntimeError("sample failed")

    monkeypatch.setattr(router_mod, "nonfinite_rows", broken)
    srv, peer = running()
    assert wait_for(lambda: srv.router._engine_polling)
    peer.send_multipart(_nan_step(1, "a", 2))
    assert _got(peer) == [1]
    srv.metrics.later.flush()  # as a scrape does: no exception
    assert wait_for(lambda: srv.metrics.io_errors._value.get() == 1)
    peer.send_multipart(_nan_step(2, "a", 0))
    assert _got(peer) == [2]


def test_nan_rows_are_counted_for_valid_entries_only() -> None:
    """A Step's NaN/Inf tap rows are counted (a metric and a log line per client) for the entries
    the server takes; the rows of an entry refused as malformed are not."""
    from draft_tools.synthetic import bf16_normal
    from protocol import StepEntry
    from tests.conftest import CHECKSUM_CONTRACT, RawPeer

    srv = DraftServer(ServerConfig(bind="tcp://127.0.0.1:0", metrics_port=-1, drafter="checksum"), ChecksumDrafter())
    srv.start()
    peer = RawPeer(srv.router.endpoint)
    try:
        taps = bf16_normal(np.random.default_rng(0), (9, CHECKSUM_CONTRACT.tap_width))  # finite
        taps[[0, 1]] = 0x7FC0  # entry "a": 2 NaN rows
        taps[3:6] = 0x7F80  # entry "bad" (k past the block): 3 Inf rows, not counted
        entries = [StepEntry("a", 0, 3, 1, 2), StepEntry("bad", 0, 3, 1, 99), StepEntry("c", 0, 3, 1, 2)]
        r = peer.step(entries, taps)
        assert [x.status.name for x in r.results] == ["OK", "BAD_ENTRY", "OK"]
        srv.metrics.later.flush()  # as a scrape does
        assert srv.metrics.nonfinite_rows._value.get() == 2
    finally:
        peer.sock.close(0)
        srv.stop()
