"""The Hello/Welcome handshake: which server the client talks to and which contract it pinned.

Owns ``Handshake``: the verified Welcome, the pinned contract (``ClientConfig.expect``, else the
first verified one) and its ``contract_id``, the layout of the rows this client sends (its wire
format under that contract and the Welcome's offer), the server's epoch, the refusal (a server
serving another contract or protocol version, or not accepting this client's wire format or
projection: drafting stays off, the Hello is retried every ``breaker_backoff_ms``),
re-verification after a reply names another contract, the Hello retry timer and the callers
waiting in ``connect()``.

Only the I/O thread writes it; callers read ``welcome``, ``pinned`` and ``epoch`` (single
attribute reads of immutable values). No socket: the I/O loop sends the Hello this builds,
recomputes the step gate after each state change and then calls back to release the waiters.

Transport (``ClientConfig.transport``, ``protocol.shm``): with "shm" or "auto" each Hello names a
shared-memory ring (``ring.ClientRing``, made right before the Hello goes out, so only while a
connection is up); the Welcome must name it back, mapped, and the ring's name is unlinked then. A
server that does not offer shm, or cannot map the ring, is a refusal like a wire format's ("shm"),
or a fall back to frames for the life of the client ("auto"). A ring a server lost (it restarted,
or dropped the ring after the session TTL) is replaced by a new one at the next Hello. Making a
ring takes tens of milliseconds (every page allocated: 40-65 ms for 64 MiB on the 2-core VM), so
when a step misses (the server may be gone) a spare is made on a thread of its own
(``prepare_spare``), paced (``SPARE_PACE_S``: a MiB of pages, then a pause, so the engine's
threads beside it never wait for a core long: about 0.2 s for 64 MiB), and the Hello after a
restart names it at once (one still being made, the server back sooner, is hurried and waited for:
``SPARE_WAIT_S``); the spare goes when a step
is answered in time on the same ring (the server was only slow or paused) ``SPARE_KEEP_S`` after
the last miss, and at the end.

With "cuda_ipc" (``protocol.cuda_ipc``) the Hello names the client's CUDA IPC buffer instead
(``target_client.cuda.ipc.CudaRing``, made at the first Hello on ``device`` and kept for the
client's life: every later Hello names the same memory anew, ``reannounce``). A process without
CUDA (the buffer cannot be made) or a server that does not import it is a refusal, as for "shm".
"""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import Future
from typing import Any

from protocol import PROTOCOL_VERSION, Error, ErrorCode, Hello, ModelContract, Transport, Welcome, WireFormat, WireOffer
from protocol.cuda_ipc import CudaIpcError
from protocol.shm import RingError
from protocol.shm import refusal as transport_refusal
from protocol.wire import RowLayout, refusal, row_layout
from target_client.api import ClientConfig, ContractMismatchError
from target_client.client.calls import set_future
from target_client.client.counters import Counters
from target_client.client.ring import ClientRing

log = logging.getLogger("target_client")

_CONTRACT_FIELDS = tuple(ModelContract.__struct_fields__)
_HELLO_SEND_RETRY_S = 0.02  # retry of a Hello that could not be sent (no live connection yet)
SPARE_KEEP_S = 30.0  # a spare ring outlives the last missed step by this long
SPARE_PACE_S = 0.002  # a spare's pages are allocated a MiB at a time, with this pause after each
SPARE_WAIT_S = 0.1  # a Hello that finds the spare still being made hurries it and waits this long at most

Refusal = tuple[str, tuple[str, ...]]  # (message, the contract fields that differ)


