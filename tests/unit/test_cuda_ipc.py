"""Transport "cuda_ipc" without a GPU: the messages (``protocol.cuda_ipc``, codec round trips), the
client's region allocator (``target_client.client.regions``), the server's import table
(``draft_server.io.cuda_ipc.CudaBuffers``, over a fake device side), the client's checks of device
rows, and the handshake's refusals.

The bookkeeping is checked against a model with two clients stepping at once, Steps reaching the
server late and interleaved, copies finishing in any order and replies (acks) lost or late: a copy
always reads exactly what the client wrote for that Step, i.e. no region is written again while a
copy of it may still run, and every region comes back in the end.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest

from draft_server.drafters.base import DeviceRows
from draft_server.io.cuda_ipc import MAX_BUFFERS_PER_CONNECTION, CudaBuffers
from protocol import (
    CudaIpcAnnounce,
    ErrorCode,
    Hello,
    ProtocolError,
    RingAck,
    RowsAt,
    Step,
    StepEntry,
    StepResult,
    TensorSpec,
    Timing,
    Welcome,
    decode_reply,
    decode_request,
    encode,
)
from protocol.cuda_ipc import (
    ALIGN,
    CudaIpcError,
    alive,
    buffer_name,
    check_region,
    host_id,
    pid_namespace,
    refusal,
    start_time,
    token_of,
)
from protocol.messages import DType
from target_client import ClientConfig
from target_client.api import StepRequest
from target_client.client.counters import Counters
from target_client.client.handshake import Handshake
from target_client.client.regions import Regions, is_device
from target_client.client.step_builder import fits, prepare
from tests.conftest import CHECKSUM_CONTRACT

LIMITS_ARGS = (64, 4096, 64, 4096, 1 << 26, 1 << 20, 256, 512, 60000.0)


class _Gauge:
    value = 0

    def set(self, v: float) -> None:
        self.value = v


def announce(pid: int | None = None, token: str = "0123456789abcdef", n: int = 0, nbytes: int = 1 << 16, **kw):
    pid = os.getpid() if pid is None else pid
    fields = {
        "name": buffer_name(pid, token, n),
        "nbytes": nbytes,
        "handle": b"\x01" * 64,
        "storage_bytes": nbytes,
        "storage_offset": 0,
        "ref_counter": b"/torch_1_2",
        "ref_counter_offset": 0,
        "events": (b"\x02" * 64,) * 4,
        "device": 0,
        "device_uuid": "GPU-x",
        "host": host_id(),
        "pid": pid,
        "pid_ns": pid_namespace(),
        "start_time": start_time(pid) or 0,
    }
    fields.update(kw)
    return CudaIpcAnnounce(**fields)


# ---------------------------------------------------------------- messages


def test_messages_round_trip_through_the_codec() -> None:
    ann = announce()
    hello = Hello(protocol_version=1, client_name="c", call_id=3, cuda_ipc=ann)
    assert decode_request(encode(hello)[0]) == hello
    assert decode_request(encode(Hello(protocol_version=1, client_name="c"))[0]).cuda_ipc is None  # older clients
    w = Welcome(1, 3, "e", CHECKSUM_CONTRACT, "id", _limits(), transports=("frames", "shm", "cuda_ipc"), ring=ann.name)
    assert decode_reply(encode(w)[0]) == w
    at = RowsAt(ann.name, 4 * ALIGN, 1000, 7)
    step = Step(5, 20.0, (StepEntry("s", 0, 2, 1, 3),), TensorSpec(DType.BF16, (2, 250), -1), rows_at=at)
    assert decode_request(encode(step)[0]) == step
    res = StepResult(5, "e", "id", (), Timing(0.1, 0.2, 0.3), ring=RingAck(ann.name, 7, (6, 7)))
    assert decode_reply(encode(res)[0]) == res


def _limits():
    from protocol import ServerLimits

    return ServerLimits(*LIMITS_ARGS)


def test_refusal_lines_names_and_regions() -> None:
    assert refusal(("frames", "shm", "cuda_ipc"), True, False) is None
    assert refusal(("frames", "shm"), False, False) == (
        "transport 'cuda_ipc' refused: server accepts frames, shm "
        "(the server has no CUDA device: its drafter runs on the CPU)"
    )
    assert refusal(("frames",), True, True).endswith("server accepts frames (the server runs with --no-cuda-ipc)")
    name = buffer_name(12, "0123456789abcdef", 3)
    assert token_of(name) == "0123456789abcdef" and token_of("/dspark-ring-1-00") is None
    assert check_region(RowsAt(name, 2 * ALIGN, 100, 1), 4 * ALIGN) is None
    for bad in (RowsAt(name, 3, 10, 1), RowsAt(name, 3 * ALIGN, ALIGN + 1, 1), RowsAt(name, 0, 10, 0)):
        why = check_region(bad, 4 * ALIGN)
        assert why is not None and "\n" not in why


def test_a_process_is_alive_by_pid_and_start_time() -> None:
    me = os.getpid()
    assert alive(me, start_time(me))  # type: ignore[arg-type]
    assert not alive(me, (start_time(me) or 0) + 1)  # the pid now names another process
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not alive(int(out.stdout), 1)


# ---------------------------------------------------------------- the client's allocator


def test_regions_take_wrap_and_come_back() -> None:
    r = Regions(8 * ALIGN, ALIGN)
    a = r.take(3 * ALIGN - 5)
    b = r.take(4 * ALIGN)
    assert a == (1, 0) and b == (2, 3 * ALIGN)
    assert r.take(2 * ALIGN) is None  # 1 free at the end, none before the first
    r.ack(RingAck("x", 1, ()))  # a's copy is done
    assert r.take(2 * ALIGN) == (3, 0)  # wrapped into the front
    r.cancel(3)
    r.ack(RingAck("x", 2, (2,)))  # b still held
    assert r.live == [(2, 3 * ALIGN, 7 * ALIGN)]
    r.reset()  # a new server imports the buffer: nothing of it is read
    assert r.free_bytes == 8 * ALIGN and r.take(0) == (4, 0) and r.generation == 4


@dataclass
class _Copy:
    """A server-side copy of one region, finishing whenever the test says."""

    buf: bytearray
    offset: int
    nbytes: int
    data: bytes | None = None

    def finish(self) -> bytes:
        self.data = bytes(self.buf[self.offset : self.offset + self.nbytes])
        return self.data


class FakeImporter:
    """The device side of CudaBuffers over host bytearrays ("device memory" of each fake client)."""

    def __init__(self, memory: dict[str, bytearray]) -> None:
        self.memory = memory  # token -> the client's buffer
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.settles = 0
        self.fail: str | None = None

    def open(self, ann: CudaIpcAnnounce) -> tuple[str, bytearray]:
        if self.fail:
            raise CudaIpcError(self.fail)
        self.opened.append(ann.name)
        return ann.name, self.memory[token_of(ann.name)]  # type: ignore[index]

    def copy(self, handle, at: RowsAt, spec: TensorSpec):
        c = _Copy(handle[1], at.offset, at.nbytes)
        return DeviceRows(c, c), c

    def done(self, marker: _Copy) -> bool:
        return marker.data is not None

    def settle(self) -> None:
        self.settles += 1

    def close(self, handle) -> None:
        self.closed.append(handle[0])

    def where(self, ann: CudaIpcAnnounce) -> str:
        return "fake"


class FakeClient:
    """One client: its buffer, its allocator, what it wrote per generation."""

    def __init__(self, i: int, memory: dict[str, bytearray], size: int) -> None:
        self.ident = f"c{i}".encode()
        self.token = f"{i:016x}"
        self.buf = memory[self.token] = bytearray(size)
        self.regions = Regions(size, ALIGN)
        self.ann = announce(token=self.token, nbytes=size)
        self.wrote: dict[int, bytes] = {}

    def put(self, rnd: random.Random) -> RowsAt | None:
        data = rnd.randbytes(rnd.choice([16, 300, 2000, 5000]))
        got = self.regions.take(len(data))
        if got is None:
            return None  # a frame instead
        gen, off = got
        self.buf[off : off + len(data)] = data
        self.wrote[gen] = data
        return RowsAt(self.ann.name, off, len(data), gen)


def test_two_clients_staggered_never_overwrite_a_region_a_copy_still_reads() -> None:
    rnd = random.Random(11)
    memory: dict[str, bytearray] = {}
    imp = FakeImporter(memory)
    gauge = _Gauge()
    table = CudaBuffers(imp, idle_s=1e9, gauge=gauge)
    clients = [FakeClient(i, memory, 16 * 1024) for i in range(3)]
    for c in clients:
        assert table.map(c.ident, c.ident, c.ann, 1) == c.ann.name
    assert gauge.value == 3
    in_flight: dict[bytes, list[RowsAt]] = {c.ident: [] for c in clients}  # Steps on the wire, per connection
    copies: list[tuple[FakeClient, int, _Copy]] = []
    replies: list[tuple[FakeClient, RingAck]] = []  # acks on their way back
    checked = fallbacks = 0
    spec = TensorSpec(DType.U8, (1, 1), -1)
    for _ in range(20000):
        c = rnd.choice(clients)
        roll = rnd.random()
        if roll < 0.3:  # the client steps: rows into a region (or a frame), the Step goes out
            at = c.put(rnd)
            if at is None:
                fallbacks += 1
            elif rnd.random() < 0.97:
                in_flight[c.ident].append(at)
            else:
                c.regions.cancel(at.generation)  # the send failed: never sent
        elif roll < 0.5 and in_flight[c.ident]:  # the server reads that connection's oldest Step
            at = in_flight[c.ident].pop(0)
            rows = table.rows(c.ident, c.ident, at, spec, 2)
            copies.append((c, at.generation, rows.t))
        elif roll < 0.7 and copies:  # some copy finishes (any order)
            who, gen, copy = copies.pop(rnd.randrange(len(copies)))
            assert copy.finish() == who.wrote[gen], f"{who.ident!r} generation {gen} was rewritten under its copy"
            checked += 1
        elif roll < 0.85:  # the server answers something on this connection: its ack rides along
            ack = table.ack(c.ident)
            assert ack is not None
            if rnd.random() < 0.8:  # else the reply is lost
                replies.append((c, ack))
        elif replies:  # a reply arrives (late, out of order across connections)
            who, ack = replies.pop(rnd.randrange(len(replies)))
            who.regions.ack(ack)
    assert checked > 1000 and fallbacks > 0
    for who, gen, copy in copies:  # the rest finish
        assert copy.finish() == who.wrote[gen]
    for c in clients:
        for at in in_flight[c.ident]:
            table.rows(c.ident, c.ident, at, spec, 3).t.finish()
        c.regions.ack(table.ack(c.ident))  # type: ignore[arg-type]
        assert c.regions.free_bytes == c.regions.size  # everything came back


def test_table_refuses_releases_and_renames() -> None:
    memory: dict[str, bytearray] = {"0123456789abcdef": bytearray(1 << 16), "fedcba9876543210": bytearray(1 << 16)}
    imp = FakeImporter(memory)
    gauge = _Gauge()
    table = CudaBuffers(imp, idle_s=1e9, gauge=gauge)
    spec = TensorSpec(DType.U8, (1, 16), -1)
    for ann, words in (
        (announce(host="another-boot-id"), "another host"),
        (announce(name="/dspark-ring-1-0000000000000000"), "not a CUDA IPC buffer name"),
        (announce(events=()), "events"),
    ):
        with pytest.raises(ProtocolError) as e:
            table.map(b"c", b"c", ann, 1)
        assert e.value.code == ErrorCode.TRANSPORT and words in e.value.message and "\n" not in e.value.message
        assert e.value.message.startswith("transport 'cuda_ipc' refused: ")
    imp.fail = "cannot open CUDA IPC buffer x: invalid resource handle (the client is on another host, ...)"
    with pytest.raises(ProtocolError, match="refused: cannot open CUDA IPC buffer x: invalid resource handle"):
        table.map(b"c", b"c", announce(), 1)
    imp.fail = None
    assert len(table) == 0 and gauge.value == 0

    a0 = announce()
    assert table.map(b"c", b"c", a0, 1) == a0.name and table.map(b"c", b"c", a0, 2) == a0.name  # twice: one import
    assert imp.opened == [a0.name]
    with pytest.raises(ProtocolError) as e:  # another connection cannot read it
        table.rows(b"d", b"d", RowsAt(a0.name, 0, 16, 1), spec, 3)
    assert e.value.code == ErrorCode.TRANSPORT and "send a Hello" in e.value.message
    with pytest.raises(ProtocolError) as e:
        table.rows(b"c", b"c", RowsAt(a0.name, 1 << 16, 16, 1), spec, 3)
    assert e.value.code == ErrorCode.BAD_FRAMES
    rows = table.rows(b"c", b"c", RowsAt(a0.name, 0, 16, 1), spec, 4)
    assert table.ack(b"c") == RingAck(a0.name, 1, (1,))
    rows.t.finish()
    assert table.ack(b"c") == RingAck(a0.name, 1, ())

    a1 = announce(n=1)  # the same buffer named anew (a re-Hello): copies settle, the old name goes at once
    assert table.map(b"c", b"c", a1, 5) == a1.name and imp.settles == 1
    assert imp.closed == [a0.name] and len(table) == 1 and table.ack(b"c").ring == a1.name  # type: ignore[union-attr]
    other = announce(token="fedcba9876543210")  # a second buffer on the connection: kept up to the limit
    table.map(b"c", b"c", other, 6)
    assert len(table) == min(2, MAX_BUFFERS_PER_CONNECTION)
    table.close()
    assert len(table) == 0 and gauge.value == 0 and set(imp.closed) == {a0.name, a1.name, other.name}


def test_sweep_releases_the_buffer_of_a_gone_process_once_its_copies_are_done() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        st = None
        while st is None:
            st = start_time(proc.pid)
        token = "00000000000000aa"
        memory = {token: bytearray(1 << 16)}
        imp = FakeImporter(memory)
        gauge = _Gauge()
        table = CudaBuffers(imp, idle_s=1e9, gauge=gauge)
        ann = announce(pid=proc.pid, token=token)
        table.map(b"p", b"p", ann, 1)
        idle = announce(pid=proc.pid, token="00000000000000bb", pid_ns="pid:[0]")  # another namespace: TTL only
        memory["00000000000000bb"] = bytearray(1 << 16)
        table.map(b"q", b"q", idle, 1)
        rows = table.rows(b"p", b"p", RowsAt(ann.name, 0, 64, 1), TensorSpec(DType.U8, (1, 64), -1), 2)
        table.sweep(1e12 * 0)  # too early: no sweep yet
        proc.kill()
        proc.wait()
        table._last_sweep = 0.0
        table.sweep(1.0)
        assert len(table) == 2 and not imp.closed  # its copy still reads the buffer
        rows.t.finish()
        table._last_sweep = 0.0
        table.sweep(2.0)
        assert imp.closed == [ann.name] and len(table) == 1 and gauge.value == 1
        table._last_sweep = 0.0
        table.sweep(table._by_ident[b"q"][idle.name].used + 2e9)  # past the TTL
        assert len(table) == 0 and gauge.value == 0
    finally:
        proc.kill()


# ---------------------------------------------------------------- the client's side


class FakeCudaTensor:
    """Quacks like a torch CUDA tensor for the client's checks (no torch needed)."""

    __module__ = "torch.fake"

    def __init__(self, shape: tuple[int, int], dtype: str = "torch.bfloat16", contiguous: bool = True) -> None:
        self.shape, self.dtype, self._contiguous = shape, dtype, contiguous
        self.is_cuda = True
        self.nbytes = shape[0] * shape[1] * 2

    def dim(self) -> int:
        return len(self.shape)

    def is_contiguous(self) -> bool:
        return self._contiguous

    def __len__(self) -> int:
        return self.shape[0]


