"""Rogue clients for draft-soak: fuzz, malformed and oversized frames, vanishing clients, floods.

Owns the misbehaving peers the soak points at a draft server, each a bare DEALER with its own
routing id (so a correct server keeps every effect inside that id's sessions):

* ``fuzz_messages``: a seeded generator of hostile messages: structurally valid headers with
  hostile values (negative or huge positions, row counts that disagree with the frames, wrong
  dtypes and shapes, NaN budgets, unknown kinds, bad versions) and byte-level mutations of a
  valid Step (flips, truncations, splices, dropped or duplicated frames, random bytes);
* ``run_fuzz``: a process entry that sends N of those at a fixed rate (the decoder fuzz);
* ``malformed_burst``, ``oversized``: a burst of the above, and frames over the server's
  MAXMSGSIZE and over its row / entry limits;
* ``vanish``: a client that opens sessions and disconnects without Free (TTL must reclaim them);
* ``flood``: one Step with more sessions than the server's capacity, then Free.

Replies are drained without waiting on them; every receive has a deadline. Needs protocol/
and numpy only.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import zmq

from protocol import (
    PROTOCOL_VERSION,
    DType,
    Free,
    Hello,
    ModelContract,
    Ping,
    Sampling,
    ServerLimits,
    Step,
    StepEntry,
    StepResult,
    TensorSpec,
    Welcome,
    decode_reply,
    encode,
    spec_for,
)

_raw = msgspec.msgpack.Encoder()


class Peer:
    """A bare DEALER with its own routing id; replies are read with deadlines only."""

    def __init__(self, endpoint: str, name: str = "rogue") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 10000)
        self.sock.setsockopt(zmq.ROUTING_ID, f"{name}-{uuid.uuid4().hex[:8]}".encode())
        self.sock.connect(endpoint)
        self.call_id = 0

    def send(self, frames: list[Any]) -> bool:
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError:
            return False

    def drain(self) -> int:
        n = 0
        while self.sock.poll(0):
            self.sock.recv_multipart()
            n += 1
        return n

    def call(self, msg: Any, payloads: list[Any] | None = None, timeout_s: float = 5.0) -> Any:
        """Send a message with a call id and wait (bounded) for the reply carrying it; None on timeout."""
        self.send(encode(msg, payloads or []))
        want = getattr(msg, "call_id", None)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                return None
            try:
                reply = decode_reply(self.sock.recv_multipart()[0])
            except Exception:
                continue
            if getattr(reply, "call_id", None) == want:
                return reply
        return None

    def hello(self, timeout_s: float = 5.0) -> Welcome | None:
        self.call_id += 1
        r = self.call(Hello(PROTOCOL_VERSION, "rogue", self.call_id), timeout_s=timeout_s)
        return r if isinstance(r, Welcome) else None

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


# ---------------------------------------------------------------------------- the fuzz generator

_HOSTILE_INTS = [0, 1, -1, -3, 7, 40, 2**31, 2**31 - 1, 2**62, 2**63 - 1, -(2**63)]
_HOSTILE_FLOATS = [0.0, -1.0, 1e-9, 50.0, 1e12, float("nan"), float("inf"), -float("inf")]


def _hint(r: random.Random) -> int:
    return r.choice(_HOSTILE_INTS) if r.random() < 0.5 else r.randint(-3, 40)


def _hfloat(r: random.Random) -> float:
    return r.choice(_HOSTILE_FLOATS) if r.random() < 0.5 else r.uniform(-10, 100)


def _text(r: random.Random, max_len: int) -> str:
    n = r.randint(0, max_len)
    return "".join(chr(r.choice([r.randint(32, 126), r.randint(0x80, 0x2FFF)])) for _ in range(n))


def _structured(r: random.Random, width: int) -> list[bytes]:
    kind = r.choice(["step", "step", "step", "hello", "ping", "free", "unknown"])
    cid = _hint(r)
    if kind == "hello":
        return [_raw.encode(Hello(r.randint(-1, 3), _text(r, 20), cid))]
    if kind == "ping":
        return [_raw.encode(Ping(cid))]
    if kind == "free":
        return [_raw.encode(Free(tuple(_text(r, 10) for _ in range(r.randint(0, 5)))))]
    if kind == "unknown":
        return [_raw.encode({"kind": _text(r, 8), "call_id": cid})]
    entries = tuple(
        StepEntry(
            _text(r, 300 if r.random() < 0.1 else 12),
            _hint(r),
            r.randint(-2, 6),
            _hint(r),
            r.randint(-2, 12),
            Sampling(_hfloat(r), r.randint(-2, 40000), _hfloat(r), r.choice([None, _hint(r)]), r.randint(-1, 2000)),
        )
        for _ in range(r.randint(0, 5))
    )
    total = sum(max(e.rows, 0) for e in entries)
    rows = r.choice([total, total, max(total - 1, 0), total + 1])
    w = r.choice([width, width, width - 1, 1])
    dtype = r.choice([DType.BF16, DType.BF16, DType.F32, DType.I64])
    spec = r.choice([TensorSpec(dtype, (rows, w), r.randint(-1, 2)), None])
    payload = bytes(rows * max(w, 0) * 2)
    nframes = r.choice([1, 1, 0, 2])
    return [_raw.encode(Step(cid, _hfloat(r), entries, spec)), *([payload] * nframes)]


def _mutated(r: random.Random, width: int) -> list[bytes]:
    taps = np.arange(2 * width, dtype=np.uint16).reshape(2, width)
    frames = [
        bytes(f) for f in encode(Step(5, 50.0, (StepEntry("m", 0, 2, 1, 3),), spec_for(taps, DType.BF16, 0)), [taps])
    ]
    header = bytearray(frames[0])
    op = r.choice(["flip", "truncate", "splice", "drop", "dup", "random"])
    if op == "flip":
        for _ in range(r.randint(1, 8)):
            header[r.randrange(len(header))] = r.randrange(256)
        return [bytes(header), frames[1]]
    if op == "truncate":
        return [bytes(header[: r.randint(0, len(header))]), frames[1]]
    if op == "splice":
        i = r.randint(0, len(header))
        return [bytes(header[:i]) + r.randbytes(r.randint(0, 16)) + bytes(header[i:]), frames[1]]
    if op == "drop":
        return [frames[0]]
    if op == "dup":
        return [frames[0], frames[1], frames[1]]
    return [r.randbytes(r.randint(0, 64)) for _ in range(r.randint(1, 3))]


def fuzz_messages(seed: int, width: int) -> Iterator[list[bytes]]:
    """An endless seeded stream of hostile multipart messages (half structured, half mutated)."""
    r = random.Random(seed)
    while True:
        yield _structured(r, width) if r.random() < 0.5 else _mutated(r, width)


def malformed_burst(endpoint: str, n: int, seed: int, width: int) -> dict[str, int]:
    """Send ``n`` hostile messages as fast as possible; count the replies that came back."""
    peer = Peer(endpoint, "rogue-malformed")
    sent = replies = 0
    try:
        gen = fuzz_messages(seed, width)
        for _ in range(n):
            sent += peer.send(next(gen))
            replies += peer.drain()
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline and peer.sock.poll(50):
            replies += peer.drain()
    finally:
        peer.close()
    return {"sent": sent, "replies": replies}


def oversized(endpoint: str, max_message_bytes: int, limits: ServerLimits | None, width: int) -> dict[str, int]:
    """A frame over MAXMSGSIZE (the server drops the connection), then Steps over its row and entry limits."""
    out = {"oversized_sent": 0, "too_large_errors": 0}
    big = Peer(endpoint, "rogue-oversized")
    try:
        out["oversized_sent"] = int(big.send([b"\x00" * (max_message_bytes + 1024)]))
    finally:
        big.close()
    if limits is None:
        return out
    peer = Peer(endpoint, "rogue-limits")
    try:
        rows = limits.max_rows_per_step + 1
        if rows * width * 2 <= limits.max_message_bytes // 2:
            taps = np.zeros((rows, width), np.uint16)
            step = Step(1, 50.0, (StepEntry("big", 0, rows, 1, 1),), spec_for(taps, DType.BF16, 0))
            r = peer.call(step, [taps], timeout_s=5.0)
            out["too_large_errors"] += int(getattr(r, "code", None) is not None)
        n = limits.max_entries_per_step + 1
        step = Step(2, 50.0, tuple(StepEntry(f"e{i}", 0, 0, 1, 0) for i in range(n)))
        r = peer.call(step, timeout_s=5.0)
        out["too_large_errors"] += int(getattr(r, "code", None) is not None)
    finally:
        peer.close()
    return out


def _session_step(contract: ModelContract, names: list[str], rows: int, k: int, call_id: int) -> tuple[Step, Any]:
    rng = np.random.default_rng(call_id)
    taps = rng.integers(0, 1 << 14, size=(rows * len(names), contract.tap_width), dtype=np.uint16)
    entries = tuple(StepEntry(n, 0, rows, 1, k) for n in names)
    return Step(call_id, 5000.0, entries, spec_for(taps, contract.tap_dtype, 0)), taps


def vanish(endpoint: str, sessions: int) -> dict[str, int]:
    """Open ``sessions`` sessions, then disconnect without Free. Returns how many were drafted."""
    peer = Peer(endpoint, "rogue-vanish")
    try:
        w = peer.hello()
        if w is None:
            return {"sessions": 0, "ok": 0}
        step, taps = _session_step(w.contract, [f"v{i}" for i in range(sessions)], 4, 1, 7)
        r = peer.call(step, [taps])
        ok = sum(1 for e in r.results if e.status == 0) if isinstance(r, StepResult) else 0
        return {"sessions": sessions, "ok": ok}
    finally:
        peer.close()  # no Free: the server's TTL must reclaim them


def flood(endpoint: str, sessions: int) -> dict[str, int]:
    """One Step with ``sessions`` new sessions (more than capacity), then Free them all."""
    peer = Peer(endpoint, "rogue-flood")
    try:
        w = peer.hello()
        if w is None:
            return {"sessions": 0, "ok": 0, "overloaded": 0}
        names = [f"f{i}" for i in range(min(sessions, w.limits.max_entries_per_step))]
        step, taps = _session_step(w.contract, names, 1, 1, 11)
        r = peer.call(step, [taps], timeout_s=10.0)
        res = r.results if isinstance(r, StepResult) else ()
        peer.send(encode(Free(tuple(names))))
        time.sleep(0.05)  # let the Free leave before LINGER 0 closes the socket
        return {
            "sessions": len(names),
            "ok": sum(1 for e in res if e.status == 0),
            "overloaded": sum(1 for e in res if e.status == 1),
        }
    finally:
        peer.close()


# ------------------------------------------------------------------------- noisy neighbours
# Clients that behave badly toward others without breaking the protocol. Each returns counts.


def _bf16(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    return (rng.standard_normal((rows, width), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def session_flood(endpoint: str, sessions: int, per_step: int = 64) -> dict[str, int]:
    """Open ``sessions`` new sessions in steps of ``per_step`` without waiting, then Free them all."""
    peer = Peer(endpoint, "rogue-sflood")
    try:
        w = peer.hello()
        if w is None:
            return {"sessions": 0}
        rng = np.random.default_rng(sessions)
        names = [f"sf{i}" for i in range(sessions)]
        for a in range(0, sessions, per_step):
            part = names[a : a + per_step]
            taps = _bf16(rng, len(part), w.contract.tap_width)
            peer.call_id += 1
            step = Step(
                peer.call_id, 2000.0, tuple(StepEntry(n, 0, 1, 1, 1) for n in part), spec_for(taps, DType.BF16, 0)
            )
            peer.send(encode(step, [taps]))
        time.sleep(0.5)
        answered = peer.drain()
        peer.send(encode(Free(tuple(names))))
        time.sleep(0.05)
        return {"sessions": sessions, "replies": answered}
    finally:
        peer.close()


def row_flood(endpoint: str, steps: int, rows: int) -> dict[str, int]:
    """Queue ``steps`` ingest-only steps of ``rows`` rows each without waiting, then Free."""
    peer = Peer(endpoint, "rogue-rflood")
    try:
        w = peer.hello()
        if w is None:
            return {"steps": 0}
        taps = _bf16(np.random.default_rng(rows), rows, w.contract.tap_width)
        for i in range(steps):
            peer.call_id += 1
            peer.send(
                encode(
                    Step(peer.call_id, 2000.0, (StepEntry(f"rf{i}", 0, rows, 1, 0),), spec_for(taps, DType.BF16, 0)),
                    [taps],
                )
            )
        overloaded = ok = 0
        deadline = time.monotonic() + 2.0
        got = 0
        while got < steps and time.monotonic() < deadline:
            if not peer.sock.poll(200):
                continue
            try:
                r = decode_reply(peer.sock.recv_multipart()[0])
            except Exception:
                continue
            if isinstance(r, StepResult):
                got += 1
                overloaded += sum(1 for e in r.results if e.status == 1)
                ok += sum(1 for e in r.results if e.status == 0)
        peer.send(encode(Free(tuple(f"rf{i}" for i in range(steps)))))
        time.sleep(0.05)
        return {"steps": steps, "rows": rows, "ok": ok, "overloaded": overloaded}
    finally:
        peer.close()


def nan_taps(endpoint: str, sessions: int) -> dict[str, int]:
    """Sessions whose taps hold NaN and Inf, drafting like everyone else; then Free."""
    peer = Peer(endpoint, "rogue-nan")
    try:
        w = peer.hello()
        if w is None:
            return {"sessions": 0}
        rng = np.random.default_rng(sessions + 1)
        names = [f"nan{i}" for i in range(sessions)]
        taps = _bf16(rng, 8 * sessions, w.contract.tap_width)
        taps[::2, ::3] = 0x7FC0  # NaN
        taps[1::2, ::5] = 0x7F80  # +Inf
        peer.call_id += 1
        step = Step(peer.call_id, 2000.0, tuple(StepEntry(n, 0, 8, 1, 2) for n in names), spec_for(taps, DType.BF16, 0))
        r = peer.call(step, [taps])
        peer.send(encode(Free(tuple(names))))
        time.sleep(0.05)
        res = r.results if isinstance(r, StepResult) else ()
        return {"sessions": sessions, "answered": len(res)}
    finally:
        peer.close()


def hijack(endpoint: str, routing_id: bytes, session_prefix: str, sessions: int) -> dict[str, int]:
    """Connect with another client's routing id and try to Free and overwrite its sessions.

    The server must refuse the connection (its sessions belong to the first one): no reply comes."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(endpoint)
    try:
        time.sleep(0.2)
        names = tuple(f"{session_prefix}{i}" for i in range(sessions))
        step = Step(1, 500.0, tuple(StepEntry(n, 0, 0, 1, 1) for n in names), None)
        try:
            sock.send_multipart(encode(Free(names)), zmq.NOBLOCK)
            sock.send_multipart(encode(step), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        answered = 1 if sock.poll(1000) else 0
        return {"sessions": sessions, "answered": answered}
    finally:
        sock.close(0)
        ctx.term()


def stale_storm(endpoint: str, steps: int) -> dict[str, int]:
    """Steps whose sender's clock says they were sent 10 s ago: all must expire unread."""
    peer = Peer(endpoint, "rogue-stale")
    try:
        w = peer.hello()
        if w is None:
            return {"steps": 0}
        taps = _bf16(np.random.default_rng(steps), 1, w.contract.tap_width)
        peer.call_id += 1
        fresh = Step(
            peer.call_id,
            2000.0,
            (StepEntry("st", 0, 1, 1, 0),),
            spec_for(taps, DType.BF16, 0),
            time.monotonic() * 1000.0,
        )
        peer.call(fresh, [taps])  # the connection's fastest delivery
        expired = 0
        for i in range(steps):
            peer.call_id += 1
            old = time.monotonic() * 1000.0 - 10_000.0
            st = Step(peer.call_id, 50.0, (StepEntry("st", 1 + i, 1, 1, 2),), spec_for(taps, DType.BF16, 0), old)
            r = peer.call(st, [taps], timeout_s=0.5)  # answered at once when read: a storm, not a wait
            if r is None:
                break  # the server is away (a kill or a pause of another mode): stop early
            if isinstance(r, StepResult) and r.results[0].status == 2:
                expired += 1
        peer.send(encode(Free(("st",))))
        time.sleep(0.05)
        return {"steps": steps, "expired": expired}
    finally:
        peer.close()


def run_fuzz(endpoint: str, messages: int, rate_per_s: float, seed: int, width: int, stats_path: str) -> None:
    """Process entry: send ``messages`` fuzz messages at ``rate_per_s`` (until SIGTERM), write counts."""
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    peer = Peer(endpoint, "rogue-fuzz")
    gen = fuzz_messages(seed, width)
    sent = replies = send_failures = 0
    t0 = time.monotonic()
    parent = os.getppid()
    try:
        while sent + send_failures < messages and not stop and os.getppid() == parent:
            due = t0 + (sent + send_failures) / rate_per_s
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(min(delay, 0.1))
                continue
            for _ in range(64):  # catch up in small bursts
                if sent + send_failures >= messages or time.monotonic() < t0 + (sent + send_failures) / rate_per_s:
                    break
                if peer.send(next(gen)):
                    sent += 1
                else:
                    send_failures += 1
            replies += peer.drain()
    finally:
        peer.close()
        tmp = stats_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"sent": sent, "replies": replies, "send_failures": send_failures}, f)
        os.replace(tmp, stats_path)
