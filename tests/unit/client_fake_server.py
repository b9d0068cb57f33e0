"""A scripted fake draft server (ZeroMQ ROUTER in a thread) for the DraftClient unit tests.

It speaks the real protocol (protocol.codec / protocol.validate) and keeps positional sessions
per client identity, but what it answers is scripted: per Step a policy returns "ok", "drop",
("delay", seconds), "garbage", "overloaded", "internal", "error", "short" (wrong result
count), "probs" (drafts with confidence and top-2 probability frames) or a dict
{session: "overloaded" | "oov" (its last draft outside the vocabulary) | "extra" (a draft past k)}.
Epoch, contract and contract_id are plain attributes a test may change at any time.
Delayed replies are scheduled, never slept on, so one slow reply never holds up another.
Every request it receives is recorded (Step headers with a copy of their tap frame).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from protocol import (
    PROTOCOL_VERSION,
    DType,
    EntryResult,
    Error,
    ErrorCode,
    Free,
    Hello,
    ModelContract,
    Ping,
    Pong,
    ServerLimits,
    Status,
    Step,
    StepResult,
    Timing,
    Welcome,
    decode_request,
    encode,
    spec_for,
    validate_step,
)

CONTRACT = ModelContract(
    model_name="fake",
    tap_layer_ids=(1, 3),
    target_hidden_size=16,
    vocab_size=1000,
    block_size=8,
    mask_token_id=999,
    tap_dtype=DType.BF16,
)

LIMITS = ServerLimits(
    max_entries_per_step=64,
    max_rows_per_step=4096,
    max_sessions=1024,
    max_queue_rows=1 << 20,
    max_message_bytes=64 << 20,
    max_position=1 << 20,
    max_session_id_bytes=128,
    prefill_chunk_rows=512,
    max_budget_ms=60_000.0,
)


def fake_drafts(session: str, anchor_pos: int, anchor: int, k: int, vocab: int = CONTRACT.vocab_size) -> list[int]:
    """What the fake server drafts: a function of the session, the anchor and its position."""
    h = zlib.crc32(session.encode())
    return [(h + anchor * 31 + anchor_pos * 7 + j * 13) % vocab for j in range(k)]


@dataclass
class Received:
    kind: str
    msg: Any
    taps: np.ndarray | None
    identity: bytes
    at: float


Policy = Callable[[Step, int], Any]


class FakeServer:
    def __init__(
        self,
        port: int | None = None,
        epoch: str = "epoch-1",
        curve_secret: bytes | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.contract = CONTRACT
        self.limits = LIMITS
        self.contract_id: str | None = None  # None: contract.fingerprint()
        self.welcome_version = PROTOCOL_VERSION
        self.features: tuple[str, ...] = ()  # Welcome.features (e.g. FEATURE_EARLY_TAPS)
        self.epoch = epoch
        self.policy: Policy = lambda step, n: "ok"
        self.answer_pings = True
        self.answer_hellos = True
        self.retry_after_ms = 100.0
        self.received: list[Received] = []
        self.sessions: dict[tuple[bytes, str], tuple[int, int]] = {}
        self._steps = 0
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve_secret is not None:
            self.sock.curve_server = True
            self.sock.curve_secretkey = curve_secret
        self.sock.bind(f"tcp://{host}:{port}" if port else f"tcp://{host}:*")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        self._rfd, self._wfd = _pipe()
        self._stop = False
        self._later: list[tuple[float, int, list[bytes]]] = []
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._run, name="fake-draft-server", daemon=True)
        self._thread.start()

    # -- test helpers

    def steps(self) -> list[Received]:
        return [r for r in list(self.received) if r.kind == "step"]

    def count(self, kind: str) -> int:
        return sum(1 for r in list(self.received) if r.kind == kind)

    def forget_sessions(self) -> None:
        self.sessions.clear()

    def stop(self) -> None:
        self._stop = True
        import os

        os.write(self._wfd, b"\0")
        self._thread.join(5)
        self.sock.close(0)
        self._ctx.term()
        os.close(self._rfd)
        os.close(self._wfd)

    # -- the loop

    def _run(self) -> None:
        import os

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._rfd, zmq.POLLIN)
        while not self._stop:
            now = time.monotonic()
            timeout = 200 if not self._later else max(0, int((self._later[0][0] - now) * 1000) + 1)
            events = dict(poller.poll(timeout))
            if self._rfd in events:
                try:
                    os.read(self._rfd, 64)
                except BlockingIOError:
                    pass
            while self._later and self._later[0][0] <= time.monotonic():
                _, _, frames = heapq.heappop(self._later)
                self.sock.send_multipart(frames)
            if events.get(self.sock):
                while True:
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)

    def _send(self, ident: bytes, msg: Any, payloads: list[bytes] | None = None, delay: float = 0.0) -> None:
        frames = [ident, *encode(msg, payloads or [])]
        if delay > 0:
            heapq.heappush(self._later, (time.monotonic() + delay, next(self._seq), [bytes(f) for f in frames]))
        else:
            self.sock.send_multipart(frames)

    def _cid(self) -> str:
        return self.contract_id if self.contract_id is not None else self.contract.fingerprint()

    def _handle(self, frames: list[bytes]) -> None:
        ident, header, payloads = frames[0], frames[1], frames[2:]
        now = time.monotonic()
        msg = decode_request(header)
        if isinstance(msg, Hello):
            self.received.append(Received("hello", msg, None, ident, now))
            if self.answer_hellos:
                welcome = Welcome(
                    self.welcome_version,
                    msg.call_id,
                    self.epoch,
                    self.contract,
                    self._cid(),
                    self.limits,
                    features=self.features,
                )
                self._send(ident, welcome)
        elif isinstance(msg, Ping):
            self.received.append(Received("ping", msg, None, ident, now))
            if self.answer_pings:
                self._send(ident, Pong(msg.call_id, self.epoch, self._cid(), True, len(self.sessions), 0))
        elif isinstance(msg, Free):
            self.received.append(Received("free", msg, None, ident, now))
            for s in msg.sessions:
                self.sessions.pop((ident, s), None)
        elif isinstance(msg, Step):
            taps, errors = validate_step(msg, payloads, self.contract, self.limits)
            assert all(e is None for e in errors), errors
            self.received.append(Received("step", msg, None if taps is None else np.array(taps), ident, now))
            n = self._steps
            self._steps += 1
            action = self.policy(msg, n)
            delay = 0.0
            if isinstance(action, tuple) and action[0] == "delay":
                delay, action = action[1], "ok"
            if action == "drop":
                return
            if action == "garbage":
                self.sock.send_multipart([ident, b"\xc1\xff garbage \x00"])
                return
            if action == "error":
                self._send(ident, Error(msg.call_id, ErrorCode.INTERNAL, "scripted failure", self.epoch), delay=delay)
                return
            results = []
            frames: list[bytes] = []
            for e in msg.entries:
                if action == "overloaded" or (isinstance(action, dict) and action.get(e.session) == "overloaded"):
                    results.append(EntryResult(Status.OVERLOADED, retry_after_ms=self.retry_after_ms))
                    continue
                if action == "internal":
                    results.append(EntryResult(Status.INTERNAL, message="scripted"))
                    continue
                key = (ident, e.session)
                start, end = self.sessions.get(key, (e.pos, e.pos))
                if not start <= e.pos <= end:
                    start = e.pos  # gap or unknown: restart at pos
                end = e.pos + e.rows
                self.sessions[key] = (start, end)
                drafts = tuple(fake_drafts(e.session, end, e.anchor, e.k))
                per = action.get(e.session) if isinstance(action, dict) else None
                if per == "oov" and drafts:  # its last draft outside the vocabulary
                    drafts = (*drafts[:-1], self.contract.vocab_size)
                elif per == "extra":  # one draft more than asked for
                    drafts = (*drafts, 0)
                if action == "probs":  # top-2 probabilities per draft, in two payload frames
                    probs = np.full((e.k, 2), 0.25, np.float32)
                    ids = np.array([[t, (t + 1) % self.contract.vocab_size] for t in drafts], np.int32).reshape(e.k, 2)
                    ps, ids_spec = spec_for(probs, DType.F32, len(frames)), spec_for(ids, DType.I32, len(frames) + 1)
                    frames += [probs.tobytes(), ids.tobytes()]
                    conf = tuple(0.5 for _ in drafts)
                    results.append(EntryResult(Status.OK, drafts, end, confidence=conf, probs=ps, prob_ids=ids_spec))
                    continue
                results.append(EntryResult(Status.OK, drafts=drafts, end=end))
            if action == "short":
                results = results[:-1]
            reply = StepResult(msg.call_id, self.epoch, self._cid(), tuple(results), Timing(0.0, 0.0, 0.0))
            self._send(ident, reply, frames, delay=delay)


def _pipe() -> tuple[int, int]:
    import os

    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w
