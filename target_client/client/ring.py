"""The client's shared-memory ring (transport "shm", ``protocol.shm``): where a step's rows go.

Owns ``ClientRing``: the segment this client made (read-write mapping), the region allocator
(regions are taken in order and given back out of order: the front advances over every region
the server is done with), the generation stamp of each region and the bookkeeping of the
server's cumulative ``RingAck`` (``regions.Regions``, shared with the CUDA IPC buffer). A region
is written once, by ``put`` (one copy from the caller's taps and any resent rows), and never again
until an ack says the server cannot read it any more: a region of generation <= ``seen`` that is
not ``held``. When no region is free, ``put`` returns
None and the step's rows go in a frame instead: the ring never blocks and never overwrites.

Rows written in place (``claim``, then ``in_place``): a caller that makes a step's rows anyway (the
vLLM proposer's device-to-host copy of its encoded taps) can write them straight into a region it
claims, on its own thread, and pass a view of it as the step's taps; the I/O thread then sends
them where they lie (``in_place``: the stamp and a generation, no copy). Such a region is free once
no array views it (a finalizer on the claimed array, which every view of it keeps alive) and the
server cannot read it. ``claim`` can page-lock the whole segment first (``pin``: a callable the
caller's device library provides), so a device-to-host copy lands in it at the bus's speed.

Threads: ``claim`` on any thread, the rest on the I/O thread; one lock around the allocator (a
finalizer only appends to a queue, drained under the lock: it may run inside the lock's holder).
After ``close`` the segment is page-unlocked and unmapped once no claimed array lives (a
device-to-host copy into one may still be in flight at close): when the last one goes, its finalizer
hands both to a thread of its own (``_retire_now``), never to the thread that dropped it. That thread is
a caller's: the resend buffer holds views of a lost ring's regions until the server restarted from
them acknowledges their rows, and unmapping a populated 64 MiB ring takes 15-20 ms of a core.
The segment's name is unlinked by ``confirm`` (the Welcome named it) or ``close`` (a refusal, a
lost ring, the client's end), whichever comes first.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import weakref
from collections.abc import Callable

import numpy as np

from protocol import RingAck, RingAnnounce, RowsAt
from protocol.shm import HEADER_BYTES, STAMP_BYTES, create, region_bytes, stamp_region, unlink, unmap, write_region
from target_client.client.regions import Regions

_UNMAP_WAIT_S = 1.0  # how long a retiring thread waits for the last view's buffer to be let go


class ClientRing:
    """One shared-memory ring of one client. See the module docstring."""

    def __init__(self, nbytes: int, pace_s: float | Callable[[], float] = 0.0) -> None:
        self.announce: RingAnnounce
        self.announce, self._mm = create(nbytes, pace_s)  # RingError when it cannot be made
        self.name = self.announce.name
        self.size = self.announce.nbytes
        self.mapped = False  # a server mapped it (its Welcome named it)
        self._named = True  # the name still exists in /dev/shm
        self.regions = Regions(self.size - HEADER_BYTES, 1)  # offsets after the header; region_bytes aligns
        view = ctypes.c_char.from_buffer(self._mm)
        self._base = ctypes.addressof(view)  # the mapping's address (it never moves)
        del view  # an exported buffer would keep ``close`` from unmapping
        self._lock = threading.Lock()
        self._claims: dict[int, tuple[int, int]] = {}  # a claimed region's rows offset -> (region id, nbytes)
        self._claimed_at: dict[int, int] = {}  # region id -> its rows offset
        self._let_go: collections.deque[int] = collections.deque()  # claimed regions no array views now
        self._unpin: Callable[[], object] | None = None
        self._retire = threading.RLock()  # the unpin and unmap after close (finalizers may nest in one thread)
        self._live_at_close: set[int] = set()  # claimed regions still viewed when the ring closed
        self._retired = False  # unpinned and unmapped (or handed to the thread that does it)
        self.pin_error: str | None = None  # why page-locking the segment failed (claims then stop)
        self._closed = False
        self.in_place_steps = 0  # steps whose rows went where the caller wrote them

    @property
    def generation(self) -> int:
        """Of the newest region."""
        return self.regions.generation

    @property
    def free_bytes(self) -> int:
        """Bytes not held by live regions (tests and stats)."""
        with self._lock:
            self._drain()
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
        with self._lock:
            self._drain()
            got = self.regions.take(region_bytes(nbytes))
        if got is None:
            return None
        generation, offset = got
        write_region(self._mm, HEADER_BYTES + offset, generation, parts)
        return RowsAt(self.name, HEADER_BYTES + offset, nbytes, generation)

    def claim(self, nbytes: int, pin: Callable[[int, int], Callable[[], object]] | None = None) -> np.ndarray | None:
        """A writable uint8 array of ``nbytes`` in a free region, for a caller to write a step's rows
        into and pass (or a view of it) as its taps; None when none is free, the ring is closed, or
        page-locking failed. ``pin(address, nbytes)`` page-locks the segment (once) and returns what
        undoes it. Any thread."""
        if nbytes <= 0:
            return None
        with self._lock:
            if self._closed or self.pin_error is not None:
                return None
            if pin is not None and self._unpin is None:
                try:
                    self._unpin = pin(self._base, self.size)
                except Exception as e:  # the caller falls back to its own buffer
                    self.pin_error = f"{type(e).__name__}: {e}"
                    return None
            self._drain()
            got = self.regions.claim(region_bytes(nbytes))
            if got is None:
                return None
            rid, offset = got
            at = HEADER_BYTES + offset + STAMP_BYTES
            self._claims[at] = (rid, nbytes)
            self._claimed_at[rid] = at
        rows = np.frombuffer(self._mm, np.uint8, nbytes, at)
        weakref.finalize(rows, self._released, rid).atexit = False
        return rows

    def _released(self, rid: int) -> None:
        """No array views claimed region ``rid`` any more (a finalizer: any thread, maybe inside
        the lock's holder, so it never takes that lock)."""
        self._let_go.append(rid)
        if self._closed:
            self._retire_when_free(inline=False)

    def _retire_when_free(self, inline: bool) -> None:
        """After ``close``: page-unlock and unmap the segment once no claimed array lives (a
        device-to-host copy into one may still be in flight; the mapping lives as long as they do).
        ``inline``: here; else on a thread of its own (a last claimed array's finalizer runs on
        whichever thread dropped it, a caller's in the middle of a step; ``close(unmap_later)``)."""
        with self._retire:
            if self._retired or not self._live_at_close <= set(self._let_go):
                return
            self._retired = True
            unpin, self._unpin = self._unpin, None
        if inline:
            self._retire_now(unpin, wait_s=0.0)  # a view still alive somewhere: the mapping goes with it
            return
        try:
            name = "draft-client-ring-retire"
            threading.Thread(target=self._retire_now, args=(unpin,), name=name, daemon=True).start()
        except RuntimeError:  # the interpreter is shutting down: the mapping goes at exit
            pass

    def _retire_now(self, unpin: Callable[[], object] | None, wait_s: float = _UNMAP_WAIT_S) -> None:
        if unpin is not None:
            try:
                unpin()
            except Exception:  # best effort: the pages go at exit anyway
                pass
        unmap(self._mm, wait_s)

    def in_place(self, rows: np.ndarray) -> RowsAt | None:
        """Where ``rows`` lie when they are the start of a claimed region that has not gone out: the
        region is stamped and given the next generation (no copy); else None (``put`` them)."""
        at = rows.__array_interface__["data"][0] - self._base
        with self._lock:
            self._drain()
            got = self._claims.get(at)
            if got is None or rows.nbytes > got[1] or not rows.flags.c_contiguous:
                return None
            generation = self.regions.send(got[0])
            if generation is None:
                return None
        offset = at - STAMP_BYTES
        stamp_region(self._mm, offset, generation, rows.nbytes)
        self.in_place_steps += 1
        return RowsAt(self.name, offset, rows.nbytes, generation)

    def cancel(self, generation: int) -> None:
        """A region whose Step was never sent: free it at once."""
        with self._lock:
            self.regions.cancel(generation)

    def ack(self, ack: RingAck) -> None:
        """Free every region the server says it is done with (cumulative: any ack may be lost)."""
        if ack.ring == self.name:
            with self._lock:
                self._drain()
                self.regions.ack(ack)

    def _drain(self) -> None:
        """Claimed regions no array views any more (lock held; after ``close`` the queue stays for
        ``_retire_when_free``)."""
        while self._let_go and not self._closed:
            rid = self._let_go.popleft()
            self.regions.unview(rid)
            self._claims.pop(self._claimed_at.pop(rid), None)

    def close(self, unmap_later: bool = False) -> None:
        """Unmap (the server's mapping, if any, lives on; so does this one while a claimed array
        views it) and remove the name if it is still there. ``unmap_later``: the name goes now, the
        unmapping (15-20 ms for a populated 64 MiB ring on the 2-core VM) on a thread of its own."""
        self._unlink()
        with self._lock:
            if self._closed:
                return
            self._drain()
            self._live_at_close = {rid for rid, _ in self._claims.values()}
            self._closed = True
        self._retire_when_free(inline=not unmap_later)
