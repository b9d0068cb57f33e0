"""Transport "shm" without sockets: the segment (``protocol.shm``), the client's ring allocator
(``target_client.client.ring``), the server's ring table (``draft_server.io.rings``), Step
validation of rows that are not in a frame, and the handshake's refusal and "auto" fallback.

The allocator is checked against a model: whatever order puts and (lost, repeated, partial)
acks come in, no region that the server may still read is ever written again.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from draft_server.io.rings import Rings
from protocol import (
    ErrorCode,
    ProtocolError,
    RingAck,
    RingAnnounce,
    RowsAt,
    ServerLimits,
    Step,
    StepEntry,
    TensorSpec,
    Welcome,
)
from protocol.messages import DType
from protocol.shm import HEADER_BYTES, PREFIX, RingError, create, open_ring, region_rows, sweep_stale, unlink
from protocol.validate import validate_step
from target_client import ClientConfig
from target_client.client.counters import Counters
from target_client.client.handshake import Handshake
from target_client.client.ring import ClientRing
from tests.conftest import CHECKSUM_CONTRACT

LIMITS = ServerLimits(64, 4096, 64, 4096, 1 << 26, 1 << 20, 256, 512, 60000.0)


def _names(pid: int | None = None) -> list[str]:
    tag = f"{PREFIX}{pid if pid is not None else os.getpid()}-"
    return [n for n in os.listdir("/dev/shm") if n.startswith(tag)]


class _Gauge:
    def __init__(self) -> None:
        self.value = 0

    def set(self, v: float) -> None:
        self.value = v


def test_ring_never_rewrites_what_the_server_may_read() -> None:
    ring = ClientRing(1 << 16)
    server_mm = open_ring(ring.announce)  # the server's read-only view, as a server maps it
    ring.confirm()
    rnd = random.Random(7)
    sent: dict[int, tuple[RowsAt, bytes]] = {}  # generation -> (where, what), until the server is done
    held: set[int] = set()
    seen = fallbacks = 0
    for i in range(3000):
        if rnd.random() < 0.6:
            rows = np.frombuffer(rnd.randbytes(rnd.choice([64, 500, 4000, 12000])), np.uint8).reshape(1, -1)
            at = ring.put([rows])
            if at is None:
                fallbacks += 1
                continue
            assert at.offset >= HEADER_BYTES and at.offset % 64 == 0
            sent[at.generation] = (at, rows.tobytes())
            if rnd.random() < 0.9:  # the server receives it (else: the Step was lost on the way)
                seen = at.generation
                held.add(at.generation)
        else:
            for g in list(held):  # the engine finishes some
                if rnd.random() < 0.5:
                    held.discard(g)
            if rnd.random() < 0.7:  # the reply carrying the ack arrives (else: lost)
                ring.ack(RingAck(ring.name, seen, tuple(sorted(held))))
        for g in held:  # everything the server may still read is intact
            at, data = sent[g]
            assert region_rows(server_mm, at).tobytes() == data, f"region {g} rewritten at step {i}"
    assert fallbacks and ring.generation > 300
    ring.ack(RingAck(ring.name, seen, ()))
    assert ring.free_bytes == ring.size - HEADER_BYTES  # everything came back
    ring.close()
    server_mm.close()
    assert not _names()


def test_claimed_regions_are_never_rewritten_while_viewed_or_read() -> None:
    """The model above with rows written in place too: claimed regions go out where they lie (or
    never, or by copy), views of them are dropped at random, out of order; no region anyone may
    still read (the server, a live view) is ever handed out again."""
    ring = ClientRing(1 << 16)
    server_mm = open_ring(ring.announce)
    ring.confirm()
    rnd = random.Random(11)
    views: dict[int, tuple[np.ndarray, bytes]] = {}  # id -> (a caller's live view, what it wrote)
    sent: dict[int, tuple[RowsAt, bytes]] = {}
    held: set[int] = set()
    seen = in_place = 0
    for i in range(4000):
        x = rnd.random()
        if x < 0.35:  # a caller claims a region and writes its rows
            n = rnd.choice([64, 700, 4000, 9000])
            buf = ring.claim(n)
            if buf is None:
                continue
            data = rnd.randbytes(n)
            buf[:] = np.frombuffer(data, np.uint8)
            rows = buf.view(np.uint8).reshape(1, n)  # what goes to the client: a view
            del buf
            views[i] = (rows, data)
            if rnd.random() < 0.8:  # the I/O thread sends it (else: it went in a frame, or never)
                at = ring.in_place(rows)
                assert at is not None and ring.in_place(rows) is None  # once
                in_place += 1
                assert region_rows(server_mm, at).tobytes() == data  # the server reads what was written
                sent[at.generation] = (at, data)
                if rnd.random() < 0.9:
                    seen = at.generation
                    held.add(at.generation)
        elif x < 0.55:  # plain puts in between
            data = rnd.randbytes(rnd.choice([64, 3000]))
            at = ring.put([np.frombuffer(data, np.uint8).reshape(1, -1)])
            if at is not None:
                sent[at.generation] = (at, data)
                seen = at.generation
                held.add(at.generation)
        elif x < 0.75 and views:  # a caller lets go of some rows (the resend buffer's ack)
            views.pop(rnd.choice(list(views)))
        else:
            for g in list(held):
                if rnd.random() < 0.5:
                    held.discard(g)
            if rnd.random() < 0.7:
                ring.ack(RingAck(ring.name, seen, tuple(sorted(held))))
        for rows, data in views.values():  # every live view still holds what its caller wrote
            assert rows.tobytes() == data, f"a viewed region was rewritten at step {i}"
        for g in held:
            at, data = sent[g]
            assert region_rows(server_mm, at).tobytes() == data, f"region {g} rewritten at step {i}"
    assert in_place > 300
    views.clear()
    del rows
    ring.ack(RingAck(ring.name, ring.generation, ()))  # the server is done with everything
    assert ring.free_bytes == ring.size - HEADER_BYTES  # everything came back
    ring.close()
    server_mm.close()
    assert not _names()


def test_in_place_takes_only_the_start_of_a_claimed_region_once() -> None:
    ring = ClientRing(1 << 16)
    try:
        buf = ring.claim(1024)
        assert buf is not None and buf.flags.writeable
        rows = buf.view(np.uint16).reshape(4, 128)
        assert ring.in_place(np.zeros((4, 128), np.uint16)) is None  # not in the ring
        assert ring.in_place(rows[1:]) is None  # not where the region starts
        at = ring.in_place(rows)
        assert at is not None and at.nbytes == 1024 and ring.in_place(rows) is None
        ring.cancel(at.generation)  # never sent after all: free once the views go too
        assert ring.free_bytes < ring.size - HEADER_BYTES
        del buf, rows
        assert ring.free_bytes == ring.size - HEADER_BYTES
    finally:
        ring.close()


def test_claim_pins_the_ring_once_and_stops_after_a_refusal() -> None:
    calls: list[tuple[int, int]] = []
    undone: list[int] = []

    def pin(address: int, nbytes: int):
        calls.append((address, nbytes))
        return lambda: undone.append(address)

    ring = ClientRing(1 << 16)
    a = ring.claim(100, pin)
    b = ring.claim(100, pin)
    assert a is not None and b is not None and len(calls) == 1 and calls[0][1] == ring.size
    assert calls[0][0] == a.__array_interface__["data"][0] - HEADER_BYTES - 64  # the mapping's start
    del a
    ring.close()
    assert undone == [] and ring.claim(100) is None  # b lives (a copy into it may be in flight); closed
    del b
    assert _eventually(lambda: undone == [calls[0][0]])  # unlocked once the last claimed array went

    ring = ClientRing(1 << 16)
    c = ring.claim(100, pin)
    del c
    ring.close()
    assert len(calls) == 2 and undone[-1] == calls[1][0]  # nothing claimed lives: unlocked at close

    def refuse(address: int, nbytes: int):
        raise RuntimeError("cudaHostRegister failed")

    ring = ClientRing(1 << 16)
    try:
        assert ring.claim(100, refuse) is None and ring.claim(100) is None
        assert ring.pin_error is not None and "cudaHostRegister" in ring.pin_error
        assert ring.put([np.zeros((1, 100), np.uint8)]) is not None  # copies still go
    finally:
        ring.close()


def _eventually(check, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(name in line for line in f)


def test_a_lost_rings_mapping_never_goes_on_the_thread_that_drops_it(monkeypatch) -> None:
    """A ring the server lost (a restart) is closed while the resend buffer still views regions of it;
    the server restarted from them acknowledges their rows in the middle of a caller's step, whose
    thread drops the last view. The unmapping (15-20 ms of a core for a populated 64 MiB ring) goes
    to a thread of its own, and so does a ring dropped with no view left (``drop_ring``). Before, the
    caller unmapped it and the first step after each restart missed its budget (the shm soak smoke's
    resume_after_restart)."""
    import target_client.client.ring as ring_mod

    unmapped: list[str] = []
    ours: list[object] = []  # the mappings of this test's rings (another test's ring may go meanwhile)
    real = ring_mod.unmap

    def spy(mm, wait_s: float = 0.0) -> bool:
        ok = real(mm, wait_s)
        if ok and any(mm is m for m in ours):
            unmapped.append(threading.current_thread().name)
        return ok

    monkeypatch.setattr(ring_mod, "unmap", spy)
    ring = ClientRing(1 << 20)
    ours.append(ring._mm)
    name = ring.name
    rows = ring.claim(4096)
    assert rows is not None
    view = rows.view(np.uint16)[:100]  # what the resend buffer keeps
    del rows
    ring.close()
    assert unmapped == [] and _mapped(name)  # the view keeps it
    del ring  # the handshake let go of it
    del view  # a caller's thread, mid-step
    assert _eventually(lambda: unmapped == ["draft-client-ring-retire"]), unmapped
    assert _eventually(lambda: not _mapped(name))

    hs = Handshake(ClientConfig("ipc:///x", transport="shm", shm_ring_mib=1), Counters(None))
    hs.hello(1)
    first = hs.ring
    assert isinstance(first, ClientRing)
    ours.append(first._mm)
    name = first.name
    del first
    hs.accept(_welcome(("frames", "shm"), name))
    assert hs.rehello()  # the server lost it: the next Hello names a new ring
    hs.hello(2)
    nxt = hs.ring
    assert isinstance(nxt, ClientRing)
    ours.append(nxt._mm)
    try:
        assert nxt.name != name
        assert _eventually(lambda: unmapped[1:] == ["draft-client-ring-retire"]), unmapped
        assert _eventually(lambda: not _mapped(name))
    finally:
        hs.drop_ring(closing=True)
    assert unmapped[2:] == [threading.current_thread().name]  # the client's end: at once, here
    assert not _mapped(nxt.name) and not _names()


def test_claimed_rows_let_go_on_another_thread_free_their_region() -> None:
    ring = ClientRing(1 << 16)
    try:
        bufs = [ring.claim(8000) for _ in range(7)]
        assert all(b is not None for b in bufs) and ring.claim(20000) is None

        def drop() -> None:
            bufs.clear()

        t = threading.Thread(target=drop)
        t.start()
        t.join()
        assert ring.claim(20000) is not None
    finally:
        ring.close()


def test_cancel_frees_an_unsent_region_and_acks_of_another_ring_are_ignored() -> None:
    ring = ClientRing(1 << 16)
    try:
        a = ring.put([np.zeros((1, 1000), np.uint8)])
        assert a is not None
        before = ring.free_bytes
        ring.ack(RingAck("/dspark-ring-1-0000000000000000", 99, ()))
        assert ring.free_bytes == before
        ring.cancel(a.generation)
        assert ring.free_bytes == ring.size - HEADER_BYTES
    finally:
        ring.close()
    assert not _names()


def test_open_ring_refuses_in_one_line() -> None:
    ann, mm = create(1 << 16)
    try:
        for bad, what in (
            (RingAnnounce(ann.name, ann.nbytes, "00" * 16), "not the segment the Hello announced"),
            (RingAnnounce(ann.name, ann.nbytes * 2, ann.nonce), f"the Hello says {ann.nbytes * 2}"),
            (RingAnnounce("/etc-passwd", ann.nbytes, ann.nonce), "is not a ring name"),
        ):
            with pytest.raises(RingError) as e:
                open_ring(bad)
            assert what in str(e.value) and "\n" not in str(e.value)
        assert _names()  # refused: nothing unlinked the name
        server_mm = open_ring(ann)
        assert not _names()  # mapped: the server unlinked the name at once
        with pytest.raises(RingError) as e:
            open_ring(ann)  # a second server (or a retry) no longer finds it
        assert "No such file" in str(e.value) and "another host" in str(e.value)
        at = RowsAt(ann.name, HEADER_BYTES, 16, 1)
        with pytest.raises(RingError, match="holds generation 0"):  # never stamped
            region_rows(server_mm, at)
        with pytest.raises(RingError, match="outside"):
            region_rows(server_mm, RowsAt(ann.name, ann.nbytes - 64, 4096, 1))
        server_mm.close()
    finally:
        mm.close()
        unlink(ann.name)


def test_a_hello_that_finds_the_spare_still_being_made_hurries_it_and_names_it(monkeypatch) -> None:
    """A server back before the spare is done (paced, it takes a while): the Hello hurries the spare
    (no more pauses) and waits for it rather than make a second ring beside it on the loop's thread;
    it names the spare, and only one ring was made. (Without the hurry, the Hello made a new ring at
    once, unpaced, while the spare was still being made.)"""
    import target_client.client.handshake as hs_mod

    monkeypatch.setattr(hs_mod, "SPARE_PACE_S", 0.1)  # 8 pieces: 0.8 s unless hurried
    monkeypatch.setattr(hs_mod, "SPARE_WAIT_S", 2.0)  # a slow machine still finds it made
    hs = Handshake(ClientConfig("ipc:///x", transport="shm", shm_ring_mib=8), Counters(None))
    name = hs.hello(1).ring.name  # type: ignore[union-attr]
    hs.accept(_welcome(("frames", "shm"), name))
    made: list[int] = []
    real = hs_mod.ClientRing

    def counting(nbytes: int, pace_s: object = 0.0) -> ClientRing:
        made.append(nbytes)
        return real(nbytes, pace_s)  # type: ignore[arg-type]

    monkeypatch.setattr(hs_mod, "ClientRing", counting)
    pauses: list[float] = []
    real_pause = hs._spare_pause

    def pause() -> float:
        pauses.append(real_pause())
        return pauses[-1]

    hs._spare_pause = pause  # type: ignore[method-assign]
    hs.prepare_spare(time.monotonic())  # a step missed: the spare starts, paced
    time.sleep(0.05)
    assert hs._spare is None and hs._spare_wanted  # still being made
    assert hs.rehello()  # the server restarted: its Hello needs a ring now
    ring = hs.hello(2).ring
    try:
        assert hs.spares_used == 1 and len(made) == 1, (hs.spares_used, made)
        assert len(pauses) == 8 and pauses[0] == 0.1 and pauses[-1] == 0.0  # hurried: the last pieces unpaused
        assert ring is not None and ring.name != name and len(_names()) == 1
    finally:
        hs.drop_ring(closing=True)
    assert not _names()


def test_paced_create_allocates_every_page_a_piece_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spare made beside live traffic (``pace_s``) pauses after every ``PACE_BYTES`` piece instead
    of holding a core for the whole segment, and still allocates every page (a full /dev/shm is a
    RingError, not a SIGBUS later); a piece that fails leaves no name and no mapping behind."""
    import protocol.shm as shm_mod

    pauses: list[float] = []
    monkeypatch.setattr(shm_mod.time, "sleep", pauses.append)
    nbytes = 8 * shm_mod.PACE_BYTES
    ann, mm = create(nbytes, pace_s=0.003)
    try:
        assert pauses == [0.003] * 8  # one pause per piece
        assert os.stat("/dev/shm" + ann.name).st_blocks * 512 >= nbytes  # every page allocated
        ring_mm = open_ring(ann)  # a server maps it as any other
        mm[HEADER_BYTES : HEADER_BYTES + 4] = b"rows"
        assert ring_mm[HEADER_BYTES : HEADER_BYTES + 4] == b"rows"
        ring_mm.close()
    finally:
        mm.close()
        unlink(ann.name)
    pauses.clear()
    calls = []

    def full(fd: int, offset: int, length: int) -> None:
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm_mod.os, "posix_fallocate", full)
    before = _names()
    with pytest.raises(RingError, match="No space left") as e:
        create(nbytes, pace_s=0.003)
    assert "\n" not in str(e.value) and len(pauses) == 2 and _names() == before