def test_device_rows_are_checked_like_host_rows() -> None:
    w = CHECKSUM_CONTRACT.tap_width
    reqs = [StepRequest("s", 0, 2, 1, 3)]
    layout = (DType.BF16, w)
    t = FakeCudaTensor((2, w))
    assert is_device(t) and not is_device(np.zeros(2))
    with pytest.raises(ValueError, match="transport 'cuda_ipc'"):
        prepare(reqs, t, CHECKSUM_CONTRACT, None, layout)
    assert prepare(reqs, t, CHECKSUM_CONTRACT, None, layout, device_ok=True)[1] is t
    assert fits(t, layout) and not fits(FakeCudaTensor((2, w), "torch.float32"), layout)
    for bad, words in (
        (FakeCudaTensor((3, w)), "requests announce 2 rows"),
        (FakeCudaTensor((2, w), contiguous=False), "contiguous"),
        (FakeCudaTensor((2, w), "torch.float32"), "does not carry bf16"),
        (FakeCudaTensor((2, w + 1)), "width"),
    ):
        with pytest.raises(ValueError, match=words):
            prepare(reqs, bad, CHECKSUM_CONTRACT, None, layout, device_ok=True)


def test_client_config_takes_cuda_ipc() -> None:
    cfg = ClientConfig("ipc:///x", transport="cuda_ipc", cuda_ipc_mib=8, cuda_device=1)
    assert cfg.transport == "cuda_ipc"
    with pytest.raises(ValueError, match="cuda_ipc_mib"):
        ClientConfig("ipc:///x", transport="cuda_ipc", cuda_ipc_mib=0)
    with pytest.raises(ValueError, match="cuda_device"):
        ClientConfig("ipc:///x", transport="cuda_ipc", cuda_device=-2)