class Handshake:
    """Handshake, contract and epoch state of one client. See the module docstring."""

    def __init__(self, cfg: ClientConfig, counters: Counters, device: int | None = None) -> None:
        self.cfg = cfg
        self._c = counters
        self.welcome: Welcome | None = None  # the verified Welcome
        self.pinned: ModelContract | None = cfg.expect  # the contract taps are validated against
        self.contract_id: str | None = None  # of the verified contract
        self.epoch: str | None = None  # the server's latest epoch (changes on a restart)
        self.refused: str | None = None  # why the server was refused (drafting is off)
        self.verifying = False  # a reply named another contract: the Hello goes out again
        self.need_hello = False  # a Hello is wanted (now or when next_hello_at comes)
        self.hello_due = False  # a Hello should go out as soon as the socket is writable
        self.next_hello_at = math.inf
        self.waiters: list[Future] = []  # connect(wait=True) callers
        # (dtype, width) of the rows step() takes; None until known (projected: from the Welcome)
        self.layout: RowLayout | None = None
        if cfg.expect is not None and cfg.wire_format != WireFormat.PROJECTED:
            self.layout = row_layout(cfg.wire_format, cfg.expect, WireOffer())
        # transport shm: the ring the latest Hello named; cuda_ipc: the client's CUDA IPC buffer (a CudaRing)
        self.ring: ClientRing | Any | None = None
        self.shm_off = cfg.transport == Transport.FRAMES  # "auto" turns it on after a refusal
        self.cuda = cfg.transport == Transport.CUDA_IPC
        self.transport = Transport.CUDA_IPC.value if self.cuda else Transport.SHM.value  # the one a refusal names
        self.device = device  # cuda_ipc: the buffer's device index (None: this process has no CUDA)
        self._ring_error: str | None = None  # why this client could not make a ring (a local refusal)
        self.in_place_before = 0  # rows in place (``ClientRing.in_place_steps``) of the rings let go
        self.spares_used = 0  # Hellos that named a spare ring made ahead (``prepare_spare``)
        self._spare: ClientRing | None = None  # made ahead, for the Hello after a restart
        self._spare_wanted = False  # a spare is being made or is there
        self._spare_lock = threading.Lock()  # the two above (the maker's thread sets ``_spare``)
        self._spare_made = threading.Event()  # the maker is done (with a spare or without)
        self._spare_hurry = False  # a Hello waits for the spare: no more pauses
        self._spare_failed = False  # no room for one: not tried again until a new ring is mapped
        self._last_miss = -math.inf  # when a step last missed (``prepare_spare``; ``drop_spare`` keeps it)

    @property
    def ready(self) -> bool:
        """Welcomed, verified and not refused."""
        return self.welcome is not None and not self.verifying and self.refused is None

    @property
    def rows_ring(self) -> ClientRing | None:
        """The ring a step's rows go to (mapped by the server), or None: rows go in a frame."""
        r = self.ring
        return r if r is not None and r.mapped else None

    def _hello_ring(self) -> ClientRing | Any | None:
        """The ring this Hello names: the announced one again, or a new one when the last was mapped
        (its name is gone; a server that lost it needs a new segment). cuda_ipc: the one buffer,
        named anew when the last name was imported."""
        if self.cuda:
            return self._hello_cuda()
        if self.ring is not None and self.ring.mapped:
            self.drop_ring()
        if self.ring is None:
            spare = self._take_spare(wait_s=SPARE_WAIT_S)  # made ahead (``prepare_spare``), else a new one now
            self.spares_used += spare is not None
            try:
                self.ring = spare if spare is not None else ClientRing(self.cfg.shm_ring_mib << 20)
                self._ring_error = None
            except RingError as e:
                self._ring_error = f"transport 'shm' refused: {e}"
        return self.ring

    def prepare_spare(self, now: float) -> None:
        """A step missed at ``now`` (the server may be gone): make the ring the Hello after a restart
        needs now, on a thread of its own, unless one is made or being made (shm only). Waiting for
        the breaker to open would be too late: a server restarted within its 5 misses finds no spare."""
        self._last_miss = now
        if self.shm_off or self.cuda or self.ring is None or not self.ring.mapped or self._spare_failed:
            return
        with self._spare_lock:
            if self._spare_wanted:
                return
            self._spare_wanted = True
            self._spare_hurry = False
            self._spare_made.clear()
        threading.Thread(target=self._make_spare, name=f"draft-client-ring-{self.cfg.name}", daemon=True).start()

    def _make_spare(self) -> None:
        try:
            ring: ClientRing | None = ClientRing(self.cfg.shm_ring_mib << 20, pace_s=self._spare_pause)
        except RingError as e:
            log.warning("draft client %s: no spare shm ring (a restart makes one then): %s", self.cfg.name, e)
            self._spare_failed = True
            ring = None
        with self._spare_lock:
            keep = self._spare_wanted and ring is not None
            if keep:
                self._spare = ring
            else:
                self._spare_wanted = False
            self._spare_made.set()
        if not keep and ring is not None:  # let go meanwhile (taken, dropped, closed): on this thread
            ring.close()

    def _spare_pause(self) -> float:
        return 0.0 if self._spare_hurry else SPARE_PACE_S

    def _take_spare(self, wait_s: float = 0.0) -> ClientRing | None:
        """The spare, if it is made (else None: one still being made is closed by its maker). With
        ``wait_s`` (a Hello that needs a ring), one still being made is hurried (no more pauses) and
        waited for, that long at most: finishing it costs less than making another."""
        if wait_s > 0 and self._spare_wanted and self._spare is None:
            self._spare_hurry = True
            self._spare_made.wait(wait_s)
        with self._spare_lock:
            spare, self._spare = self._spare, None
            self._spare_wanted = False
        return spare

    def drop_spare(self, now: float | None = None) -> None:
        """No spare wanted: at ``now`` a step was answered in time on the ring the server maps, and
        the last miss is ``SPARE_KEEP_S`` ago (a server that misses again soon finds the spare still
        there: not one made and unmapped per miss, 40 ms of a core each); None: the end."""
        if not self._spare_wanted:  # the common case, every answered step: no lock
            return
        if now is not None and now - self._last_miss < SPARE_KEEP_S:
            return
        spare = self._take_spare()
        if spare is not None:
            spare.close(unmap_later=True)  # never on a step's path: the unmapping takes milliseconds

    def _hello_cuda(self) -> Any | None:
        if self.ring is not None:
            if self.ring.mapped:
                self.ring.reannounce()
            return self.ring
        try:
            from target_client.cuda.ipc import CudaRing  # torch, only for a cuda_ipc client

            self.ring = CudaRing(self.device, self.cfg.cuda_ipc_mib << 20)
            self._ring_error = None
        except CudaIpcError as e:
            self._ring_error = f"transport 'cuda_ipc' refused: {e}"
        return self.ring

    def drop_ring(self, closing: bool = False) -> None:
        """Let go of the ring (a refusal, a ring the server lost, the end; but at the end an shm ring
        is unmapped on a thread of its own, its name gone at once). A CUDA IPC buffer is kept for the
        client's life (re-exporting one per Hello would leave each old one held by torch's IPC ref counting): it
        is only marked unmapped, and closed at the end."""
        if self.ring is None:
            return
        if self.cuda and not closing:
            self.ring.mapped = False
            return
        self.in_place_before += getattr(self.ring, "in_place_steps", 0)  # shm rings count them
        if closing:
            self.ring.close()
        else:  # an shm ring (refused, or lost by the server): never unmapped on a step's path
            self.ring.close(unmap_later=True)
        self.ring = None

    # -- sending the Hello

    def connect(self, future: Future | None) -> None:
        """A caller asked to connect: answer at once when ready, else (re)send the Hello now."""
        if self.ready:
            if future is not None:
                set_future(future, self.welcome)
            return
        if future is not None:
            self.waiters.append(future)
        self.need_hello = True  # an explicit connect retries at once, even after a refusal
        self.hello_due = True

    def hello(self, call_id: int) -> Hello:
        cfg = self.cfg
        ring = None if self.shm_off else self._hello_ring()
        announce = ring.announce if ring is not None else None
        return Hello(
            protocol_version=PROTOCOL_VERSION,
            client_name=cfg.name,
            call_id=call_id,
            expect=cfg.expect,
            wire_format=cfg.wire_format,
            projection_id=cfg.projection_id,
            ring=None if self.cuda else announce,
            cuda_ipc=announce if self.cuda else None,
        )

    def hello_sent(self, now: float, sent: bool) -> float | None:
        """The due Hello went out (``sent``) or could not; the deadline of its call, or None."""
        self.hello_due = False
        if not sent:
            self.next_hello_at = now + _HELLO_SEND_RETRY_S
            return None
        self._c.add("hellos_sent")
        period = self.cfg.breaker_backoff_ms if self.refused is not None else self.cfg.hello_retry_ms
        self.next_hello_at = now + period / 1000.0
        return self.next_hello_at

    def tick(self, now: float) -> None:
        """Timers: the Hello is due again when its retry period has passed."""
        if self.need_hello and not self.hello_due and now >= self.next_hello_at:
            self.hello_due = True

    def wake_at(self) -> float:
        """When the I/O thread must wake for the next Hello (inf: no timer)."""
        return self.next_hello_at if (self.need_hello and not self.hello_due) else math.inf

    # -- answers

    def check(self, w: Welcome) -> Refusal | None:
        """The refusal of a Welcome from a server this client cannot use, or None."""
        if w.protocol_version != PROTOCOL_VERSION:
            return (
                f"draft server {self.cfg.endpoint} speaks protocol_version {w.protocol_version}, "
                f"this client speaks {PROTOCOL_VERSION}",
                ("protocol_version",),
            )
        if self.pinned is not None:
            diffs = self.pinned.mismatches(w.contract)
            if diffs:
                return (
                    f"draft server {self.cfg.endpoint} serves a different model contract "
                    f"(expected != served): {'; '.join(diffs)}",
                    tuple(d.split(":", 1)[0] for d in diffs),
                )
        why = refusal(self.cfg.wire_format, self.cfg.projection_id, w.wire)
        if why is not None:
            return f"draft server {self.cfg.endpoint}: {why}", ("wire_format",)
        if not self.shm_off and (self.ring is None or w.ring != self.ring.name):
            t = self.transport
            why = self._ring_error or transport_refusal(t, w.transports)
            why = why or f"transport {t!r} refused: the Welcome names ring {w.ring!r}, not {self.ring.name!r}"  # type: ignore[union-attr]
            return f"draft server {self.cfg.endpoint}: {why}", ("transport",)
        return None

    def accept(self, w: Welcome) -> bool:
        """Take a checked Welcome. True when it lifts a refusal (the breaker is reset then)."""
        first = self.welcome is None
        self.welcome = w
        if self.pinned is None:
            self.pinned = w.contract
        self.layout = row_layout(self.cfg.wire_format, self.pinned, w.wire)
        if self.ring is not None and w.ring == self.ring.name and not self.ring.mapped:
            self.ring.confirm()  # mapped there: the name goes, only the two mappings hold the ring
            self._spare_failed = False
        self.contract_id = w.contract_id
        self.need_hello = self.hello_due = self.verifying = False
        lifted = self.refused is not None
        self.refused = None
        if first:
            log.info(
                "draft client %s: welcomed by %s (model %s, weights %s, contract %s, epoch %s)",
                self.cfg.name,
                self.cfg.endpoint,
                w.contract.model_name,
                f"{w.weights.format} {w.weights.bits:g} bits {w.weights.nbytes >> 20} MiB"
                if w.weights.format
                else "unknown",
                w.contract_id,
                w.epoch,
            )
        return lifted

    def release_waiters(self) -> None:
        """Hand the Welcome to the connect() callers (after the gate has opened)."""
        waiters, self.waiters = self.waiters, []
        for f in waiters:
            set_future(f, self.welcome)

    def hello_error(self, err: Error) -> Refusal | None:
        """The refusal an Error answering a Hello means, or None (e.g. NOT_READY: retry on the timer)."""
        codes = (ErrorCode.CONTRACT_MISMATCH, ErrorCode.UNSUPPORTED_VERSION, ErrorCode.WIRE_FORMAT, ErrorCode.TRANSPORT)
        if err.code not in codes:
            return None
        named = tuple(f for f in _CONTRACT_FIELDS if f in err.message)
        if err.code == ErrorCode.UNSUPPORTED_VERSION:
            named = ("protocol_version",)
        elif err.code == ErrorCode.WIRE_FORMAT:
            named = ("wire_format",)
        elif err.code == ErrorCode.TRANSPORT:
            named = ("transport",)
        return f"draft server {self.cfg.endpoint} refused the handshake: {err.message}", named

    def refuse(self, message: str, now: float, fields: tuple[str, ...] = ()) -> bool:
        """Turn drafting off for a server this client cannot use; retry the Hello slowly. False when
        it is not off after all: transport "auto" goes on with frames (a new Hello at once)."""
        why = next((f for f in ("transport", "wire_format") if f in fields), "contract")
        self._c.m.refusals.labels(why).inc()
        self._c.add(f"{why}_refusals")
        if why == "transport":
            self.drop_ring()
            if self.cfg.transport == "auto":
                if not self.shm_off:
                    log.warning("draft client %s: %s; going on with frames", self.cfg.name, message)
                self.shm_off = True
                self.need_hello = self.hello_due = True
                return False
        if self.refused != message:
            log.error("draft client %s: %s; drafting stays off (breaker open)", self.cfg.name, message)
        self.refused = message
        self.verifying = False
        self.need_hello = True
        self.hello_due = False
        self.next_hello_at = now + self.cfg.breaker_backoff_ms / 1000.0
        return True

    def fail_waiters(self, message: str, fields: tuple[str, ...]) -> None:
        """Raise ContractMismatchError in the connect() callers (after the gate has closed)."""
        waiters, self.waiters = self.waiters, []
        for f in waiters:
            if f.set_running_or_notify_cancel():
                f.set_exception(ContractMismatchError(message, fields))

    def rehello(self) -> bool:
        """The server lost this client's ring (a restart, or the ring's idle TTL): the gate closes
        until a Welcome maps a new one. True when this starts it."""
        if self.verifying or self.ring is None:
            return False
        what = "CUDA IPC buffer" if self.cuda else "shm ring"
        log.info("draft client %s: the server no longer maps %s %s; a new one", self.cfg.name, what, self.ring.name)
        self.verifying = True
        self.need_hello = self.hello_due = True
        return True

    def contract_differs(self, contract_id: str) -> bool:
        """A reply names another contract than the verified one."""
        return self.contract_id is not None and contract_id != self.contract_id

    def contract_changed(self, new_id: str) -> bool:
        """A reply named another contract (``new_id``; "" for a CONTRACT_MISMATCH error).
        True when this starts a re-verification (the gate closes until the Welcome)."""
        self._c.m.contract_changes.inc()
        self._c.add("contract_changes")
        if self.verifying:
            return False
        log.warning(
            "draft client %s: server answers with contract_id %r, verified %r; re-verifying",
            self.cfg.name,
            new_id,
            self.contract_id,
        )
        self.verifying = True
        self.need_hello = self.hello_due = True
        return True

    def note_epoch(self, epoch: str) -> bool:
        """Record the epoch a message carried. True when it tells of a server restart (the
        server's sessions are gone: the I/O loop resets its resend buffers and the breaker)."""
        if not epoch or epoch == self.epoch:
            return False
        restarted = self.epoch is not None
        if restarted:
            self._c.m.epoch_changes.inc()
            self._c.add("epoch_changes")
            log.info("draft client %s: server restarted (epoch %s -> %s)", self.cfg.name, self.epoch, epoch)
        self.epoch = epoch
        return restarted