def test_sweep_removes_names_of_dead_creators_only() -> None:
    code = "from protocol.shm import create; import os; a, m = create(1 << 16); print(a.name, flush=True); os._exit(0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=os.getcwd())
    name = out.stdout.strip()
    assert os.path.exists("/dev/shm" + name)  # its creator died inside the window
    mine, mm = create(1 << 16)  # creating a ring sweeps first
    try:
        assert not os.path.exists("/dev/shm" + name)
        assert os.path.exists("/dev/shm" + mine.name)  # a live creator's name stays
        assert name not in sweep_stale()
    finally:
        mm.close()
        unlink(mine.name)


def test_server_holds_a_region_while_any_view_of_it_lives() -> None:
    ring = ClientRing(1 << 16)
    gauge = _Gauge()
    rings = Rings(idle_s=0.01, gauge=gauge)
    assert rings.map(b"c1", b"c1", ring.announce, 1) == ring.name and gauge.value == 1
    assert rings.map(b"c1", b"c1", ring.announce, 2) == ring.name  # a Hello sent twice: the same mapping
    ring.confirm()
    at = ring.put([np.arange(64, dtype=np.uint16).reshape(2, 32)])
    assert at is not None
    region = rings.rows(b"c1", b"c1", at, 3)
    view = region.view(np.uint16).reshape(2, 32)[1:]  # what the engine keeps: a slice of a view
    del region
    assert rings.ack(b"c1") == RingAck(ring.name, 1, (1,))
    with pytest.raises(ProtocolError) as e:  # another connection cannot read it
        rings.rows(b"c2", b"c2", at, 4)
    assert e.value.code == ErrorCode.TRANSPORT
    rings.sweep(1e12)
    assert gauge.value == 1  # still read: not unmapped
    assert int(view[0, 0]) == 32
    del view
    assert rings.ack(b"c1") == RingAck(ring.name, 1, ())
    rings._last_sweep = 0.0
    rings.sweep(1e12)
    assert gauge.value == 0 and rings.ack(b"c1") is None
    ring.close()