class FakeCudaRing:
    """target_client.cuda.ipc.CudaRing without a GPU (the handshake only needs its naming)."""

    made = 0

    def __init__(self, device, nbytes: int) -> None:
        FakeCudaRing.made += 1
        self.token, self.n, self.nbytes = "feedfacefeedface", 0, nbytes
        self.announce = announce(token=self.token, nbytes=nbytes)
        self.name = self.announce.name
        self.mapped = False
        self.closed = False

    def reannounce(self) -> None:
        self.n += 1
        self.announce = announce(token=self.token, n=self.n, nbytes=self.nbytes)
        self.name = self.announce.name
        self.mapped = False

    def confirm(self) -> None:
        self.mapped = True

    def close(self) -> None:
        self.closed = True


def _welcome(transports=("frames",), ring: str = "") -> Welcome:
    fp = CHECKSUM_CONTRACT.fingerprint()
    return Welcome(1, 1, "e", CHECKSUM_CONTRACT, fp, _limits(), transports=transports, ring=ring)


def test_handshake_without_cuda_refuses_in_one_line() -> None:
    hs = Handshake(ClientConfig("ipc:///x", transport="cuda_ipc"), Counters(None), device=None)
    hello = hs.hello(1)
    assert hello.cuda_ipc is None and hello.ring is None and hs.ring is None  # nothing to announce
    message, fields = hs.check(_welcome(("frames", "shm")))
    assert fields == ("transport",) and "\n" not in message
    assert "transport 'cuda_ipc' refused: this process has no CUDA device" in message, message
    assert hs.refuse(message, 0.0, fields) is True and hs.refused == message
    assert hs._c.m.refusals.labels("transport")._value.get() >= 1


