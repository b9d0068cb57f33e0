"""The server's shared-memory rings (transport "shm", ``protocol.shm``): mapping, reading, acking.

Owns ``Rings``: the rings clients announced in their Hello, mapped read-only, per connection;
the rows of a Step that names a region (a read-only numpy view of the mapping, handed to the
engine like a frame's rows: no copy on the server); which regions the server may still read; the
``RingAck`` each reply to that connection carries; and unmapping rings nobody used for the session
TTL (a client that died without a word) or that a client moved on from, on a thread of their own.

A region is held for exactly as long as any object still references its memory: a finalizer on
the region's base array (every row view, torch tensor or ingest item made from it keeps that base
alive) takes it out of ``held``. So a drafter that keeps rows past ``ingest()``, by design or by
mistake, keeps its region from being written again, and nothing needs the engine to say when it
is done. The I/O thread maps, looks up and acks; finalizers run on whichever thread drops the
last reference (the engine's), so ``held`` sits behind a lock taken for a set update only.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol import ErrorCode, ProtocolError
from protocol.messages import RingAck, RingAnnounce, RowsAt
from protocol.shm import RingError, open_ring, region_rows, unmap

log = logging.getLogger("draft_server.io")

MAX_RINGS_PER_CONNECTION = 4  # a client re-Hellos with a new ring after a server-side loss; old ones go
_UNMAP_WAIT_S = 1.0  # how long a ring's unmapping waits for the last region view's buffer to go


@dataclass(eq=False)
class Ring:
    name: str
    nonce: str
    owner: bytes
    mm: mmap.mmap
    seen: int = 0  # newest generation received
    held: set[int] = field(default_factory=set)  # generations whose rows may still be read
    used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self, generation: int) -> None:
        with self.lock:
            self.held.discard(generation)

    def ack(self) -> RingAck:
        with self.lock:
            return RingAck(self.name, self.seen, tuple(sorted(self.held)))


class Rings:
    """Rings per connection (I/O thread; ``Ring.release`` from any thread). See the module docstring."""

    def __init__(
        self,
        idle_s: float,
        gauge: Any,  # a prometheus Gauge
        pin: Callable[[memoryview], bool] | None = None,
        unpin: Callable[[memoryview], None] | None = None,
    ) -> None:
        """``pin``/``unpin``: the drafter's ``register_host``/``unregister_host``, so rows read from a
        mapped ring reach the device with no staging copy (``Drafter.register_host``)."""
        self.idle_s = idle_s
        self._gauge = gauge
        self._pin, self._unpin = pin, unpin
        self._by_ident: dict[bytes, dict[str, Ring]] = {}
        self._last_sweep = time.monotonic()
        self._unmapping = threading.Lock()  # the threads that unpin and unmap dropped rings

    def __len__(self) -> int:
        return sum(len(r) for r in self._by_ident.values())

    def map(self, ident: bytes, owner: bytes, ann: RingAnnounce, call_id: int) -> str:
        """Map the ring a Hello announced (again: the same mapping, for a Hello sent twice);
        ProtocolError(TRANSPORT) naming why it cannot be."""
        rings = self._by_ident.setdefault(ident, {})
        have = rings.get(ann.name)
        if have is not None and have.nonce == ann.nonce and have.owner == owner:
            have.used = time.monotonic()
            return have.name
        try:
            mm = open_ring(ann)
        except RingError as e:
            if not rings:
                del self._by_ident[ident]
            raise ProtocolError(ErrorCode.TRANSPORT, f"transport 'shm' refused: {e}", call_id) from None
        rings[ann.name] = Ring(ann.name, ann.nonce, owner, mm)
        pinned = self._pin is not None and self._pin(memoryview(mm))
        for old in list(rings)[:-MAX_RINGS_PER_CONNECTION]:  # the oldest: the client has moved on from them
            self._drop(ident, old)
        self._gauge.set(len(self))
        log.info(
            "mapped shm ring %s (%d MiB, %s) for %r",
            ann.name,
            ann.nbytes >> 20,
            "registered with the device" if pinned else "rows staged",
            owner[-16:],
        )
        return ann.name

    def rows(self, ident: bytes, owner: bytes, at: RowsAt, call_id: int) -> np.ndarray:
        """The bytes of region ``at`` (read-only, held until every view of them is gone)."""
        ring = self._by_ident.get(ident, {}).get(at.ring)
        if ring is None or ring.owner != owner:
            raise ProtocolError(
                ErrorCode.TRANSPORT, f"shm ring {at.ring} is not mapped for this connection (send a Hello)", call_id
            )
        ring.used = time.monotonic()
        try:
            region: np.ndarray | None = region_rows(ring.mm, at)
        except RingError as e:
            region, error = None, e
        with ring.lock:  # one update: a reply's ack (another thread) never names ``seen`` without ``held``
            ring.seen = max(ring.seen, at.generation)
            if region is not None:
                ring.held.add(at.generation)
        if region is None:
            raise ProtocolError(ErrorCode.BAD_FRAMES, f"shm ring {at.ring}: {error}", call_id) from None
        weakref.finalize(region, ring.release, at.generation)
        return region

    def ack(self, ident: bytes) -> RingAck | None:
        """The newest ring's ack for a reply to ``ident`` (None: it announced none)."""
        rings = self._by_ident.get(ident)
        if not rings:
            return None
        return next(reversed(rings.values())).ack()

    def sweep(self, now: float) -> None:
        """Unmap rings unused for ``idle_s`` (their client is gone or idles past the session TTL)."""
        if now - self._last_sweep < min(1.0, self.idle_s / 4):
            return
        self._last_sweep = now
        for ident, rings in list(self._by_ident.items()):
            for name, ring in list(rings.items()):
                if now - ring.used > self.idle_s:
                    self._drop(ident, name)

    def _drop(self, ident: bytes, name: str, inline: bool = False) -> None:
        """Let go of a ring no region of which is read any more (else it is tried again at the next
        sweep). Its page-unlocking (a device-wide sync) and unmapping (the last mapping of a dead
        client's ring frees its pages: 15-20 ms of a core for 64 MiB) go to a thread of their own:
        the I/O thread serves every other client meanwhile. ``inline``: here (the server's stop)."""
        rings = self._by_ident[ident]
        ring = rings[name]
        with ring.lock:
            if ring.held:  # rows still referenced (queued work)
                return
        del rings[name]
        if not rings:
            del self._by_ident[ident]
        self._gauge.set(len(self))
        if inline:
            self._unmap(ring)
        else:
            threading.Thread(target=self._unmap, args=(ring,), name="draft-server-ring-unmap", daemon=True).start()

    def _unmap(self, ring: Ring) -> None:
        with self._unmapping:  # one at a time (a sweep may drop several rings at once)
            self._unmap_one(ring)

    def _unmap_one(self, ring: Ring) -> None:
        if self._unpin is not None:
            self._unpin(memoryview(ring.mm))
        if unmap(ring.mm, _UNMAP_WAIT_S):
            log.info("unmapped shm ring %s", ring.name)
        else:
            log.warning("shm ring %s: still viewed; unmapped with its last view", ring.name)

    def close(self) -> None:
        for ident, rings in list(self._by_ident.items()):
            for name in list(rings):
                self._drop(ident, name, inline=True)