def test_the_server_unmaps_a_ring_off_its_io_thread_once_no_region_is_read() -> None:
    """A dead client's ring (idle past the TTL) is page-unlocked (a device-wide sync) and unmapped
    (the last mapping frees its pages: 15-20 ms for 64 MiB) on a thread of its own, never on the I/O
    thread that serves every other client; the table and the gauge let go of it at once. At the
    server's stop it is done there and then."""
    ring = ClientRing(1 << 16)
    unpinned: list[str] = []
    gauge = _Gauge()
    rings = Rings(0.01, gauge, pin=lambda mv: True, unpin=lambda mv: unpinned.append(threading.current_thread().name))
    rings.map(b"c1", b"c1", ring.announce, 1)
    ring.confirm()
    mapped = rings._by_ident[b"c1"][ring.name]
    at = ring.put([np.arange(64, dtype=np.uint16).reshape(2, 32)])
    assert at is not None
    region = rings.rows(b"c1", b"c1", at, 2)
    rings.sweep(1e12)
    assert gauge.value == 1 and not mapped.mm.closed and unpinned == []  # a region is read: kept
    del region
    rings._last_sweep = 0.0
    rings.sweep(1e12)
    assert gauge.value == 0 and rings.ack(b"c1") is None  # gone from the table at once
    assert _eventually(lambda: mapped.mm.closed)
    assert unpinned == ["draft-server-ring-unmap"]
    other = ClientRing(1 << 16)
    rings.map(b"c2", b"c2", other.announce, 3)  # the server's stop unmaps it here
    again = rings._by_ident[b"c2"][other.name]
    rings.close()
    assert again.mm.closed and unpinned[1:] == [threading.current_thread().name]
    ring.close()
    other.close()


