"""The client's shared-memory ring (transport "shm", ``protocol.shm``): where a step's rows go.

Owns ``ClientRing``: the segment this client made (read-write mapping), the region allocator
(regions are taken in order and given back out of order: the front advances over every region
the server is done with), the generation stamp of each region and the bookkeeping of the
server's cumulative ``RingAck``. A region is written once, by ``put`` (one copy from the caller's
taps and any resent rows), and never again until an ack says the server cannot read it any more:
a region of generation <= ``seen`` that is not ``held``. When no region is free, ``put`` returns
None and the step's rows go in a frame instead: the ring never blocks and never overwrites.

I/O thread only (no locks). The segment's name is unlinked by ``confirm`` (the Welcome named it)
or ``close`` (a refusal, a lost ring, the client's end), whichever comes first.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from protocol import RingAck, RingAnnounce, RowsAt
from protocol.shm import HEADER_BYTES, create, region_bytes, unlink, write_region


@dataclass(slots=True)
class _Region:
    generation: int
    start: int
    end: int
    done: bool = False


class ClientRing:
    """One shared-memory ring of one client. See the module docstring."""

    def __init__(self, nbytes: int) -> None:
        self.announce: RingAnnounce
        self.announce, self._mm = create(nbytes)  # RingError when it cannot be made
        self.name = self.announce.name
        self.size = self.announce.nbytes
        self.mapped = False  # a server mapped it (its Welcome named it)
        self._named = True  # the name still exists in /dev/shm
        self.generation = 0  # of the newest region
        self._live: collections.deque[_Region] = collections.deque()
        self._head = HEADER_BYTES  # where the next region starts when it fits

    @property
    def free_bytes(self) -> int:
        """Bytes not held by live regions (tests and stats)."""
        return self.size - HEADER_BYTES - sum(r.end - r.start for r in self._live)

    def confirm(self) -> None:
        """The server mapped the ring: remove its name, only the two mappings hold it now."""
        self.mapped = True
        self._unlink()

    def _unlink(self) -> None:
        if self._named:
            self._named = False
            unlink(self.name)

    def _place(self, need: int) -> int | None:
        live = self._live
        if not live:
            return HEADER_BYTES if HEADER_BYTES + need <= self.size else None
        first = live[0].start
        if self._head > first:  # not wrapped: free space is [head, size) and [HEADER, first)
            if self._head + need <= self.size:
                return self._head
            return HEADER_BYTES if HEADER_BYTES + need <= first else None
        return self._head if self._head + need <= first else None  # wrapped: [head, first)

    def put(self, parts: list[np.ndarray], ready: object = None) -> RowsAt | None:
        """Copy ``parts`` (rows, in order) into the next free region; None when none is free.
        (``ready``: for the CUDA IPC buffer's signature; host rows are ready.)"""
        nbytes = sum(p.nbytes for p in parts)
        need = region_bytes(nbytes)
        start = self._place(need)
        if start is None:
            return None
        self.generation += 1
        write_region(self._mm, start, self.generation, parts)
        self._live.append(_Region(self.generation, start, start + need))
        self._head = start + need
        return RowsAt(self.name, start, nbytes, self.generation)

    def cancel(self, generation: int) -> None:
        """A region whose Step was never sent: free it at once."""
        self._done(lambda r: r.generation == generation)

    def ack(self, ack: RingAck) -> None:
        """Free every region the server says it is done with (cumulative: any ack may be lost)."""
        if ack.ring != self.name:
            return
        held = set(ack.held)
        self._done(lambda r: r.generation <= ack.seen and r.generation not in held)

    def _done(self, pred: Callable[[_Region], bool]) -> None:
        for r in self._live:
            if not r.done and pred(r):
                r.done = True
        while self._live and self._live[0].done:
            self._live.popleft()
        if not self._live:
            self._head = HEADER_BYTES

    def close(self) -> None:
        """Unmap (the server's mapping, if any, lives on) and remove the name if it is still there."""
        self._unlink()
        try:
            self._mm.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with it
            pass