def test_handshake_names_one_buffer_anew_and_keeps_it(monkeypatch) -> None:
    import target_client.cuda.ipc as ipc

    monkeypatch.setattr(ipc, "CudaRing", FakeCudaRing)
    FakeCudaRing.made = 0
    hs = Handshake(ClientConfig("ipc:///x", transport="cuda_ipc"), Counters(None), device=0)
    first = hs.hello(1).cuda_ipc
    assert first is not None and hs.hello(2).cuda_ipc == first  # not imported yet: the same name again
    message, fields = hs.check(_welcome(("frames", "shm")))  # a server without cuda_ipc
    assert fields == ("transport",) and message.endswith("transport 'cuda_ipc' refused: server accepts frames, shm")
    w = _welcome(("frames", "shm", "cuda_ipc"), first.name)
    assert hs.check(w) is None
    hs.accept(w)
    assert hs.rows_ring is hs.ring and hs.ring.mapped  # type: ignore[union-attr]
    assert hs.rehello()  # the server lost it (restart, TTL)
    again = hs.hello(3).cuda_ipc
    assert again is not None and again.name != first.name and token_of(again.name) == token_of(first.name)
    assert hs.rows_ring is None and FakeCudaRing.made == 1  # one device buffer for the client's life
    hs.refuse("draft server x refused the handshake: transport 'cuda_ipc' refused: ...", 0.0, ("transport",))
    assert hs.ring is not None and not hs.ring.closed  # kept through a refusal
    hs.drop_ring(closing=True)
    assert hs.ring is None and FakeCudaRing.made == 1


def test_a_zombie_is_gone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    st = start_time(proc.pid)
    while True:  # exited but not reaped yet: a zombie keeps its /proc entry and start time
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
    assert start_time(proc.pid) == st and not alive(proc.pid, st)  # type: ignore[arg-type]
    proc.wait()