def test_validate_step_reads_rows_from_where_rows_at_says() -> None:
    w = CHECKSUM_CONTRACT.tap_width
    rows = np.arange(2 * w, dtype=np.uint16).reshape(2, w)
    at = RowsAt("/r", 4096, rows.nbytes, 1)
    entry = (StepEntry("s", 0, 2, 1, 2),)
    step = Step(1, 100.0, entry, TensorSpec(DType.BF16, (2, w), -1), rows_at=at)
    taps, errors = validate_step(step, [], CHECKSUM_CONTRACT, LIMITS, locate=lambda a: rows.view(np.uint8).ravel())
    assert errors == [None] and np.array_equal(taps, rows) and not taps.flags.writeable
    for bad, code, words in (
        (step, ErrorCode.TRANSPORT, "maps no shared-memory ring"),  # no locate: this server maps none
        (Step(1, 100.0, entry, TensorSpec(DType.BF16, (2, w), 0), rows_at=at), ErrorCode.BAD_FRAMES, "no frame"),
        (
            Step(1, 100.0, entry, TensorSpec(DType.BF16, (2, w), -1), rows_at=RowsAt("/r", 4096, 8, 1)),
            ErrorCode.BAD_FRAMES,
            "8 bytes",
        ),
    ):
        with pytest.raises(ProtocolError) as e:
            validate_step(bad, [], CHECKSUM_CONTRACT, LIMITS, locate=None if bad is step else (lambda a: rows))
        assert e.value.code == code and words in e.value.message


