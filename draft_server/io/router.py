"""The ROUTER socket and its I/O thread: the only owner of the socket.

Decodes and validates each message, answers what needs no model (Hello, Ping, malformed input,
per-entry rejections) at once, and hands admitted entries to the engine without waiting.

Who touches the socket: whoever holds ``_lock`` (ZeroMQ allows a socket to move between threads
behind a full memory barrier, which a mutex is). The I/O thread sleeps in ``select.poll`` on the
socket's ``ZMQ_FD`` and a wake-up pipe, never inside a socket call, and takes the lock for each
pass over the messages waiting. The engine's replies are sent by the engine thread itself when
the lock is free (``queue_reply``: one non-blocking try, one non-blocking send), which saves the
hop through the I/O thread; when the I/O thread holds the lock they go to an outbox that thread
flushes. Nobody ever waits on the other's work. ``ZMQ_FD`` is edge-triggered: it says that the
socket's state changed, not that a message waits, and any socket call may consume the change. So
every holder reads ``ZMQ_EVENTS`` last before letting go, and the I/O thread sleeps only after it
read no POLLIN there; another thread that reads POLLIN writes the wake-up pipe.

Who watches the socket: the I/O thread, unless the engine is idle. An idle engine takes the
socket (``engine_take``) and polls its FD itself; a Step that finds it so wakes the engine, which
reads it (``engine_serve``: this module's own code on the engine's thread, under the lock) and
drafts it, with no hop through the I/O thread. The I/O thread leaves the FD out of its poll while
the engine owns the socket, so one thread is woken per message. An engine about to run a batch it
expects to be long (a prefill chunk, or recent iterations over ``scheduler.LONG_BATCH_S``) gives
the socket back first (``engine_leave``); one away longer than ``_RECLAIM_S`` anyway has it taken
back (a batch longer than expected: messages that arrive during it are read within that time);
the engine takes it again when it idles.

Ownership: sessions belong to the connection that made them, keyed by its routing id, and by its
CurveZMQ public key too when Curve is on. ``ROUTER_HANDOVER`` is off, so a second connection
that presents a routing id already in use is refused by the socket instead of taking over;
ZeroMQ heartbeats drop dead peers within seconds, so a client that reconnects gets its id back.

Wire formats (``protocol.wire``): the Welcome lists the formats the server accepts (the
drafter's, narrowed by ``--wire-formats``); a Hello asking for another one, or for projected rows
with another projection's id, is refused with one WIRE_FORMAT line naming both sides (counted in
``draft_server_bad_messages_total{code="wire_format"}``). Each Step names its format; its rows are
checked against that format's layout and travel to the drafter as they came.

Endpoints and transports: ``--bind`` may name several endpoints (``tcp://`` for remote engines,
``ipc://`` for a co-located one), all on the one ROUTER socket. A client on this host may ask for
transport "shm" in its Hello: its rows then come in a shared-memory ring it made, mapped here
read-only (``rings``); each Step names a region instead of carrying a frame, and every reply to
that connection says which regions the server is done with (``StepResult.ring``). A ring that
cannot be mapped (another host or container, another user) or a server started with ``--no-shm``
is refused with one TRANSPORT line (``draft_server_bad_messages_total{code="transport"}``).
A client on this host may instead ask for transport "cuda_ipc" (``cuda_ipc``): its Hello names a
device buffer it exported with CUDA IPC, imported here on the drafter's device; each Step names a
region of it, copied at once, device to device, into this server's memory, and the reply acks the
regions as for shm. No CUDA device here, ``--no-cuda-ipc``, another host or a buffer that cannot be
opened is refused with one TRANSPORT line, counted the same way.

Direct links (``direct``, ``protocol.direct``): a client whose ring or CUDA IPC buffer this host maps
is offered a same-host SOCK_SEQPACKET link in its Welcome; its header-only messages then come over the
link and replies to it go back that way (``_send``), the rest over the socket. Links are read in the
same passes as the socket (``_serve``, under the lock: by the I/O thread, or by the idle engine, which
polls their descriptors beside ZMQ_FD: ``engine_fds``); they are level-triggered, so none of the
socket's edge rules apply to them. The I/O thread accepts connections and binds them by token.

Stale steps: each Step may carry the sender's clock (``sent_ms``). The loop keeps, per
connection, the smallest (receive - sent) seen; a Step that arrives later than that by more than
its budget waited unread (a pause, an outage): nothing of it is drafted, and it is answered
``expired``: at once for an entry without rows, by the engine once an entry's rows are applied (an
entry the engine refuses, e.g. one overtaken by a newer step of its session, is answered as refused:
an at-once EXPIRED would have told the client rows were applied that never were).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import select
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from functools import partial

import msgspec
import numpy as np
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from draft_server.config import ServerConfig
from draft_server.engine import Call, Engine, Work
from draft_server.io.arena import Arena
from draft_server.io.cuda_ipc import CudaBuffers
from draft_server.io.direct import DirectLinks
from draft_server.io.rings import Rings
from draft_server.metrics import ServerMetrics
from protocol import (
    FEATURE_EARLY_TAPS,
    PROTOCOL_VERSION,
    DType,
    EntryResult,
    Error,
    ErrorCode,
    Free,
    Hello,
    ModelContract,
    Phase,
    Ping,
    Pong,
    ProtocolError,
    ServerLimits,
    Status,
    Step,
    StepResult,
    Transport,
    Weights,
    Welcome,
    WireOffer,
    decode_request,
    direct,
    encode,
    validate_step,
)
from protocol.codec import Buffer, check_version, scan_call_id
from protocol.cuda_ipc import PREFIX as CUDA_IPC_PREFIX
from protocol.cuda_ipc import refusal as cuda_ipc_refusal
from protocol.messages import Request
from protocol.shm import refusal as transport_refusal
from protocol.wake import WakePipe, repoll
from protocol.wire import BF16_ONLY, SCALE_BYTES, refusal, row_layout

log = logging.getLogger("draft_server.io")


_KINDS = {Step: "step", Hello: "hello", Ping: "ping", Free: "free"}  # metrics.MESSAGE_KINDS
_COMMIT = Phase.COMMIT
_POLLIN = int(zmq.POLLIN)  # zmq's flag enums cost a Python call per operation; the loop uses ints
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
_POLL_MS = 100  # the I/O thread's longest sleep (sweeps, shutdown)
_RECLAIM_S = 0.02  # the I/O thread watches the socket again this long after the engine went to work
_RECLAIM_MS = 20
_REPLY_WAIT_S = 0.001  # the longest a reply's sender waits for the I/O thread's pass (``queue_reply``)
_BATCH = 256  # messages per pass, so replies and sweeps keep going under a flood

NONFINITE_RUNS = 4  # 64-byte runs read per row for NaN/Inf, spread over the row
_LINE = 64  # bytes: a cache line, what a read of memory costs anyway


def nonfinite_rows(taps: np.ndarray, dtype: DType) -> np.ndarray:
    """bool [rows]: rows whose sampled values hold NaN or Inf: NONFINITE_RUNS runs of 64 bytes of
    each row, the first and the rest spread evenly, each read whole. A diverged target puts NaN
    across whole rows, so a sample finds it; the rows were just written by another process, so each
    line read is a trip to memory: a strided sample of single values (every 61st) read every other
    line of the rows, 0.8 ms for 64 sessions x 3 rows of K3 taps on the 2-core VM, and one line in
    61 still 0.3 ms. The result only feeds a metric: NaN/Inf never reaches another session (the
    attention paths mask at the load).

    ``dtype`` U8: fp8 rows, whose NaN is the e4m3 code S.1111.111, or whose float32 scale is not
    finite (any NaN in a row's taps makes it so)."""
    if dtype == DType.U8:
        w = taps.shape[1] - SCALE_BYTES
        scale = np.ascontiguousarray(taps[:, w:]).view(np.float32)[:, 0]
        return ((_lines(taps, w) & 0x7F) == 0x7F).any(axis=(1, 2)) | ~np.isfinite(scale)
    sample = _lines(taps, taps.shape[1])
    if dtype == DType.BF16:  # bit patterns: exponent all ones
        return ((sample & 0x7F80) == 0x7F80).any(axis=(1, 2))
    return ~np.isfinite(sample).all(axis=(1, 2))


def _lines(taps: np.ndarray, width: int) -> np.ndarray:
    """A view [rows, runs, values] of NONFINITE_RUNS evenly spread 64-byte runs of each row's first
    ``width`` values (the whole row when it is shorter than one run)."""
    per = max(1, _LINE // taps.itemsize)
    runs = width // per
    if runs == 0 or taps.strides[1] != taps.itemsize:
        return taps[:, None, :width]
    n = min(NONFINITE_RUNS, runs)
    every = runs // n  # runs apart: the last read run ends inside the row
    return np.lib.stride_tricks.as_strided(
        taps, (taps.shape[0], n, per), (taps.strides[0], every * per * taps.itemsize, taps.itemsize), writeable=False
    )


def _cut_frame(nbytes: int) -> memoryview:
    """Stands in for a frame ``recv_into`` truncated (its bytes are gone): ``nbytes`` of untouched
    anonymous memory, so size checks see the frame's real length and refuse it as before."""
    return memoryview(mmap.mmap(-1, nbytes))


def check_ipc_free(endpoint: str) -> None:
    """Refuse an ipc:// path another live server listens on (binding it would silently take its
    path over: ZeroMQ unlinks the socket file first). A stale file of a dead server is fine."""
    import socket

    path = endpoint[len("ipc://") :]
    if path.startswith("@") or not os.path.exists(path):  # abstract namespace, or nothing there
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(path)
        except OSError:
            return  # nobody listens: a stale file
    raise zmq.ZMQError(errno.EADDRINUSE, f"{endpoint}: another process listens there")


class Router:
    def __init__(
        self,
        cfg: ServerConfig,
        engine: Engine,
        metrics: ServerMetrics,
        *,
        epoch: str,
        contract: ModelContract,
        limits: ServerLimits,
        healthy: Callable[[], bool],
        offer: WireOffer = BF16_ONLY,
        weights: Weights | None = None,
    ) -> None:
        self.cfg = cfg
        self.offer = offer
        self.weights = weights or Weights()
        self.engine = engine
        self.metrics = metrics
        self.epoch = epoch
        self.contract = contract
        self.contract_id = contract.fingerprint()
        self.limits = limits
        self._healthy = healthy
        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self.transports = (Transport.FRAMES.value, Transport.SHM.value) if cfg.shm else (Transport.FRAMES.value,)
        drafter = engine.drafter
        self.rings = Rings(cfg.session_ttl_s, metrics.shm_rings, drafter.register_host, drafter.unregister_host)
        self.cuda_ipc = CudaBuffers.serving(drafter, cfg.cuda_ipc, cfg.session_ttl_s, metrics.cuda_ipc_buffers)
        if self.cuda_ipc.offered:
            self.transports = (*self.transports, Transport.CUDA_IPC.value)
        self.endpoints: list[str] = []
        self._sock = self._make_socket()
        self.direct: DirectLinks | None = None  # same-host direct links, offered with transport shm
        if cfg.shm and direct.available():
            try:
                self.direct = DirectLinks(metrics.direct_links)
            except OSError as e:  # clients stay on ZeroMQ alone
                log.warning("no direct links: %s", e)
        self.endpoint = ",".join(self.endpoints)
        self.arena: Arena | None = None  # Step tap frames land here (made once bound: a failed bind pins nothing)
        if cfg.arena_mib > 0:
            self.arena = Arena(cfg.arena_mib << 20, drafter.register_host, drafter.unregister_host)
            metrics.watch_arena(self.arena)
        self._outbox: deque[tuple[bytes, object, Sequence]] = deque()
        self._lock = threading.RLock()  # the socket's owner (see the module docstring); re-entered by reply_now
        self._closed = False  # set under the lock when the socket is closed
        self._handed = False  # work went to the engine in this pass (it is woken before the next poll)
        self._engine_owns = False  # the idle engine watches the socket (the I/O thread's poll leaves its FD out)
        self._engine_polling = False  # ... and is in its poll now (only the engine clears it)
        self._engine_left = 0.0  # when the engine last stopped watching
        self.fd = self._sock.get(zmq.FD)  # the socket's ZMQ_FD (edge-triggered, see the module docstring)
        self._wake_pipe = WakePipe()
        self._running = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="draft-io", daemon=True)
        self._min_lag_ms: OrderedDict[bytes, float] = OrderedDict()  # per connection: min (recv - sent)
        self._nonfinite_by_client: dict[bytes, int] = {}
        self._nonfinite_lock = threading.Lock()  # the engine, the I/O thread and a scrape may count at once
        self._engine_reads = False  # the idle engine is reading the socket now (``engine_serve``)

    def _make_socket(self) -> zmq.Socket:
        cfg = self.cfg
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # The loop answers a message over the limit with a TOO_LARGE error (and counts it); the socket
        # itself drops only what is more than twice that, before it is ever held in memory.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.limits.max_message_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer raises, and is counted
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)  # a routing id in use is refused, never handed over
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # dead peers go within seconds (their id is free again)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        if cfg.curve_secret_key_file:
            public, secret = zmq.auth.load_certificate(cfg.curve_secret_key_file)
            if secret is None:
                raise ValueError(f"{cfg.curve_secret_key_file} holds no secret key")
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=cfg.curve_allow_dir or zmq.auth.CURVE_ALLOW_ANY)
            sock.curve_server = True
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        try:
            for ep in (e.strip() for e in cfg.bind.split(",")):
                if ep.startswith("ipc://"):
                    check_ipc_free(ep)
                sock.bind(ep)
                self.endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    # ------------------------------------------------------------------ lifecycle (any thread)

    def start(self) -> None:
        if self.arena is not None:
            how = "registered with the device" if self.arena.registered else "rows staged (not registered)"
            log.info("receive arena: %d MiB, %s", self.arena.capacity >> 20, how)
        self._running.set()
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Idempotent; the thread need not have started."""
        if self._closed:
            return
        self._running.clear()
        self._wake()
        if self._thread.ident is not None:  # started
            self._thread.join(5.0)
        with self._lock:  # a reply the engine sends from now on is dropped, never sent on a closed socket
            self._closed = True
            self._sock.close(linger=0)
            if self.direct is not None:
                self.direct.close()
        self.rings.close()
        self.cuda_ipc.close()
        if self.arena is not None:
            self.arena.close()
        if self._auth:
            self._auth.stop()
        self._ctx.term()
        self._wake_pipe.close()

    def queue_reply(self, ident: bytes, msg: object, payloads: list | None = None) -> None:
        """Any thread: send a reply now if the socket is free (or this thread holds it: ``reply_now``)
        or a pass of the I/O thread frees it within ``_REPLY_WAIT_S`` (1 ms: left to that thread, the
        reply would wait for the GIL the engine, on to its next batch, holds), else queue it for the
        I/O thread; one non-blocking send. A reply queued already (that wait ran out: a long pass, a
        flood) makes the next ones queue at once: at most one wait per pass of the I/O thread."""
        if not self._lock.acquire(blocking=False) and (self._outbox or not self._lock.acquire(timeout=_REPLY_WAIT_S)):
            self._outbox.append((ident, msg, payloads or ()))
            self._wake()  # the I/O thread holds the socket: it flushes the outbox before it lets go
            return
        try:
            if self._closed:
                return
            self._flush_outbox()  # an earlier reply that found the socket busy goes first
            # a ZeroMQ send may have taken the FD's edge (a direct link's send touches no ZeroMQ state)
            waiting = not self._send(ident, msg, payloads or ()) and self._sock.get(_EVENTS) & _POLLIN
        finally:
            self._lock.release()
        if waiting:
            self._wake()

    def _wake(self) -> None:
        self._wake_pipe.ring()

    # ------------------------------------------------------------------ the idle engine's watch

    def engine_fds(self) -> tuple[int, ...]:
        """What the idle engine polls: the socket's ZMQ_FD and the direct links' descriptors."""
        d = self.direct
        return (self.fd,) if d is None else (self.fd, *d.fds)

    def engine_take(self) -> bool:
        """The idle engine: watch the socket now (False: the router is closed). Waits for an I/O
        pass that holds the socket (the engine is idle; giving up instead while it still owned the
        socket from its last watch would leave nobody watching until the I/O thread took it back).
        A message already waiting behind a taken edge is the I/O thread's: it was woken for it, and
        rings the engine once it queued the work."""
        with self._lock:
            if self._closed:
                return False
            was = self._engine_owns
            self._engine_owns = self._engine_polling = True
        if not was:
            self._wake()  # the I/O thread may sleep on the FD: it leaves it out from its next poll
        return True

    def engine_leave(self) -> None:
        """The engine is off to a batch it expects to be long: the I/O thread watches meanwhile."""
        if self._engine_owns:
            self._engine_owns = False
            self._wake()

    def engine_serve(self) -> None:
        """The engine's watch ended (a message, its bell, a timeout): read what waits, on its thread."""
        with self._lock:  # an I/O pass is short, and the engine is idle
            self._engine_polling = False
            self._engine_left = time.monotonic()
            if self._closed:
                return
            self._engine_reads = True
            try:
                more = self._serve()
            finally:
                self._engine_reads = False
            self._handed = False  # read by the engine itself: nobody to wake
        if more:  # a flood: the I/O thread reads the rest while the engine works
            self._engine_owns = False
            self._wake()

    # ------------------------------------------------------------------ I/O thread

    def _loop(self) -> None:
        poller = select.poll()
        wake_r = self._wake_pipe.fd
        polled: set[int] = set()
        watching = False  # the socket's FD (and the direct links') in the poll: not while the idle engine watches
        timeout = 0  # a message may have arrived before the first read of ZMQ_EVENTS
        while self._running.is_set():
            try:
                if watching == self._engine_owns:
                    watching = not watching
                    if watching:
                        timeout = 0  # its edge may have gone to the engine: look first
                d = self.direct
                want = {wake_r}
                if d is not None:
                    want.update(d.watch_fds())  # the listener, connections yet to present their token
                if watching:
                    want.add(self.fd)
                    if d is not None:
                        want.update(d.fds)
                polled = repoll(poller, polled, want)
                ready = poller.poll(timeout)
                for fd, _ in ready:
                    if fd == wake_r:
                        self._wake_pipe.drain()
                with self._lock:
                    if self._closed:
                        return
                    now = time.monotonic()
                    if self._engine_owns and not self._engine_polling and now - self._engine_left >= _RECLAIM_S:
                        self._engine_owns = False  # a batch longer than expected: the socket is this thread's again
                    if self._engine_owns and self._engine_polling:
                        # the idle engine watches: a message is the engine's, even when this thread was
                        # woken (its wake pipe) as it arrived. Replies queued while the socket was busy
                        # go out here; a message waiting behind an FD edge already taken (by that send,
                        # or by a reply sent before the engine went idle, which woke this thread for
                        # it) rings the engine, which reads it on its own thread
                        more = False
                        if ready:
                            self._flush_outbox()
                            if self._sock.get(_EVENTS) & _POLLIN:
                                self.engine.wake()
                    else:
                        more = self._serve()
                    self.rings.sweep(now)  # under the lock: a reply's ack reads the rings and buffers
                    self.cuda_ipc.sweep(now)
                    if self.direct is not None and self.direct.housekeep():
                        self.engine.wake()  # a new link: the idle engine's next poll watches it too
                timeout = 0 if more else (_RECLAIM_MS if self._engine_owns else _POLL_MS)
            except zmq.ContextTerminated:
                return
            except Exception:  # never let one message end the I/O thread
                log.exception("I/O loop error")
                self.metrics.io_errors.inc()
                timeout = 1  # soon (a message may wait behind the FD's edge), but never a busy loop
            finally:
                if self._handed:  # last before the poll, so the engine woken now finds the GIL free (the
                    self._handed = False  # work was queued as it was read: a busy engine takes it unwoken)
                    self.engine.wake()

    def _serve(self) -> bool:
        """Under the lock: read the messages waiting (at most ``_BATCH``), send the outbox; True
        when messages still wait (ZMQ_EVENTS, read last: the loop may sleep on the FD only after
        it saw no POLLIN there)."""
        sock = self._sock
        for _ in range(_BATCH):
            if not sock.get(_EVENTS) & _POLLIN:
                break
            try:
                # no local keeps the frames: an arena slot is free once the engine is done with it
                self._on_message(*self._recv())
            except zmq.Again:  # not expected after POLLIN (a message's parts arrive together)
                break
        d = self.direct
        if d is not None:
            for link in d.links:  # level-triggered: what a pass leaves keeps the link's descriptor ready
                msgs = d.read(link)
                recv_t = time.monotonic()
                for header in msgs:
                    self._dispatch(link.ident, link.owner, header, [], None, recv_t)
        self._flush_outbox()
        return bool(sock.get(_EVENTS) & _POLLIN)

    def _flush_outbox(self) -> None:
        while self._outbox:
            ident, msg, payloads = self._outbox.popleft()
            self._send(ident, msg, payloads)

    def _send(self, ident: bytes, msg: object, payloads: Sequence = ()) -> bool:
        """Send a reply: over the client's direct link when it has one and the reply is header-only
        (returns True), else over the socket."""
        if isinstance(msg, StepResult) and (ack := self.rings.ack(ident) or self.cuda_ipc.ack(ident)) is not None:
            msg = msgspec.structs.replace(msg, ring=ack)
        frames = encode(msg, payloads)  # type: ignore[arg-type]
        if not payloads and self.direct is not None and self.direct.send(ident, frames[0]):  # type: ignore[arg-type]
            return True
        try:
            self._sock.send_multipart([ident, *frames], _NOBLOCK, copy=False)  # type: ignore[arg-type]
        except (zmq.Again, zmq.ZMQError):
            self.metrics.replies_dropped.inc()
        return False

    def _recv(self) -> tuple[list, Request | ProtocolError | None, float]:
        """One message's frames (routing id, header, payloads) as ``recv_multipart`` gives them,
        except that a Step's tap frame lands in a slot of the receive arena (``arena``) when it
        fits; the header decoded on the way there (a Request or its ProtocolError; None when it
        was not decoded here); and when its reading began. Raises zmq.Again when no message
        waits. The parts of a message arrive together, so only the first read can find nothing."""
        sock = self._sock
        first = sock.recv(_NOBLOCK, copy=False)
        recv_t = time.monotonic()  # the copy into the arena counts as the server's time
        frames: list = [first]
        more = first.more
        decoded: Request | ProtocolError | None = None
        try:
            if more:
                header = sock.recv(_NOBLOCK, copy=False)
                frames.append(header)
                more = header.more
                if more and self.arena is not None and len(header) <= self.limits.max_message_bytes:
                    try:
                        decoded = decode_request(header.buffer)
                    except ProtocolError as e:
                        decoded = e
                    slot = self._arena_slot(decoded)
                    if slot is not None:
                        n = sock.recv_into(slot, flags=_NOBLOCK)
                        # shorter than announced: validation names its size; longer: ZeroMQ cut it, and
                        # a stand-in of its length (pages never touched) gets the same BAD_FRAMES
                        frames.append(slot if n == len(slot) else slot[:n] if n < len(slot) else _cut_frame(n))
                        more = bool(sock.getsockopt(zmq.RCVMORE))
            while more:
                f = sock.recv(_NOBLOCK, copy=False)
                frames.append(f)
                more = f.more
        except Exception:
            while sock.getsockopt(zmq.RCVMORE):  # never leave a message half read: the next would start mid-way
                sock.recv(_NOBLOCK, copy=False)
            raise
        return frames, decoded, recv_t

    def _arena_slot(self, msg: Request | ProtocolError) -> np.ndarray | None:
        """A slot for the tap frame a Step announces (frame 0, not in a shm ring), or None: not
        such a Step, or no room (then the frame is received as usual, and counted)."""
        arena = self.arena
        if not isinstance(msg, Step) or msg.taps is None or msg.rows_at is not None or msg.taps.frame != 0:
            return None
        try:
            nbytes = msg.taps.nbytes
        except Exception:  # a malformed spec: validation answers it
            return None
        if nbytes <= 0:
            return None
        assert arena is not None
        slot = arena.take(nbytes)
        if slot is None:
            self.metrics.arena_fallbacks.labels("full" if arena.fits(nbytes) else "too_large").inc()
        else:
            self.metrics.arena_payloads.inc()
        return slot

    @staticmethod
    def _payload(f: zmq.Frame | np.ndarray | memoryview) -> Buffer:
        return f.buffer if isinstance(f, zmq.Frame) else f

    def _on_message(
        self, frames: list, decoded: Request | ProtocolError | None = None, recv_t: float | None = None
    ) -> None:
        """``frames``: zmq.Frames, the tap frame possibly an arena slot (``_recv``); ``decoded``:
        the header as ``_recv`` decoded it, if it did; ``recv_t``: when its reading began."""
        recv_t = time.monotonic() if recv_t is None else recv_t
        if len(frames) < 2:
            self.metrics.dropped_messages.inc()
            return
        ident = frames[0].bytes
        size = sum(len(f) for f in frames[1:])
        if size > self.limits.max_message_bytes:
            cid = scan_call_id(frames[1].buffer)
            self._error(
                ident,
                ProtocolError(
                    ErrorCode.TOO_LARGE,
                    f"message of {size} bytes over the {self.limits.max_message_bytes}-byte limit",
                    cid,
                ),
            )
            return
        owner = ident
        if self.cfg.curve_secret_key_file:  # bind sessions to the client's key, not only its routing id
            key = frames[1].get("User-Id")
            owner = (key.encode() if isinstance(key, str) else b"") + b"\0" + ident
        self._dispatch(ident, owner, frames[1].buffer, [self._payload(f) for f in frames[2:]], decoded, recv_t)

    def _dispatch(
        self,
        ident: bytes,
        owner: bytes,
        header: Buffer,
        payloads: list,
        decoded: Request | ProtocolError | None,
        recv_t: float,
    ) -> None:
        """One message of client ``ident`` (owner ``owner``), from the socket or its direct link."""
        try:
            msg = decode_request(header) if decoded is None else decoded
            if isinstance(msg, ProtocolError):
                raise msg
        except ProtocolError as e:
            if e.call_id < 0:
                self.metrics.dropped_messages.inc()  # nothing to answer to
                return
            self._error(ident, e)
            return
        m = self.metrics
        m.later.later(m.message_kind[_KINDS[type(msg)]].inc, 1)
        try:
            if isinstance(msg, Step):
                self._on_step(ident, owner, msg, payloads, recv_t)
            elif isinstance(msg, Hello):
                self._on_hello(ident, owner, msg, payloads)
            elif isinstance(msg, Ping):
                self._send(ident, self._pong(msg.call_id))
            elif isinstance(msg, Free):
                if payloads:
                    raise ProtocolError(ErrorCode.BAD_FRAMES, "free carries no payload frames")
                self.engine.submit_free(owner, msg.sessions)
                self._handed = True
        except ProtocolError as e:
            self._error(ident, e)

    def _error(self, ident: bytes, e: ProtocolError) -> None:
        self.metrics.bad_messages.labels(e.code.name.lower()).inc()
        self._send(ident, Error(call_id=e.call_id, code=e.code, message=e.message, epoch=self.epoch))

    def _pong(self, call_id: int) -> Pong:
        return Pong(
            call_id=call_id,
            epoch=self.epoch,
            contract_id=self.contract_id,
            healthy=self._healthy(),
            live_sessions=len(self.engine.sessions),
            queue_rows=self.engine.admission.queued_rows,
        )

    def _on_hello(self, ident: bytes, owner: bytes, msg: Hello, payloads: list) -> None:
        check_version(msg.protocol_version, msg.call_id)
        if payloads:
            raise ProtocolError(ErrorCode.BAD_FRAMES, "hello carries no payload frames", msg.call_id)
        if msg.expect is not None:
            diff = msg.expect.mismatches(self.contract)
            if diff:
                raise ProtocolError(
                    ErrorCode.CONTRACT_MISMATCH,
                    f"server serves {self.contract.model_name}; differing fields: " + "; ".join(diff),
                    msg.call_id,
                )
        why = refusal(msg.wire_format, msg.projection_id, self.offer)
        if why is not None:
            raise ProtocolError(ErrorCode.WIRE_FORMAT, why, msg.call_id)
        ring = ""
        if msg.ring is not None:
            why = transport_refusal(Transport.SHM.value, self.transports)
            if why is not None:
                raise ProtocolError(ErrorCode.TRANSPORT, why, msg.call_id)
            ring = self.rings.map(ident, owner, msg.ring, msg.call_id)
        if msg.cuda_ipc is not None:
            has_cuda = self.engine.drafter.cuda_device() is not None
            why = cuda_ipc_refusal(self.transports, has_cuda, not self.cfg.cuda_ipc)
            if why is not None:
                raise ProtocolError(ErrorCode.TRANSPORT, why, msg.call_id)
            ring = self.cuda_ipc.map(ident, owner, msg.cuda_ipc, msg.call_id)
        self._send(
            ident,
            Welcome(
                protocol_version=PROTOCOL_VERSION,
                call_id=msg.call_id,
                epoch=self.epoch,
                contract=self.contract,
                contract_id=self.contract_id,
                limits=self.limits,
                wire=self.offer,
                transports=self.transports,
                ring=ring,
                features=(FEATURE_EARLY_TAPS,),
                weights=self.weights,
                **self._direct_offer(ident, owner, ring),
            ),
        )

    def _direct_offer(self, ident: bytes, owner: bytes, ring: str) -> dict[str, object]:
        """A Welcome's direct link fields: offered to a client whose rows this host maps (same host)."""
        if not ring or self.direct is None:
            return {}
        name, token = self.direct.offer(ident, owner)
        return {"direct": name, "direct_token": token}

    def _waited_unread_ms(self, ident: bytes, step: Step, recv_t: float) -> float:
        """How much longer than this connection's fastest delivery the Step took to be read (0 if unknown)."""
        if step.sent_ms < 0:
            return 0.0
        lag = recv_t * 1000.0 - step.sent_ms
        best = self._min_lag_ms.get(ident)
        if best is None or lag < best:
            best = lag
        self._min_lag_ms[ident] = best
        self._min_lag_ms.move_to_end(ident)
        if len(self._min_lag_ms) > 4096:
            self._min_lag_ms.popitem(last=False)
        return lag - best

    def _on_step(self, ident: bytes, owner: bytes, step: Step, payloads: list, recv_t: float) -> None:
        locate = self._locate(ident, owner, step)
        taps, errors = validate_step(step, payloads, self.contract, self.limits, self.offer, locate)
        deadline = recv_t + step.budget_ms / 1000.0
        call = Call(ident, step.call_id, recv_t, deadline, [None] * len(step.entries), owner=owner)
        call.commit_follows = step.commit_follows
        waited = self._waited_unread_ms(ident, step, recv_t)
        unread = waited > step.budget_ms
        if unread:
            self.metrics.stale_steps.labels("unread").inc()
        admission = self.engine.admission
        entries = step.entries
        admitted = admission.admit_rows(
            owner, [e.rows if err is None else 0 for e, err in zip(entries, errors, strict=True)]
        )
        works: list[Work] = []
        sampled: list[tuple[int, int]] = []  # the rows of valid entries: sampled for NaN/Inf
        row = 0
        wire = step.wire
        late = f"read {waited:.0f} ms late" if unread else ""
        for i, (e, err, ok) in enumerate(zip(entries, errors, admitted, strict=True)):
            n = e.rows
            rows = taps[row : row + n] if (n and taps is not None) else None
            row += n
            if err is not None:
                self._set(call, i, EntryResult(Status.BAD_ENTRY, message=err))
                continue
            if rows is not None:
                sampled.append((row - n, row))
            if not ok:
                self._set(call, i, admission.overloaded("queue full"))
                continue
            end = e.pos + n
            k = 0 if unread else e.k  # read late: no drafting; rows still commit in order, acknowledged EXPIRED
            if rows is None and (unread or not e.k):  # nothing to apply or draft: answered now; what it
                claims = -1 if e.phase == _COMMIT else end  # acknowledges (a commit claims no context)
                self._set(call, i, EntryResult(Status.EXPIRED if unread else Status.OK, end=claims, message=late))
                continue
            call.remaining += 1  # the engine answers it (ingest only: once its session is admitted)
            works.append(
                Work(
                    call,
                    i,
                    e.session,
                    e.pos,
                    rows,
                    e.anchor,
                    k,
                    e.sampling,
                    end,
                    wire,
                    e.phase,
                    e.after,
                    e.restart,
                    late,
                )
            )
        if sampled and isinstance(taps, np.ndarray):  # device rows (cuda_ipc) are not sampled
            check = (owner, taps, row_layout(wire, self.contract, self.offer)[0], sampled)
            if self._engine_reads:  # on the idle engine's hop: sampled once the replies are out
                self.metrics.later.later(self._check_nonfinite, check)
            else:  # the I/O thread, beside the engine's batch
                self._check_nonfinite(check)
        answered_here = call.remaining == 0  # read before the engine may own `call`
        if works:
            self.engine.submit(works)  # the engine owns `call` from here on
            self._handed = True
        if answered_here:
            self.engine.reply_now(call)

    def _locate(self, ident: bytes, owner: bytes, step: Step) -> Callable | None:
        """Where the rows of a Step that names a region come from: a shm ring (a read-only view) or a
        CUDA IPC buffer (copied into device memory now); None when they are in a frame."""
        if step.rows_at is None:
            return None
        if step.rows_at.ring.startswith(CUDA_IPC_PREFIX):
            return partial(self.cuda_ipc.rows, ident, owner, spec=step.taps, call_id=step.call_id)
        return partial(self.rings.rows, ident, owner, call_id=step.call_id)

    def _check_nonfinite(self, check: tuple[bytes, np.ndarray, DType, list[tuple[int, int]]]) -> None:
        """Count the NaN/Inf rows (``nonfinite_rows``' sample) of a Step's valid entries: (owner, its
        rows, their dtype, the entries' row spans). Only a metric and a log line depend on it: NaN/Inf
        taps never reach another session (the attention paths mask at the load). On a GPU server the
        sample is the one CPU read of the rows (the device copies them), each of its lines a trip to
        memory (37 us of an idle engine's 0.45 ms hop for one K3 session on the 2-core VM, 0.14 ms at
        64): what the idle engine reads itself is checked once its replies are out (``Deferred``, which
        a scrape flushes first), holding the rows (their arena slot, ring region) that much longer."""
        owner, taps, dtype, spans = check
        try:
            bad = nonfinite_rows(taps, dtype)
        except Exception:  # only a metric's input: never a scrape's failure, nor the engine's
            log.exception("the NaN/Inf sample of a Step's rows failed")
            self.metrics.io_errors.inc()
            return
        if not bad.any():  # the common case
            return
        n_bad = sum(int(bad[a:b].sum()) for a, b in spans)
        if n_bad:
            self._count_nonfinite(owner, n_bad)

    def _count_nonfinite(self, owner: bytes, rows: int) -> None:
        """NaN/Inf taps are counted in a metric and per client, logged at the first and every 1,000th row."""
        self.metrics.nonfinite_rows.inc(rows)
        with self._nonfinite_lock:
            before = self._nonfinite_by_client.get(owner, 0)
            self._nonfinite_by_client[owner] = before + rows
        if before == 0 or (before + rows) // 1000 > before // 1000:
            log.warning("client %r: %d tap rows with NaN/Inf so far", owner[-16:], before + rows)

    def _set(self, call: Call, i: int, result: EntryResult) -> None:
        call.results[i] = result  # counted with the reply (``ServerMetrics.count_entries``)
