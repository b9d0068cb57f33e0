"""A fault-injecting ZeroMQ proxy between target clients and a draft server (draft-soak).

Owns ``ChaosProxy``: a ROUTER frontend that clients connect to, and per client routing id one
DEALER backend towards the server that carries the same routing id, so the server still sees
each client as itself (sessions are keyed by client identity) and replies find their way back
by that id. In each direction a seeded fraction of messages is dropped, and a fraction of
requests is held back for ``delay_ms`` before it is forwarded (a delayed engine step). Every
drop and delay is logged with its monotonic time and routing id, so the soak can tell which
calls a fault touched. Backends use IMMEDIATE and a 10 ms reconnect interval: a request the
backend cannot take (a new backend still connecting, the server down) is retried for
``hold_unroutable_ms`` (20 ms), then dropped and counted as ``unroutable``, never queued long
and delivered stale. Besides, a fraction ``phase_drop_p`` of the Steps whose entries are of one of
``phases`` (``protocol.Phase`` names: "taps", "commit") is dropped: the faults between an early
Taps and its Commit.

Direct links (``protocol.direct``) go through the proxy too: a Welcome that offers one is rewritten
to name the proxy's own listener (the token kept), and a client that connects there is relayed
datagram by datagram to the server's link, with the same drops, delays and phase drops each way as
its ZeroMQ messages (a request delayed on a link goes out on that link, in its turn).

The soak runs its proxies in a process of their own (``draft_tools.soak.run.run_proxies``), so
their work never competes with a client's GIL; SIGTERM stops them and their counters and event
log are written as JSON.
"""

from __future__ import annotations

import heapq
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from protocol import ProtocolError, Step, Welcome, decode_reply, decode_request, direct, encode


@dataclass
class ProxyConfig:
    frontend: str  # endpoint the proxy binds for clients
    backend: str  # the draft server's endpoint
    drop_request_p: float = 0.0
    drop_reply_p: float = 0.0
    delay_p: float = 0.0  # fraction of Step requests held back
    delay_ms: float = 0.0
    seed: int = 0
    only_steps: bool = False  # drop/delay only Step requests and their replies (not Hello/Ping/Free)
    hold_unroutable_ms: float = 20.0  # retry a request the backend cannot take yet for this long
    phases: tuple[str, ...] = ()  # e.g. ("taps", "commit"): Steps of these phases ...
    phase_drop_p: float = 0.0  # ... are dropped at this rate (on top of drop_request_p)


@dataclass
class ProxyStats:
    forwarded_requests: int = 0
    forwarded_replies: int = 0
    dropped_requests: int = 0
    dropped_replies: int = 0
    delayed_requests: int = 0
    unroutable: int = 0  # requests the backend could not take (server down): dropped
    reply_send_failures: int = 0
    events: list[tuple[float, str, str]] = field(default_factory=list)  # (monotonic t, kind, routing id)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["events"] = [list(e) for e in self.events]
        return d


_STEP_TAG = b"\xa4kind\xa4step"  # msgpack: the kind tag of a Step header (msgspec writes the tag first)
_RESULT_TAG = b"\xa4kind\xa6result"  # ... and of a StepResult


def _is_step(header: bytes) -> bool:
    return _STEP_TAG in header[:16]


def _is_result(header: bytes) -> bool:
    return _RESULT_TAG in header[:16]


def _step_phase(header: bytes) -> str:
    """The phase of a Step's entries ("whole", "taps" or "commit"; a Step carries one)."""
    try:
        step = decode_request(header)
    except ProtocolError:
        return ""
    if not isinstance(step, Step) or not step.entries:
        return ""
    return step.entries[0].phase.name.lower()


@dataclass(eq=False)
class _Pair:
    client: Any  # the client's connection to the proxy
    server: Any  # the proxy's connection to the server's link
    ident: bytes