def _welcome(transports: tuple[str, ...] = ("frames",), ring: str = "") -> Welcome:
    return Welcome(
        1, 1, "e", CHECKSUM_CONTRACT, CHECKSUM_CONTRACT.fingerprint(), LIMITS, transports=transports, ring=ring
    )


def test_handshake_refuses_or_falls_back_in_one_line() -> None:
    strict = Handshake(ClientConfig("ipc:///x", transport="shm", shm_ring_mib=1), Counters(None))
    hello = strict.hello(1)
    assert hello.ring is not None and strict.ring is not None and _names()
    message, fields = strict.check(_welcome())  # a server without shm (or one that predates it)
    assert fields == ("transport",) and "\n" not in message
    assert message.endswith("transport 'shm' refused: server accepts frames"), message
    assert strict.refuse(message, 0.0, fields) is True and strict.refused == message
    assert strict.ring is None and not _names()  # refused: the name is gone
    assert strict._c.m.refusals.labels("transport")._value.get() >= 1

    auto = Handshake(ClientConfig("ipc:///x", transport="auto", shm_ring_mib=1), Counters(None))
    assert auto.hello(1).ring is not None
    assert (
        auto.refuse("draft server ipc:///x refused the handshake: transport 'shm' refused", 0.0, ("transport",))
        is False
    )
    assert auto.refused is None and auto.shm_off and auto.hello_due and auto.hello(2).ring is None
    assert auto.check(_welcome()) is None  # frames from now on

    ok = Handshake(ClientConfig("ipc:///x", transport="shm", shm_ring_mib=1), Counters(None))
    name = ok.hello(1).ring.name  # type: ignore[union-attr]
    w = _welcome(("frames", "shm"), name)
    assert ok.check(w) is None
    ok.accept(w)
    assert ok.rows_ring is ok.ring and not _names()  # confirmed: unlinked, only the mappings hold it
    assert ok.rehello() and ok.hello(2).ring.name != name  # type: ignore[union-attr]  # a lost ring: a new one
    ok.drop_ring()
    assert not _names()


