"""The client's shared-memory ring (transport "shm", ``protocol.shm``): where a step's rows go.

Owns ``ClientRing``: the segment this client made (read-write mapping), the region allocator
(regions are taken in order and given back out of order: the front advances over every region
the server is done with), the generation stamp of each region and the bookkeeping of the
server's cumulative ``RingAck`` (``regions.Regions``, shared with the CUDA IPC buffer). A region
is written once, by ``put`` (one copy from the caller's taps and any resent rows), and never again
until an ack says the server cannot read it any more: a region of generation <= ``seen`` that is
not ``held``. When no region is free, ``put`` returns
None and the step's rows go in a frame instead: the ring never blocks and never overwrites.

I/O thread only (no locks). The segment's name is unlinked by ``confirm`` (the Welcome named it)
or ``close`` (a refusal, a lost ring, the client's end), whichever comes first.
"""

from __future__ import annotations

import numpy as np

from protocol import RingAck, RingAnnounce, RowsAt
from protocol.shm import HEADER_BYTES, create, region_bytes, unlink, write_region
from target_client.client.regions import Regions


class ClientRing:
    """One shared-memory ring of one client. See the module docstring."""

    def __init__(self, nbytes: int) -> None:
        self.announce: RingAnnounce
        self.announce, self._mm = create(nbytes)  # RingError when it cannot be made
        self.name = self.announce.name
        self.size = self.announce.nbytes
        self.mapped = False  # a server mapped it (its Welcome named it)
        self._named = True  # the name still exists in /dev/shm
        self.regions = Regions(self.size - HEADER_BYTES, 1)  # offsets after the header; region_bytes aligns

    @property
    def generation(self) -> int:
        """Of the newest region."""
        return self.regions.generation

    @property
    def free_bytes(self) -> int:
        """Bytes not held by live regions (tests and stats)."""
        return self.regions.free_bytes

    def confirm(self) -> None:
        """The server mapped the ring: remove its name, only the two mappings hold it now."""
        self.mapped = True
        self._unlink()

    def _unlink(self) -> None:
        if self._named:
            self._named = False
            unlink(self.name)

    def put(self, parts: list[np.ndarray], ready: object = None) -> RowsAt | None:
        """Copy ``parts`` (rows, in order) into the next free region; None when none is free.
        (``ready``: for the CUDA IPC buffer's signature; host rows are ready.)"""
        nbytes = sum(p.nbytes for p in parts)
        got = self.regions.take(region_bytes(nbytes))
        if got is None:
            return None
        generation, offset = got
        write_region(self._mm, HEADER_BYTES + offset, generation, parts)
        return RowsAt(self.name, HEADER_BYTES + offset, nbytes, generation)

    def cancel(self, generation: int) -> None:
        """A region whose Step was never sent: free it at once."""
        self.regions.cancel(generation)

    def ack(self, ack: RingAck) -> None:
        """Free every region the server says it is done with (cumulative: any ack may be lost)."""
        if ack.ring == self.name:
            self.regions.ack(ack)

    def close(self) -> None:
        """Unmap (the server's mapping, if any, lives on) and remove the name if it is still there."""
        self._unlink()
        try:
            self._mm.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with it
            pass
