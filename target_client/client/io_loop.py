"""The client's I/O loop: the only code that touches the DEALER socket, and its thread.

Owns ``IoLoop``: the ZeroMQ context and socket (made in the constructor, so a bad endpoint fails
there), the command deque and the wake pipe callers use to reach the thread, the loop, sending
(steps, Hellos, pings, probes, frees; never blocking: a send that would block fails fast and
counts as a miss), receiving and dispatching replies by call id to the pending calls, timers
(Hello retry, breaker probes, call expiry, idle session sweep) and the shutdown.

All mutable protocol state lives here and is touched only by whoever holds ``_lock``: the
pending-call table, the per-session resend buffers (``resend.SessionRows``), the handshake
(``handshake.Handshake``), the circuit breaker (``breaker.Breaker``) and the RTT window of the
adaptive budget (``step_builder.AdaptiveBudget``), and the socket itself (ZeroMQ lets a socket move
between threads behind a full memory barrier, which a mutex is). A caller's command is one pass of
the loop: ``submit`` queues it and, when the lock is free, runs the pass in the caller's own thread
(a step goes out with no hop through the I/O thread); when the I/O thread holds the lock, the caller
waits for that pass to end and runs its own (left to that thread, a step goes out only once the
caller, busy again, lets go of the GIL); only a pass longer than ``_CALLER_WAIT_S`` (1 ms) is left to
wake that thread instead. The lock is held for one pass of non-blocking work only, never across a wait.
The I/O thread sleeps in ``select.poll`` on the socket's ``ZMQ_FD`` and the wake pipe, never inside
a socket call. ``ZMQ_FD`` is edge-triggered (it says that the socket's state changed, and any
socket call may consume that), so every pass reads ``ZMQ_EVENTS`` last, and a caller's pass that
leaves a reply unread, or a timer earlier than the thread's sleep, wakes the thread. A step's
expiry is bookkeeping (its caller gives up at its own deadline): the next pass does it, whoever
runs it. Callers read immutable snapshots only (``gate``, ``handshake.welcome``/``pinned``/``epoch``,
``budget.ms``, ``advised_k``, ``last_timing``).

A reply's caller is woken last: its future is claimed during the pass and its result set once
the pass is over (``calls.Wakeups``), so the woken caller finds the GIL free instead of waiting
for the rest of the pass.

Who watches the socket for replies: the I/O thread, unless a caller waiting in ``step()``
(``await_step``) does. Such a caller (the owner) polls the socket's FD itself until its deadline
and runs the pass its reply wakes it for: the reply reaches it with no hop through the I/O thread,
whose poll leaves the FD out while a caller owns it (one thread woken per reply, never two racing
for the GIL). Ownership is sticky between a caller's steps, so a caller that steps back to back
hands nothing over; the I/O thread takes the socket back once the owner has stopped watching for
``_RECLAIM_S`` (meanwhile a Pong or a late reply waits at most that long), and at once when the
owner leaves while other calls wait. A pass elsewhere that reads a reply while a caller owns the
socket rings the owner (its reply may be among them, and its FD's edge gone). With
``ClientConfig.wait_spin_ms`` the owner sleeps only until that long before its reply is due (its
previous wait's length), then polls without sleeping for at most twice that long: the reply finds
it awake, not waiting for the scheduler to run a woken thread.

A burst larger than the budget (``resend`` module docstring, "catching up"): a step that misses,
or is answered EXPIRED, while its session's big rows are unproven leaves the session behind; its
next steps send rows ingest-only and are not waited for (a call whose every request is answered
locally is pending as "taps": acknowledgements only, never a breaker miss, outcome
"catching_up"), until a prompt acknowledgement shows the server holds the burst and takes rows
in time again (the next step is a trial), or the server's epoch changes.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import os
import select
import threading
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import msgspec
import numpy as np
import zmq

from protocol import (
    FEATURE_EARLY_TAPS,
    EntryResult,
    Error,
    ErrorCode,
    Free,
    Phase,
    Ping,
    Pong,
    Status,
    StepResult,
    Timing,
    Welcome,
    direct,
)
from protocol.codec import ProtocolError, decode_reply, encode, tensor
from protocol.wake import WakePipe, repoll
from target_client.api import ClientConfig, DraftClientError, DraftReply, empty_replies
from target_client.client import step_builder
from target_client.client.breaker import Breaker
from target_client.client.calls import (
    CloseCmd,
    Connect,
    FreeCmd,
    Outcome,
    Pending,
    PingCmd,
    StepCall,
    Wakeups,
    set_future,
)
from target_client.client.counters import Counters
from target_client.client.handshake import Handshake
from target_client.client.resend import SessionRows
from target_client.client.step_builder import AdaptiveBudget, merge_rows, room_for_resend, step_frames

log = logging.getLogger("target_client")

_EXPIRED_KEEP = 4096  # timed-out calls remembered so their late replies can still acknowledge rows
_MAX_RETRY_AFTER_S = 5.0  # cap on a server's retry hint
_SWEEP_EVERY_S = 5.0
_FLUSH_EVERY_S = 1.0  # queued metric updates reach a registry another process exports within this
# The I/O thread expires a step this long after the caller's own deadline, so that at the deadline
# only the caller wakes (it gives up by itself; the I/O thread's expiry is bookkeeping).
_EXPIRE_GRACE_S = 0.002
_CALLER_WAIT_S = 0.001  # the longest a caller's command waits for the I/O thread's pass (``_caller_pass``)
_FREE_CHUNK = 1024  # sessions per Free message
_COMMANDS_PER_ITERATION = 256
_NO_ROOM_LIMIT = 1 << 62  # resend room of a step that is not sent (its rows are only buffered)
_APPLIED = (Status.OK, Status.EXPIRED)
_OK = Status.OK
_POLLIN = int(zmq.POLLIN)  # zmq's flag enums cost a Python call per operation; the loop uses ints
_POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
_CALL_KINDS = ("step", "taps")  # pending calls whose expiry is bookkeeping (the caller times out by itself)
_RECLAIM_S = 0.005  # the I/O thread watches the socket again this long after its owner stopped


def random_routing_id() -> bytes:
    return b"dc-" + os.urandom(12)  # never starts with a zero byte (reserved by ZeroMQ)


class IoLoop:
    """The socket-owning thread of one DraftClient and the state only it writes."""

    def __init__(self, cfg: ClientConfig, routing_id: bytes, counters: Counters, device: int | None = None) -> None:
        self.cfg = cfg
        self.routing_id = routing_id
        self._c = counters
        self._m = counters.m

        # Snapshots written by this thread, read by callers (single attribute reads).
        self.gate: str | None = "not_ready"  # None: steps are sent; else the outcome of an immediate return
        self.advised_k = -1  # the server's latest load-aware k advice
        self.last_timing: Timing | None = None  # server timing of the latest on-time StepResult
        self.handshake = Handshake(cfg, counters, device)
        self.budget = AdaptiveBudget(cfg, self._m.budget)

        # Written by callers (append), drained by this thread.
        self._cmds: collections.deque[Any] = collections.deque()

        # This thread's state (touched by no other thread once the thread has started).
        self.breaker = Breaker(cfg.breaker_failures, cfg.breaker_backoff_ms, cfg.breaker_step_probe_ms)
        self.sessions: dict[str, SessionRows] = {}
        self.pending: dict[int, Pending] = {}
        self._expired: collections.OrderedDict[int, Pending] = collections.OrderedDict()
        self._ids = itertools.count(1)
        self._gauge_on = False  # this client counted in draft_client_breaker_open
        self._ping_queue: list[PingCmd] = []  # caller pings waiting for a live connection
        self._next_sweep = time.monotonic() + _SWEEP_EVERY_S
        self._next_flush = time.monotonic() + _FLUSH_EVERY_S
        self._closing = False
        self._ready: Any = None  # cuda_ipc: the caller's event after its latest device rows (StepCall.ready)
        self._lock = threading.Lock()  # the socket and all of the state above (see the module docstring)
        self._wakeups = Wakeups()  # callers whose results are set once the pass is over
        self._sleep_until = -math.inf  # when the I/O thread's current sleep ends (written under the lock)
        self._owner: int | None = None  # the caller thread watching the socket for replies (None: the I/O thread)
        self._owner_polling = False  # the owner is in its wait now (only the owner clears it)
        self._owner_seen = 0.0  # when the owner last stopped waiting
        self._unread = False  # the latest read of ZMQ_EVENTS saw a reply waiting (so its FD edge is gone)
        self._spin_s = cfg.wait_spin_ms / 1000.0  # the owner's unslept polling before a reply is due
        self._last_wait_s = 0.0  # the owner's previous wait, entry to reply (what the next one is expected to take)
        self._shut = False  # the thread has shut the loop down (socket gone)
        self._link: direct.Link | None = None  # the direct link the server's Welcome offered (``protocol.direct``)
        self.direct_sent = self.direct_read = 0  # messages over it (stats(): ``direct_sent``, ``direct_read``)
        self._socket_steps: set[int] = set()  # Steps sent over the socket beside a link, not yet answered

        # The socket is made here so a bad endpoint fails in the constructor, then handed to the
        # I/O thread (thread start is the full memory barrier ZeroMQ asks for when a socket moves).
        self._ctx = zmq.Context(io_threads=1)
        try:
            self._sock = self._make_socket()
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise ValueError(f"cannot connect a DEALER to {cfg.endpoint!r}: {exc}") from exc
        # A frame above zmq.COPY_THRESHOLD goes out without a copy, and pyzmq's first such frame
        # imports zmq.utils.garbage and starts its collector thread: measured at 13-16 ms with
        # the GIL held in the first steps of a K3 soak (the caller could not return at its
        # deadline). Paid here instead, before any step.
        zmq.Frame(bytes(zmq.COPY_THRESHOLD + 1), copy=False)
        self._wake_pipe = WakePipe()  # wakes the I/O thread
        self._owner_bell = WakePipe()  # rings the owner: a pass elsewhere read replies
        self._zfd = self._sock.get(zmq.FD)
        self._owner_poll = select.poll()  # the owner's: the socket and its ring
        self._owner_poll.register(self._zfd, select.POLLIN)
        self._owner_poll.register(self._owner_bell.fd, select.POLLIN)
        self.thread = threading.Thread(target=self._run, name=f"draft-client-io-{cfg.name}", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ caller side

    def submit(self, cmd: object) -> None:
        """Queue a command and run it now, in this thread, when the loop's lock is free; else wake
        the I/O thread, which holds it (any thread; never waits)."""
        self._cmds.append(cmd)
        self._caller_pass()

    def gave_up(self, deadline: float) -> None:
        """A caller stopped waiting for its step at ``deadline``: expire the steps due by then now (a
        miss for the breaker at once, as the I/O thread's own expiry would count it a little later)."""
        self._caller_pass(deadline)

    def _caller_pass(self, due: float | None = None) -> None:
        # the I/O thread's pass holds the loop (a reply's acks, a timer): a caller's command waits for
        # its end, ``_CALLER_WAIT_S`` at most, rather than be left to that thread's next pass, which needs
        # the GIL the caller takes straight back (a target sampling: its commit would go out after it);
        # a caller giving up at its deadline never waits
        if not self._lock.acquire(blocking=False) and (
            due is not None or not self._lock.acquire(timeout=_CALLER_WAIT_S)
        ):
            self._wake()  # the I/O thread holds the loop: it passes again before it sleeps
            return
        wake = ring = False
        try:
            wake, ring = self._caller_pass_locked(due)
        finally:
            self._lock.release()
            self._wakeups.release()
        if wake:
            self._wake()
        if ring:
            self._ring_owner()
        self._m.later.flush()  # the Step is out and the caller waits for its reply anyway

    def await_step(self, call: StepCall) -> Outcome | None:
        """A step's outcome, waiting at most until its deadline (None: none by then). The caller
        watches the socket itself when nobody else does (see the module docstring), else waits on
        the step's future."""
        fut = call.future
        assert fut is not None
        if not fut.done() and call.deadline > time.monotonic() and self._own(call.deadline):
            self._watch(fut, call.deadline)
        try:
            return fut.result(timeout=max(0.0, call.deadline - time.monotonic()))
        except (FutureTimeout, FutureCancelled):
            return None

    def _own(self, deadline: float) -> bool:
        """Make this thread the socket's owner; False when another caller watches it now (its
        passes resolve this caller's step too) or the loop is closing. Waits for a pass that holds
        the loop to end (never past ``deadline``): giving up here while this thread owns the
        socket from an earlier step would leave nobody watching it until the I/O thread takes it
        back."""
        me = threading.get_ident()
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            if self._owner == me:  # nobody watches: the I/O thread must
                self._owner = None
                self._wake()
            return False
        try:
            owner = self._owner
            if self._closing or (owner not in (None, me) and self._owner_polling):
                return False
            self._owner = me
            self._owner_polling = True  # under the lock: the I/O thread never takes back a socket in use
        finally:
            self._lock.release()
        if owner is None:
            self._wake()  # the I/O thread may sleep on the socket: it leaves the FD out from its next poll
        return True

    def _watch(self, fut: Future, deadline: float) -> None:
        """The owner's wait: poll the socket (and the owner's ring) until ``fut`` is done or the
        deadline passes, and run a pass for what arrives."""
        t0 = time.monotonic()
        # ``wait_spin_ms``: unslept from spin_from (due: the previous wait's length) to spin_to
        spin_from = t0 + self._last_wait_s - self._spin_s
        spin_to = spin_from + 2.0 * self._spin_s if self._spin_s else -math.inf
        try:
            while not fut.done():
                now = time.monotonic()
                ms = math.ceil((deadline - now) * 1000.0)
                if ms <= 0:
                    return
                if self._unread:  # FD's edge taken: look now
                    ready = self._owner_poll.poll(0)
                elif now < spin_to:  # asleep until spin_from (to the millisecond below it), then unslept
                    ready = self._owner_poll.poll(min(ms, int((spin_from - now) * 1000.0)) if now < spin_from else 0)
                    if not ready:
                        continue
                else:
                    ready = self._owner_poll.poll(ms)
                for fd, _ in ready:
                    if fd == self._owner_bell.fd:
                        self._owner_bell.drain()
                if self._closing or not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    return
                try:
                    wake, _ = self._caller_pass_locked(None)
                finally:
                    self._lock.release()
                    self._wakeups.release()
                if wake:
                    self._wake()
            if self._spin_s and fut.done():
                self._last_wait_s = time.monotonic() - t0
        finally:
            self._owner_seen = time.monotonic()
            self._owner_polling = False
            if self._cmds or any(p.kind == "step" and p.future is not fut for p in list(self.pending.values())):
                self._owner = None  # other callers wait on their futures: the I/O thread watches for them
                self._wake()

    def _ring_owner(self) -> None:
        """A pass that is not the owner's read replies while a caller owns the socket: wake it."""
        if self._owner is not None and self._owner != threading.get_ident():
            self._owner_bell.ring()

    def _caller_pass_locked(self, due: float | None) -> tuple[bool, bool]:
        """A pass in a caller's thread (under the lock). Returns whether the I/O thread must look
        (a reply is left unread while it watches the socket, something waits for the socket to turn
        writable, commands are left over, a timer is due before its sleep ends, or the loop is
        closing) and whether another thread that owns the socket must (it may have lost its reply
        or its FD's edge to this pass; a reply left for this thread, the owner, it reads itself)."""
        if self._closing:
            if self._shut:  # the thread has gone: nobody else answers what was just queued
                self._close_commands()
            return True, True
        try:
            got = self._pass(self._link is not None or bool(self._sock.get(_EVENTS) & _POLLIN), due)
        except Exception:  # the I/O thread's own pass counts and logs it the same way
            self._c.add("io_errors")
            log.exception("draft client %s: a caller's pass of the I/O loop failed", self.cfg.name)
            return True, True
        ev = self._sock.get(_EVENTS)  # last: whoever sleeps on the FD's edge may have lost it to this read
        unread = self._unread = bool(ev & _POLLIN)
        owner = self._owner
        ring = owner is not None and owner != threading.get_ident() and bool(got or unread)
        if (unread and owner is None) or (ev & _POLLOUT and self._out_due()) or self._cmds or self._closing:
            return True, ring
        return self._wake_at(time.monotonic(), calls=False) < self._sleep_until, ring

    def _wake(self) -> None:
        self._wake_pipe.ring()  # never into a closed (or reused) descriptor: WakePipe.close takes its lock

    def stop(self, timeout_s: float) -> None:
        """Stop the thread (it drops the socket, LINGER 0) and close the wake pipe; bounded."""
        self._cmds.append(CloseCmd())
        self._wake()
        self.thread.join(timeout_s)
        if self.thread.is_alive():  # pragma: no cover - would need a wedged libzmq call
            log.error("draft client %s: I/O thread did not stop within %.1f s", self.cfg.name, timeout_s)
            return
        self._wake_pipe.close()
        self._owner_bell.close()

    # ------------------------------------------------------------------ the loop

    def _make_socket(self) -> zmq.Socket:
        cfg = self.cfg
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IMMEDIATE, 1)  # queue only towards a live connection; else sends fail fast
        s.setsockopt(zmq.ROUTING_ID, self.routing_id)  # stable across TCP reconnects: sessions survive
        s.setsockopt(zmq.RECONNECT_IVL, cfg.reconnect_ivl_ms)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, cfg.reconnect_ivl_max_ms)
        s.setsockopt(zmq.MAXMSGSIZE, cfg.max_reply_bytes)
        s.setsockopt(zmq.SNDHWM, cfg.send_hwm)
        if cfg.curve_server_key is not None:
            pub, sec = cfg.curve_public_key, cfg.curve_secret_key
            if pub is None or sec is None:
                pub, sec = zmq.curve_keypair()
            s.curve_serverkey = cfg.curve_server_key
            s.curve_publickey = pub
            s.curve_secretkey = sec
        s.connect(cfg.endpoint)
        return s

    def _run(self) -> None:
        poller = select.poll()
        rfd = self._wake_pipe.fd
        polled: set[int] = set()
        watching = False  # the socket's FD (and the direct link's) in the poll: not while a caller owns the socket
        timeout = 0  # the socket's state may have changed before the first read of ZMQ_EVENTS
        failures = 0  # consecutive passes that raised
        try:
            while True:
                got = 0
                try:
                    if watching != (self._owner is None):
                        watching = not watching
                        if watching:
                            timeout = 0  # its edge may have gone to the owner: look first
                    want = {rfd}
                    if watching:
                        want.add(self._zfd)
                        if self._link is not None:
                            want.add(self._link.fileno())
                    polled = repoll(poller, polled, want)
                    for fd, _ in poller.poll(timeout):
                        if fd == rfd:
                            self._drain_wake()
                    with self._lock:
                        self._reclaim()
                        got = self._pass(True)
                        if self._closing:
                            break
                        timeout = self._sleep_ms()
                    failures = 0
                except zmq.ContextTerminated:
                    raise
                except Exception:  # one bad pass must not end the thread: log it and go on
                    failures += 1
                    self._c.add("io_errors")
                    log.exception("draft client %s: I/O loop iteration failed (%d in a row)", self.cfg.name, failures)
                    if failures >= 100:
                        raise
                    time.sleep(min(0.001 * failures, 0.05))
                    timeout = 0
                finally:
                    self._wakeups.release()  # last before the poll: the woken callers find the GIL free
                    if got:
                        self._ring_owner()
        except Exception:
            log.exception("draft client %s: I/O thread failed; drafting is off for this client", self.cfg.name)
        finally:
            with self._lock:
                self._shutdown()
            self._wakeups.release()
            self._ring_owner()  # an owner waiting on the socket: the loop is closed

    def _reclaim(self) -> None:
        """The I/O thread takes the socket back from a caller that stopped watching it a while ago."""
        if self._owner is not None and not self._owner_polling and time.monotonic() - self._owner_seen >= _RECLAIM_S:
            self._owner = None

    def _pass(self, readable: bool, due: float | None = None) -> int:
        """One pass over everything due (under the lock): replies (when ``readable``), expiry
        (``due``: of every step due by then, its caller gave up), commands, timers, and the sends
        that wait for a writable socket. Returns the replies read."""
        if self._closing:
            return 0
        now = time.monotonic()
        got = self._recv_all(now) if readable else 0  # replies first: their acks shape the next resend
        self._expire(now, due)  # before the commands: a step sees the breaker its predecessor's miss opened
        self._drain_commands(now)
        if self._closing:
            return got
        now = time.monotonic()
        self._timers(now)
        if self._out_due() and (self._sock.get(_EVENTS) & _POLLOUT):
            self._send_due(now)
        return got

    def _out_due(self) -> bool:
        return self.handshake.hello_due or self.breaker.probe_due or bool(self._ping_queue)

    def _sleep_ms(self) -> int:
        """How long the I/O thread may sleep on the FD and the pipe (ZMQ_EVENTS read last)."""
        now = time.monotonic()
        ev = self._sock.get(_EVENTS)
        self._unread = bool(ev & _POLLIN)
        if self._cmds or ev & _POLLIN or (ev & _POLLOUT and self._out_due()):
            self._sleep_until = now
            return 0  # commands left over from a bounded drain, a reply, or a send that can go now
        t = self._wake_at(now, calls=True)
        if self._owner is not None:  # a caller owns the socket: look again in a while, to take it back
            t = min(t, now + _RECLAIM_S)
        self._sleep_until = t
        return max(0, math.ceil((t - now) * 1000.0))

    def _wake_at(self, now: float, calls: bool) -> float:
        """The next time a pass has something to do (``calls``: a step's expiry included)."""
        t = min(now + 1.0, self._next_sweep, self._next_flush)
        for p in self.pending.values():
            if p.kind not in _CALL_KINDS:
                t = min(t, p.deadline)
            elif calls:
                t = min(t, p.deadline + (_EXPIRE_GRACE_S if p.kind == "step" else 0.0))
        for q in self._ping_queue:
            t = min(t, q.deadline)
        return min(t, self.handshake.wake_at(), self.breaker.wake_at())

    def _drain_wake(self) -> None:
        self._wake_pipe.drain()

    def _drain_commands(self, now: float) -> None:
        # Bounded: callers may keep appending (e.g. fast breaker-open steps); timers, expiry and
        # replies must still run every iteration. Leftovers make the next poll return at once.
        cmds = self._cmds
        for _ in range(min(len(cmds), _COMMANDS_PER_ITERATION)):
            cmd = cmds.popleft()
            try:
                if isinstance(cmd, StepCall):
                    self._do_step(cmd, now)
                elif isinstance(cmd, Connect):
                    self.handshake.connect(cmd.future)
                elif isinstance(cmd, PingCmd):
                    self._do_ping(cmd, now)
                elif isinstance(cmd, FreeCmd):
                    self._do_free(cmd)
                elif isinstance(cmd, CloseCmd):
                    self._closing = True
                    return
            except Exception:
                log.exception("draft client %s: command %s failed", self.cfg.name, type(cmd).__name__)
                if isinstance(cmd, StepCall):
                    self._wakeups.resolve(cmd.future, empty_replies(len(cmd.entries)), "error")

    # ------------------------------------------------------------------ sending

    def _try_send(self, frames: list[Any], link_ok: bool = True, step_id: int = 0) -> bool:
        """Send without blocking: a header-only message over the direct link when there is one
        (``link_ok``: not a Hello, which opens the link), else over the socket; False if neither took it.
        Steps keep their order: while a Step that went over the socket (``step_id``: its rows in a frame)
        waits for its reply, the next ones go that way too."""
        link = self._link
        if self._socket_steps:
            self._socket_steps = {c for c in self._socket_steps if c in self.pending}
        if (
            link is not None
            and link_ok
            and len(frames) == 1
            and len(frames[0]) <= direct.MAX_MESSAGE
            and not (step_id and self._socket_steps)
        ):
            sent = link.send(frames[0])
            if sent:
                self.direct_sent += 1
                return True
            if sent is None:  # broken (the server went): ZeroMQ from now on, until the next Welcome
                self._close_link()
        try:
            self._sock.send_multipart(frames, flags=_NOBLOCK, copy=False)
            if step_id and link is not None:
                self._socket_steps.add(step_id)
            return True
        except zmq.ZMQError:  # EAGAIN: no live connection (IMMEDIATE) or the send queue is full
            self._c.add("send_failures")
            return False

    def _do_step(self, call: StepCall, now: float) -> None:
        cfg = self.cfg
        hs = self.handshake
        self.breaker.stepped(now)
        if call.ready is not None:  # the caller's latest device rows: it covers every earlier one too
            self._ready = call.ready
        n = len(call.entries)
        welcome = hs.welcome
        send = call.send and self.gate is None and welcome is not None
        if call.phase != Phase.WHOLE and (welcome is None or FEATURE_EARLY_TAPS not in welcome.features):
            # the server (restarted into an older build?) lacks early taps: taps are only buffered
            # (the commit carries them), a commit goes as the single message's entry
            send = send and call.phase == Phase.COMMIT
            call.entries = tuple(msgspec.structs.replace(e, phase=Phase.WHOLE) for e in call.entries)
            call.phase = Phase.WHOLE
        layout = hs.layout
        room = _NO_ROOM_LIMIT
        if send:
            assert layout is not None and welcome is not None
            room = room_for_resend(cfg, call, layout, welcome.limits)
        cid = next(self._ids) if send else None
        merged = merge_rows(call, self.sessions, now, cid, layout, room, cfg.resend_rows_limit, self._in_taps)
        if merged.skipped:
            self._c.entries_skipped.inc(merged.skipped)
        if merged.behind:
            self._c.add("catching_up_entries", merged.behind)
        self._c.dropped_rows(merged.dropped)
        if not send:
            if call.phase != Phase.TAPS:
                self.breaker.gated_step(now, hs.need_hello)  # probe now if the breaker is open
            self._wakeups.resolve(call.future, empty_replies(n), self.gate or "not_ready")
            return
        if not merged.entries:  # everything held back, or catching up with nothing to ingest
            self._wakeups.resolve(call.future, merged.replies(n), "catching_up" if merged.behind else "overloaded")
            return
        assert layout is not None and cid is not None and welcome is not None
        ring = hs.rows_ring
        gen = ring.generation if ring is not None else 0
        frames = step_frames(
            merged, call, cid, layout, cfg.wire_format, welcome.limits, cfg.reply_margin_ms, ring, self._ready
        )
        if ring is not None and merged.parts:
            in_ring = ring.generation != gen
            m = self._m
            if hs.cuda:
                m.later.later((m.cuda_ipc_steps if in_ring else m.cuda_ipc_fallbacks.labels("buffer_full")).inc, 1)
            else:
                m.later.later((m.shm_steps if in_ring else m.shm_fallbacks.labels("ring_full")).inc, 1)
        if not self._try_send(frames, step_id=cid):
            if ring is not None and ring.generation != gen:
                ring.cancel(ring.generation)  # never sent: the region is free again
            for sess in merged.sessions:
                self.sessions[sess].unsent()
            self._wakeups.resolve(call.future, merged.replies(n), "error")
            self._miss(now)
            return
        call.sent_at = time.monotonic()
        if merged.resent:
            self._m.resent_rows.inc(merged.resent)
            self._c.add("resent_rows", merged.resent)
        if call.phase == Phase.TAPS:
            self._c.add("taps_sent")
        detached = call.phase == Phase.TAPS or len(merged.local) == n  # nobody waits for its reply
        self.pending[cid] = Pending(
            "taps" if detached else "step",
            cid,
            call.deadline,
            now,
            call.future,
            tuple(merged.sessions),
            tuple(merged.index),
            tuple(merged.ks),
            merged.local,
            n,
            tuple(e.after if e.phase == Phase.COMMIT else 0 for e in merged.entries),
        )
        if detached and call.phase != Phase.TAPS:  # every request catching up: rows ingest-only, no wait
            self._wakeups.resolve(call.future, merged.replies(n), "catching_up")

    def _in_taps(self, call_id: int) -> bool:
        """Whether ``call_id`` is an early Taps call still awaiting its reply."""
        p = self.pending.get(call_id)
        return p is not None and p.kind == "taps"

    def _do_ping(self, cmd: PingCmd, now: float) -> None:
        if not self._send_ping(cmd, now):
            self._ping_queue.append(cmd)  # no live connection yet: sent when the socket turns writable

    def _send_ping(self, cmd: PingCmd, now: float) -> bool:
        cid = next(self._ids)
        if not self._try_send(encode(Ping(call_id=cid))):
            return False
        self.pending[cid] = Pending("ping", cid, cmd.deadline, now, cmd.future)
        return True

    def _do_free(self, cmd: FreeCmd) -> None:
        dropped = 0
        for name in cmd.sessions:
            s = self.sessions.pop(name, None)
            if s is not None:
                dropped += s.rows
        self._c.dropped_rows(dropped)
        for i in range(0, len(cmd.sessions), _FREE_CHUNK):
            if self._try_send(encode(Free(sessions=cmd.sessions[i : i + _FREE_CHUNK]))):
                self._c.add("frees_sent")

    def _send_due(self, now: float) -> None:
        hs = self.handshake
        if hs.hello_due:
            cid = next(self._ids)
            deadline = hs.hello_sent(now, self._try_send(encode(hs.hello(cid)), link_ok=False))
            if deadline is not None:
                self.pending[cid] = Pending("hello", cid, deadline, now)
        if self._ping_queue:
            queue, self._ping_queue = self._ping_queue, []
            for i, cmd in enumerate(queue):
                if not self._send_ping(cmd, now):
                    self._ping_queue = queue[i:]
                    break
        if self.breaker.probe_due:
            cid = next(self._ids)
            deadline = self.breaker.probe_sent(now)
            if self._try_send(encode(Ping(call_id=cid))):
                self._c.add("probes_sent")
                self.pending[cid] = Pending("probe", cid, deadline, now)

    # ------------------------------------------------------------------ timers

    def _timers(self, now: float) -> None:
        self.handshake.tick(now)
        self.breaker.tick(now, self.handshake.need_hello)
        if now >= self._next_flush:  # metric updates queued while no caller stepped
            self._next_flush = now + _FLUSH_EVERY_S
            self._m.later.flush()
        if now >= self._next_sweep:
            self._next_sweep = now + _SWEEP_EVERY_S
            idle = now - self.cfg.session_idle_s
            for name in [k for k, s in self.sessions.items() if s.last_used < idle]:
                del self.sessions[name]

    def _expire(self, now: float, due: float | None = None) -> None:
        if self._ping_queue:
            for cmd in self._ping_queue:
                if cmd.deadline <= now:
                    set_future(cmd.future, None)
            self._ping_queue = [c for c in self._ping_queue if c.deadline > now]
        late = now - _EXPIRE_GRACE_S if due is None else max(due, now - _EXPIRE_GRACE_S)
        for cid in [c for c, p in self.pending.items() if p.deadline <= (late if p.kind == "step" else now)]:
            p = self.pending.pop(cid)
            if p.kind in ("step", "taps"):  # a late reply may still acknowledge rows
                self._expired[cid] = p
                while len(self._expired) > _EXPIRED_KEEP:
                    self._expired.popitem(last=False)
            if p.kind == "step":
                if p.future is not None:
                    p.future.cancel()  # the caller gives up at the same deadline; a later reply is late
                self._miss(now)
                self._fell_behind(p, now)
            elif p.kind == "ping" and p.future is not None:
                set_future(p.future, None)

    # ------------------------------------------------------------------ receiving

    def _recv_all(self, now: float) -> int:
        sock = self._sock
        n = 0
        if self._link is not None:
            for header in self._read_link():
                n += 1
                self._on_bufs([header], now)
        for _ in range(1024):
            if not sock.get(_EVENTS) & _POLLIN:
                break
            try:
                frames = sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:  # not expected after POLLIN (a message's parts arrive together)
                break
            n += 1
            self._on_bufs([f.buffer for f in frames], now)
        return n

    def _on_bufs(self, bufs: list[Any], now: float) -> None:
        """One reply's frames (a direct link's message: its header alone)."""
        try:
            self._on_reply(bufs, now)
        except Exception:
            log.exception("draft client %s: reply handling failed", self.cfg.name)
            self._c.bad_reply()

    def _on_reply(self, bufs: list[Any], now: float) -> None:
        if len(bufs) > 1 and len(bufs[0]) == 0:  # tolerate a REQ-style empty delimiter
            bufs = bufs[1:]
        try:
            msg = decode_reply(bufs[0])
        except ProtocolError:
            self._c.bad_reply()
            return
        if isinstance(msg, StepResult):
            self._on_result(msg, bufs[1:], now)
        elif isinstance(msg, Pong):
            self._on_pong(msg, now)
        elif isinstance(msg, Welcome):
            self._on_welcome(msg, now)
        elif isinstance(msg, Error):
            self._on_error(msg, now)

    def _take_pending(self, call_id: int) -> tuple[Pending | None, bool]:
        """The call a reply answers and whether it is late (expired already), or (None, False)."""
        p = self.pending.pop(call_id, None)
        if p is not None:
            return p, False
        p = self._expired.pop(call_id, None)
        return p, p is not None

    def _on_result(self, msg: StepResult, payloads: list[memoryview], now: float) -> None:
        if msg.ring is not None and self.handshake.ring is not None:
            self.handshake.ring.ack(msg.ring)  # regions the server is done with, whatever the call
        p, late = self._take_pending(msg.call_id)
        if p is None or p.kind not in ("step", "taps"):
            self._c.bad_reply()  # a call we never made, or one long forgotten
            return
        if p.kind == "taps":
            self._on_taps_result(msg, p, now)
            return
        self._m.later.later(self._m.rtt.observe, now - p.sent_at)
        self.budget.add(now - p.sent_at)
        if self.handshake.contract_differs(msg.contract_id):
            self._note_epoch(msg.epoch)
            self._contract_changed(msg.contract_id)
            self._failed_step(p, now, late)
            return
        if len(msg.results) != len(p.sessions):
            self._note_epoch(msg.epoch)
            self._c.bad_reply()
            self._failed_step(p, now, late)
            return
        self._ack(p, msg.results, now)
        self._note_epoch(msg.epoch)  # after the acks: this reply's own acks stand
        self.last_timing = msg.timing  # set before the future resolves, so a lone caller sees its own
        if late or not self._wakeups.resolve(p.future, self._replies(p, msg.results, payloads), "ok"):
            self._late(p, now, late)
            return
        if self.breaker.success():  # a call in flight when the breaker opened came back in time
            self._breaker_closed()
        if not self.handshake.verifying:  # answered in time on the ring the server maps: no restart
            self.handshake.drop_spare(now)
        self.advised_k = msg.advised_k
        self._c.entries_answered(msg.results)

    def _on_taps_result(self, msg: StepResult, p: Pending, now: float) -> None:
        """An early Taps call's reply: acknowledgements only (nobody waits; never a breaker miss)."""
        if self.handshake.contract_differs(msg.contract_id) or len(msg.results) != len(p.sessions):
            self._note_epoch(msg.epoch)
            self._c.bad_reply()
            return
        self._ack(p, msg.results, now)
        self._c.entries_answered(msg.results)
        self._note_epoch(msg.epoch)

    def _ack(self, p: Pending, results: Sequence[EntryResult], now: float) -> None:
        """The resend buffers after a reply to call ``p``: rows acknowledged, held back, or due
        again; a burst proven (or refused), or a session behind it (``resend``: catching up). A commit
        answered OK drafted from every row below its position, and it names the early Taps call whose
        rows those are (``after``: the server checks that call's rows reached the session last), so
        it acknowledges them as that call's reply would: a Taps call whose own reply was lost (or is
        late) leaves nothing to resend, which at 8 sessions x 5 rows outgrew a step's resend room and
        made the client give rows up and restart sessions the server held whole."""
        afters = p.afters or (0,) * len(p.sessions)
        cid, fast = p.call_id, step_builder.FAST_PATHS
        for name, r, k, after in zip(p.sessions, results, p.ks, afters, strict=True):
            s = self.sessions.get(name)
            if s is None:
                continue
            if (  # the steady state (``FAST_PATHS``): an OK for rows this call alone carried, in full; no
                # burst, nothing given up
                fast
                and r.status is _OK
                and s.big_call is None
                and not after
                and s.call_id == cid
                and s.unsure_call is None
                and s.lost_end < 0
                and len(ch := s.chunks) == 1
                and ch[0][0] + len(ch[0][1]) <= r.end
            ):
                s.chunks, s.call_id = [], None  # what ``resynced`` and ``ack`` do for it
                continue
            if s.big_call is not None:
                if r.status not in _APPLIED and (p.call_id == s.big_call or r.status == Status.MISSING_ROWS):
                    s.caught_up()  # the burst was refused or is not there: nothing to wait for
                elif r.status == Status.OK:
                    s.acked(p.call_id, now <= p.deadline, r.start)
                    if r.drafts:
                        s.drafted(p.call_id, now <= p.deadline)
                elif r.status == Status.EXPIRED and k:  # the server could not draft it in time
                    s.fell_behind(now)
            if r.status == Status.OK:
                s.resynced(p.call_id, r.start)
            if r.status in _APPLIED:
                s.ack(p.call_id, r.end)
                if after and r.status == Status.OK:
                    s.ack(after, r.end)
            elif r.status == Status.MISSING_ROWS:
                s.unsent()  # the early taps carrying them did not arrive: the next step resends
            elif r.status == Status.OVERLOADED and r.retry_after_ms > 0:
                s.retry_at = now + min(r.retry_after_ms / 1000.0, _MAX_RETRY_AFTER_S)

    def _failed_step(self, p: Pending, now: float, late: bool) -> None:
        """A step's reply came but is unusable: the caller gets empty drafts and it is a miss."""
        if not late and self._wakeups.resolve(p.future, self._replies(p, None, ()), "error"):
            self._miss(now)
        else:
            self._late(p, now, late)

    def _late(self, p: Pending, now: float, already_missed: bool) -> None:
        self._m.late_replies.inc()
        self._c.add("late_replies_dropped")
        if not already_missed:  # the caller gave up before the I/O thread's own expiry
            self._miss(now)
            self._fell_behind(p, now)

    def _fell_behind(self, p: Pending, now: float) -> None:
        """Step ``p`` missed: its sessions with a burst still unproven are behind it (``resend``)."""
        for name in p.sessions:
            s = self.sessions.get(name)
            if s is not None:
                s.fell_behind(now)

    def _replies(self, p: Pending, results: Sequence[EntryResult] | None, payloads: Sequence[Any]) -> list[DraftReply]:
        local = p.local or {}
        out: list[DraftReply | None] = [None] * p.n
        if results is not None:
            pinned = self.handshake.pinned
            vocab = pinned.vocab_size if pinned is not None else 1 << 62
            fast = step_builder.FAST_PATHS
            for idx, k, r in zip(p.index, p.ks, results, strict=True):
                if local and idx in local:  # a request catching up keeps its local reply (its entry was ingest-only)
                    continue
                d = r.drafts
                if (  # the steady state (``FAST_PATHS``): ``_reply``'s, inline
                    fast
                    and r.status is _OK
                    and len(d) <= k
                    and r.probs is None
                    and not r.confidence
                    and (not d or (min(d) >= 0 and max(d) < vocab))
                ):
                    out[idx] = DraftReply(list(d), _OK, [], None, None, r.retry_after_ms, r.message, r.start)
                    continue
                out[idx] = self._reply(r, k, vocab, payloads)
        for i, rep in enumerate(out):
            if rep is None:  # requests answered locally, or not at all
                out[i] = local.get(i) or DraftReply([])
        return out  # type: ignore[return-value]

    def _reply(self, r: EntryResult, k: int, vocab: int, payloads: Sequence[Any]) -> DraftReply:
        if r.status != Status.OK:
            return DraftReply([], r.status, retry_after_ms=r.retry_after_ms, message=r.message, start=r.start)
        d = r.drafts
        tokens = list(d) if len(d) <= k else list(d[:k])  # msgspec already checked they are ints
        if tokens and (min(tokens) < 0 or max(tokens) >= vocab):
            self._c.bad_reply()
            return DraftReply([], r.status, message="drafts outside the vocabulary dropped")
        if r.probs is None and not r.confidence:  # the common case (64 of these a step on the caller's path)
            return DraftReply(tokens, _OK, [], None, None, r.retry_after_ms, r.message, r.start)
        probs = prob_ids = None
        if r.probs is not None and r.prob_ids is not None:
            try:
                probs = np.array(tensor(r.probs, payloads))
                prob_ids = np.array(tensor(r.prob_ids, payloads))
            except ProtocolError:
                self._c.bad_reply()
                probs = prob_ids = None
        return DraftReply(
            tokens, r.status, list(r.confidence[: len(tokens)]), probs, prob_ids, r.retry_after_ms, r.message, r.start
        )

    def _on_pong(self, msg: Pong, now: float) -> None:
        p, _ = self._take_pending(msg.call_id)
        self._c.add("pongs")
        self._note_epoch(msg.epoch)
        if self.handshake.contract_differs(msg.contract_id):
            self._contract_changed(msg.contract_id)
        elif msg.healthy and self.breaker.pong():  # half-open: steps go out again, on trial
            self._breaker_closed()
        if p is not None and p.kind == "ping" and p.future is not None:
            set_future(p.future, msg)

    def _on_welcome(self, w: Welcome, now: float) -> None:
        hs = self.handshake
        self.pending.pop(w.call_id, None)
        self._note_epoch(w.epoch)
        refusal = hs.check(w)
        if refusal is not None:
            self._refuse(*refusal, now)
            return
        if hs.accept(w):  # a refusal lifted
            self.breaker.reset()
        left = self._open_link(w)
        self._set_gate()
        hs.release_waiters()
        for header in left:  # replies the old link still held (read before it closed)
            self._on_bufs([header], now)

    def _open_link(self, w: Welcome) -> list[bytes]:
        """The direct link a Welcome offers (a client whose ring the server maps: same host), in place
        of any earlier one; none when it offers none or the connection fails (ZeroMQ alone then).
        Returns the messages the earlier link still held (replies sent on it before the server took
        the new one: they are not lost with it)."""
        left = self._read_link() if self._link is not None else []
        self._close_link()
        if not w.direct or self.handshake.ring is None:
            return left
        try:
            link = direct.connect(w.direct, w.direct_token)
        except OSError as e:
            log.info("draft client %s: no direct link (%s): ZeroMQ alone", self.cfg.name, e)
            return left
        self._link = link
        self._owner_poll.register(link.fileno(), select.POLLIN)
        self._wake()  # the I/O thread's poll and an owner's in progress learn the link's descriptor
        self._ring_owner()
        return left

    def _read_link(self) -> list[bytes]:
        """The messages the link holds (counted in ``direct_read``); a link that ended is closed."""
        assert self._link is not None
        msgs, alive = self._link.read()
        self.direct_read += len(msgs)
        if not alive:
            self._close_link()
        return msgs

    @property
    def link_up(self) -> bool:
        return self._link is not None

    def _close_link(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._owner_poll.unregister(link.fileno())
            link.close()

    def _on_error(self, err: Error, now: float) -> None:
        if err.epoch:
            self._note_epoch(err.epoch)
        p, late = self._take_pending(err.call_id)
        if p is None:
            self._c.bad_reply()
            log.debug("draft client %s: server error without a call: %s %s", self.cfg.name, err.code.name, err.message)
            return
        if p.kind == "hello":
            refusal = self.handshake.hello_error(err)
            if refusal is not None:
                self._refuse(*refusal, now)
            return  # other errors (e.g. NOT_READY): the Hello is retried on its timer
        if p.kind == "taps":  # its rows stay buffered: the commit (or the next step) resends them
            return
        if p.kind == "step":
            if late:
                self._late(p, now, True)
            else:
                self._failed_step(p, now, False)
            if err.code in (ErrorCode.CONTRACT_MISMATCH, ErrorCode.WIRE_FORMAT):  # the Hello says why
                self._contract_changed("")
            elif err.code == ErrorCode.TRANSPORT and self.handshake.rehello():  # our ring is gone there
                self._set_gate()
        elif p.kind == "ping" and p.future is not None:
            set_future(p.future, None)

    # ------------------------------------------------------------------ state changes

    def _note_epoch(self, epoch: str) -> None:
        if not self.handshake.note_epoch(epoch):
            return
        # The server restarted: its sessions are gone, forget what it acknowledged.
        self.breaker.restarted()
        if self.handshake.rows_ring is not None and self.handshake.rehello():  # a new server maps no ring
            self._set_gate()
        dropped = 0
        for s in self.sessions.values():
            s.unsent()
            s.retry_at = 0.0
            s.caught_up()  # nothing of a burst is left there to wait for
            before = s.rows
            s.chunks = s.trimmed(s.chunks, self.cfg.restart_resend_rows, s.end)  # a small first step
            dropped += before - s.rows
        self._c.dropped_rows(dropped)

    def _contract_changed(self, new_id: str) -> None:
        if self.handshake.contract_changed(new_id):
            self._set_gate()

    def _refuse(self, message: str, fields: tuple[str, ...], now: float) -> None:
        refused = self.handshake.refuse(message, now, fields)
        self._set_gate()
        if refused:
            self.handshake.fail_waiters(message, fields)

    def _miss(self, now: float) -> None:
        self.handshake.prepare_spare(now)  # the ring a restarted server would need, made meanwhile
        b = self.breaker
        if b.miss(now):
            self._m.breaker_opens.inc()
            self._c.add("breaker_opens")
            log.warning(
                "draft client %s: %d consecutive misses, breaker open (probing every %.0f ms)",
                self.cfg.name,
                b.misses,
                b.probe_ms,
            )
            self._set_gate()

    def _breaker_closed(self) -> None:
        log.info("draft client %s: server answers pings again, breaker closed", self.cfg.name)
        self._set_gate()

    def _set_gate(self) -> None:
        hs = self.handshake
        if self._closing:
            gate: str | None = "closed"
        elif hs.refused is not None or self.breaker.is_open:
            gate = "breaker_open"
        elif hs.welcome is None or hs.verifying:
            gate = "not_ready"
        else:
            gate = None
        on = gate == "breaker_open"
        if on != self._gauge_on:
            self._gauge_on = on
            self._m.breaker_open.inc() if on else self._m.breaker_open.dec()
        self.gate = gate

    def _shutdown(self) -> None:
        self._closing = True
        self._set_gate()
        for p in self.pending.values():
            if p.kind == "step":
                self._wakeups.resolve(p.future, empty_replies(p.n), "closed")
            elif p.kind == "ping" and p.future is not None:
                set_future(p.future, None)
        self.pending.clear()
        for q in self._ping_queue:
            set_future(q.future, None)
        self._ping_queue = []
        self._close_commands()
        if self._gauge_on:
            self._gauge_on = False
            self._m.breaker_open.dec()
        self._close_link()
        self._ctx.destroy(linger=0)  # closes the socket (LINGER 0), then terminates the context
        self.handshake.drop_ring(closing=True)
        self.handshake.drop_spare()
        self._shut = True

    def _close_commands(self) -> None:
        """Answer every queued command and connect() waiter: the loop is closed."""
        waiters = self.handshake.waiters
        while self._cmds:
            cmd = self._cmds.popleft()
            if isinstance(cmd, StepCall):
                self._wakeups.resolve(cmd.future, empty_replies(len(cmd.entries)), "closed")
            elif isinstance(cmd, PingCmd):
                set_future(cmd.future, None)
            elif isinstance(cmd, Connect) and cmd.future is not None:
                waiters.append(cmd.future)
        for f in waiters:
            if f.set_running_or_notify_cancel():
                f.set_exception(DraftClientError("client closed"))
        self.handshake.waiters = []