def test_client_config_checks_its_transport() -> None:
    with pytest.raises(ValueError, match="transport must be one of frames, shm, auto"):
        ClientConfig("ipc:///x", transport="cuda")
    with pytest.raises(ValueError, match="shm_ring_mib"):
        ClientConfig("ipc:///x", transport="shm", shm_ring_mib=0)


def test_an_ack_built_while_a_region_is_looked_up_never_frees_it(monkeypatch) -> None:
    """The I/O thread looks up a Step's region while the engine thread builds a reply's ack for the
    same connection: the ack must not name the region's generation as seen before it is held (the
    client would write that region again before the server read it)."""
    import draft_server.io.rings as rings_mod

    ring = ClientRing(1 << 16)
    rings = Rings(idle_s=60.0, gauge=_Gauge())
    rings.map(b"c1", b"c1", ring.announce, 1)
    ring.confirm()
    at = ring.put([np.arange(64, dtype=np.uint16).reshape(2, 32)])
    assert at is not None
    inside, go = threading.Event(), threading.Event()

    def slow_region_rows(mm, where):  # the lookup, held up halfway
        inside.set()
        assert go.wait(5)
        return region_rows(mm, where)

    monkeypatch.setattr(rings_mod, "region_rows", slow_region_rows)
    got: list = []
    t = threading.Thread(target=lambda: got.append(rings.rows(b"c1", b"c1", at, 2)))
    t.start()
    assert inside.wait(5)
    ack = rings.ack(b"c1")  # the engine thread's reply, meanwhile
    go.set()
    t.join(5)
    assert ack is not None and (ack.seen < at.generation or at.generation in ack.held), ack
    assert rings.ack(b"c1") == RingAck(ring.name, at.generation, (at.generation,))  # held once looked up
    got.clear()
    ring.close()