class ChaosProxy:
    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.stats = ProxyStats()
        self._rng = random.Random(cfg.seed)
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        self._front.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._front.bind(cfg.frontend)
        self._backs: dict[bytes, zmq.Socket] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._front, zmq.POLLIN)
        # delayed requests (due, seq, ident, frames, the link they came on or None)
        self._held: list[tuple[float, int, bytes, list[bytes], _Pair | None]] = []
        self._seq = 0
        self._retry: list[tuple[float, bytes, list[bytes]]] = []  # (give up at, ident, frames)
        self._stop = threading.Event()
        # direct links: the proxy's listener, tokens it relayed (-> the server's link name and the client),
        # connections yet to present one, relayed pairs by descriptor (-> the pair, whether from the client)
        self._listener: Any = None
        self._name = ""
        self._tokens: dict[bytes, tuple[str, bytes]] = {}
        self._pending: dict[int, Any] = {}
        self._pairs: dict[int, tuple[_Pair, bool]] = {}
        if direct.available():
            self._listener, self._name = direct.listen()
            self._poller.register(self._listener.fileno(), zmq.POLLIN)

    def stop(self) -> None:
        self._stop.set()

    def _backend(self, ident: bytes) -> zmq.Socket:
        s = self._backs.get(ident)
        if s is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.ROUTING_ID, ident)
            s.setsockopt(zmq.RECONNECT_IVL, 10)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 10)
            s.connect(self.cfg.backend)
            self._backs[ident] = s
            self._poller.register(s, zmq.POLLIN)
        return s

    def _event(self, kind: str, ident: bytes) -> None:
        self.stats.events.append((time.monotonic(), kind, ident.decode("latin-1")))

    def _chaos_applies(self, header: bytes, reply: bool = False) -> bool:
        return not self.cfg.only_steps or (_is_result(header) if reply else _is_step(header))

    def _on_request(self, frames: list[bytes], pair: _Pair | None = None) -> None:
        """A client's message (from a link: ``pair``, its header alone), dropped, delayed or forwarded."""
        if len(frames) < 2:
            return
        ident, body = frames[0], frames[1:]
        if self.cfg.phase_drop_p and _is_step(body[0]) and (phase := _step_phase(body[0])) in self.cfg.phases:
            if self._rng.random() < self.cfg.phase_drop_p:
                self.stats.dropped_requests += 1
                self._event(f"drop_{phase}", ident)
                return
        if self._chaos_applies(body[0]):
            if self.cfg.drop_request_p and self._rng.random() < self.cfg.drop_request_p:
                self.stats.dropped_requests += 1
                self._event("drop_request", ident)
                return
            if self.cfg.delay_p and _is_step(body[0]) and self._rng.random() < self.cfg.delay_p:
                self.stats.delayed_requests += 1
                self._event("delay_request", ident)
                self._seq += 1
                due = time.monotonic() + self.cfg.delay_ms / 1000.0
                heapq.heappush(self._held, (due, self._seq, ident, body, pair))
                return
        if pair is not None:
            self._link_send(pair, pair.server, body[0], reply=False)
        else:
            self._forward(ident, body)

    def _link_send(self, pair: _Pair, to: Any, data: bytes, reply: bool) -> None:
        if to.send(data):
            if reply:
                self.stats.forwarded_replies += 1
            else:
                self.stats.forwarded_requests += 1
        elif reply:
            self.stats.reply_send_failures += 1
        else:
            self.stats.unroutable += 1

    def _forward(self, ident: bytes, body: list[bytes], give_up_at: float | None = None) -> None:
        if give_up_at is None and any(i == ident for _, i, _ in self._retry):
            # keep this client's order: queue behind its requests that are still being retried
            self._retry.append((time.monotonic() + self.cfg.hold_unroutable_ms / 1000.0, ident, body))
            return
        try:
            self._backend(ident).send_multipart(body, zmq.NOBLOCK)
            self.stats.forwarded_requests += 1
        except zmq.ZMQError:
            now = time.monotonic()
            if give_up_at is None:
                give_up_at = now + self.cfg.hold_unroutable_ms / 1000.0
            if now < give_up_at:
                self._retry.append((give_up_at, ident, body))
            else:
                self.stats.unroutable += 1

    def _on_reply(self, ident: bytes, body: list[bytes], pair: _Pair | None = None) -> None:
        if body and self._chaos_applies(body[0], reply=True):
            if self.cfg.drop_reply_p and self._rng.random() < self.cfg.drop_reply_p:
                self.stats.dropped_replies += 1
                self._event("drop_reply", ident)
                return
        if body and self._listener is not None and b"\xa7welcome" in body[0][:24]:
            body = [self._relay_welcome(ident, body[0]), *body[1:]]
        if pair is not None and len(body) == 1:
            self._link_send(pair, pair.client, body[0], reply=True)
            return
        try:
            self._front.send_multipart([ident, *body], zmq.NOBLOCK)
            self.stats.forwarded_replies += 1
        except zmq.ZMQError:
            self.stats.reply_send_failures += 1

    def _relay_welcome(self, ident: bytes, header: bytes) -> bytes:
        """A Welcome that offers a direct link, made to offer the proxy's listener (the token kept)."""
        try:
            w = decode_reply(header)
        except ProtocolError:
            return header
        if not isinstance(w, Welcome) or not w.direct:
            return header
        self._tokens[w.direct_token] = (w.direct, ident)
        return encode(msgspec.structs.replace(w, direct=self._name))[0]

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn.setblocking(False)
            self._pending[conn.fileno()] = direct.Link(conn)
            self._poller.register(conn.fileno(), zmq.POLLIN)

    def _bind(self, fd: int) -> None:
        """A client presented its token on the proxy's listener: connect on to the server's link."""
        conn = self._pending.pop(fd)
        self._poller.unregister(fd)
        msgs, alive = conn.read(1)
        if not alive or not msgs or msgs[0] not in self._tokens:
            conn.close()
            return
        name, ident = self._tokens.pop(msgs[0])
        try:
            server = direct.connect(name, msgs[0])
        except OSError:
            conn.close()
            return
        pair = _Pair(conn, server, ident)
        for sock, from_client in ((conn, True), (server, False)):
            self._pairs[sock.fileno()] = (pair, from_client)
            self._poller.register(sock.fileno(), zmq.POLLIN)

    def _relay(self, fd: int) -> None:
        pair, from_client = self._pairs[fd]
        msgs, alive = (pair.client if from_client else pair.server).read(256)
        for m in msgs:
            if from_client:
                self._on_request([pair.ident, m], pair)
            else:
                self._on_reply(pair.ident, [m], pair)
        if not alive:  # one side ended: end both, each side falls back to ZeroMQ
            for sock in (pair.client, pair.server):
                self._pairs.pop(sock.fileno(), None)
                self._poller.unregister(sock.fileno())
                sock.close()

    def run(self) -> None:
        parent = os.getppid()
        try:
            while not self._stop.is_set() and os.getppid() == parent:  # never outlive the soak
                timeout = 2 if self._retry else 50
                if self._held:
                    timeout = max(0, min(timeout, int((self._held[0][0] - time.monotonic()) * 1000) + 1))
                events = dict(self._poller.poll(timeout))
                for fd in [e for e in events if isinstance(e, int)]:
                    if self._listener is not None and fd == self._listener.fileno():
                        self._accept()
                    elif fd in self._pending:
                        self._bind(fd)
                    elif fd in self._pairs:
                        self._relay(fd)
                if self._front in events:
                    for _ in range(256):
                        try:
                            frames = self._front.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_request(frames)
                for ident, s in list(self._backs.items()):
                    if s in events:
                        for _ in range(256):
                            try:
                                body = s.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            self._on_reply(ident, body)
                retry, self._retry = self._retry, []
                blocked: set[bytes] = set()
                for give_up_at, ident, body in retry:  # in arrival order, per client
                    if ident in blocked:
                        self._retry.append((give_up_at, ident, body))
                        continue
                    self._forward(ident, body, give_up_at)
                    if self._retry and self._retry[-1][1] == ident:
                        blocked.add(ident)  # still not routable: the rest of this client's queue waits
                now = time.monotonic()
                while self._held and self._held[0][0] <= now:
                    _, _, ident, body, pair = heapq.heappop(self._held)
                    if pair is None:
                        self._forward(ident, body)
                    elif pair.server.sock.fileno() >= 0:  # its link still up
                        self._link_send(pair, pair.server, body[0], reply=False)
        finally:
            for pair, _ in list(self._pairs.values()):
                pair.client.close()
                pair.server.close()
            if self._listener is not None:
                self._listener.close()
            for s in self._backs.values():
                s.close(0)
            self._front.close(0)
            self._ctx.term()
