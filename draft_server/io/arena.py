"""The receive arena: Step payload frames (tcp/ipc) land in registered host memory, one copy.

A bounded anonymous mapping, registered once with the drafter (``Drafter.register_host``: on
CUDA ``cudaHostRegister``, so ingest copies rows from it straight to the device, as it does from
a mapped shm ring; without CUDA a no-op). The I/O thread reads a Step's header frame first, then
receives its tap frame with ``recv_into`` into a slot of the announced size (ZeroMQ delivers all
parts of a message at once, so the size is known before the frame is read). The copy out of
ZeroMQ's message happens on the I/O thread with the GIL released; the engine thread then has no
staging copy left to do.

A slot is taken first fit (slots are returned out of order: sessions of one Step are ingested
together, but steps of several clients, prefill chunks and expired entries end at different
times) and held for exactly as long as any object references its memory: a finalizer on the
slot's array (every row view, torch tensor or ingest item made from it keeps that array alive)
gives it back. The drafter's ingest returns only once the device copies from registered memory
are done (``FastStep._ingest_rows`` waits on ``_rows_read``) and the scheduler drops its rows
right after, so a slot is never written while the GPU may still read it. A payload that finds no
room, or is larger than the arena, is received as an ordinary frame and counted
(``draft_server_arena_fallbacks_total{reason}``): the I/O thread never waits for a slot and no
message is dropped.
"""

from __future__ import annotations

import bisect
import mmap
import threading
import weakref
from collections.abc import Callable

import numpy as np

ALIGN = 256  # slot alignment in bytes (every wire dtype's, and a cache line's)


class Arena:
    """First-fit slots of one registered mapping (``take`` on the I/O thread; slots come back
    from whichever thread drops their last reference)."""

    def __init__(
        self,
        nbytes: int,
        pin: Callable[[memoryview], bool] | None = None,
        unpin: Callable[[memoryview], None] | None = None,
    ) -> None:
        if nbytes <= 0:
            raise ValueError(f"arena size must be > 0, got {nbytes}")
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self._mm = mmap.mmap(-1, size)  # anonymous, page aligned; pages are touched as slots are used
        self._view = memoryview(self._mm)
        self.capacity = size
        self.base = np.frombuffer(self._mm, dtype=np.uint8, count=0).ctypes.data  # address of byte 0
        self._unpin = unpin
        self.registered = bool(pin is not None and pin(self._view))
        self._lock = threading.Lock()
        self._starts = [0]  # free extents, sorted by start, never adjacent (merged)
        self._sizes = [size]
        self.held = 0  # bytes in slots now
        self.slots = 0  # slots handed out so far

    def take(self, nbytes: int) -> np.ndarray | None:
        """A writable uint8 array of ``nbytes`` in the arena, or None (no room now, or larger than
        the arena). Its memory comes back to the arena once nothing references it."""
        if not 0 < nbytes <= self.capacity:
            return None
        need = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            for i, size in enumerate(self._sizes):
                if size >= need:
                    start = self._starts[i]
                    if size == need:
                        del self._starts[i], self._sizes[i]
                    else:
                        self._starts[i] += need
                        self._sizes[i] -= need
                    self.held += need
                    self.slots += 1
                    break
            else:
                return None
        slot = np.frombuffer(self._view[start : start + nbytes], dtype=np.uint8)
        weakref.finalize(slot, self._give_back, start, need)
        return slot

    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.capacity

    def contains(self, address: int, nbytes: int = 1) -> bool:
        """Whether [address, address + nbytes) lies in the arena (tests, diagnostics)."""
        return self.base <= address and address + nbytes <= self.base + self.capacity

    def _give_back(self, start: int, size: int) -> None:
        with self._lock:
            self.held -= size
            i = bisect.bisect_left(self._starts, start)
            if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:  # merge with the one before
                i -= 1
                self._sizes[i] += size
            else:
                self._starts.insert(i, start)
                self._sizes.insert(i, size)
            j = i + 1
            if j < len(self._starts) and self._starts[i] + self._sizes[i] == self._starts[j]:  # and after
                self._sizes[i] += self._sizes[j]
                del self._starts[j], self._sizes[j]

    def close(self) -> None:
        """Unregister and unmap (at server stop). Slots still referenced keep the mapping alive
        (it is then freed with the last of them), unregistered already: nothing copies any more."""
        if self.registered and self._unpin is not None:
            self._unpin(self._view)
            self.registered = False
        self._view.release()
        try:
            self._mm.close()
        except BufferError:
            pass