def test_a_spare_ring_is_made_once_taken_once_and_not_retried_without_room(monkeypatch) -> None:
    """``Handshake.prepare_spare`` (a step missed): one spare however often it is asked, named by the
    next Hello; kept while steps miss now and then, dropped once none has for ``SPARE_KEEP_S``; and
    where /dev/shm has no room for it, one warning and no further tries until a new ring is mapped
    (not a 64 MiB attempt per missed step)."""
    import target_client.client.handshake as hs_mod

    hs = Handshake(ClientConfig("ipc:///x", transport="shm", shm_ring_mib=1), Counters(None))
    name = hs.hello(1).ring.name  # type: ignore[union-attr]
    hs.accept(_welcome(("frames", "shm"), name))
    made: list[int] = []
    paces: list[float] = []
    real = hs_mod.ClientRing

    def counting(nbytes: int, pace_s: float = 0.0) -> ClientRing:
        made.append(nbytes)
        paces.append(pace_s)
        return real(nbytes, pace_s)

    monkeypatch.setattr(hs_mod, "ClientRing", counting)
    for _ in range(3):
        hs.prepare_spare(time.monotonic())
    deadline = time.monotonic() + 5
    while hs._spare is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(made) == 1 and len(_names()) == 1  # one spare, named in /dev/shm until used
    assert len(paces) == 1 and paces[0]() == hs_mod.SPARE_PACE_S > 0  # made a piece at a time, beside traffic
    spare = hs._spare
    assert hs.rehello() and hs.hello(2).ring == spare.announce and hs.spares_used == 1  # type: ignore[union-attr]  # the Hello names it
    hs.accept(_welcome(("frames", "shm"), spare.name))  # type: ignore[union-attr]
    assert not _names()

    missed = time.monotonic()
    hs.prepare_spare(missed)
    while hs._spare is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(made) == 2 and len(_names()) == 1
    hs.drop_spare(missed + hs_mod.SPARE_KEEP_S / 2)  # answered in time on the same ring, soon after the miss
    assert hs._spare is not None and len(_names()) == 1  # kept: a server that misses again finds it
    hs.prepare_spare(missed + hs_mod.SPARE_KEEP_S / 2)  # missed again: the same spare, none made
    assert len(made) == 2
    hs.drop_spare(missed + hs_mod.SPARE_KEEP_S)  # answered in time, the last miss SPARE_KEEP_S / 2 ago
    assert hs._spare is not None
    hs.drop_spare(missed + 1.5 * hs_mod.SPARE_KEEP_S)
    assert hs._spare is None and not _names()

    def no_room(nbytes: int, pace_s: float = 0.0) -> ClientRing:
        made.append(nbytes)
        raise RingError("no room")

    monkeypatch.setattr(hs_mod, "ClientRing", no_room)
    hs.prepare_spare(time.monotonic())
    while hs._spare_wanted and time.monotonic() < deadline:
        time.sleep(0.005)
    for _ in range(3):
        hs.prepare_spare(time.monotonic())
    time.sleep(0.05)
    assert len(made) == 3 and hs._spare is None  # tried once
    hs.drop_ring(closing=True)
