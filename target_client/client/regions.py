"""Region bookkeeping of a client buffer the server reads from (transport cuda_ipc), and rows on a device.

Owns ``Regions``: the allocator of a buffer's bytes, pure Python. Regions are placed next-fit
(after the last one taken when they fit, else in the first gap from the start) and given back out
of order; each has the generation of the Step that carried it; the server's cumulative ``RingAck``
(every generation <= ``seen`` that is not ``held``) frees them, so a lost reply loses nothing. A
region is written once and never again until the server cannot read it any more; when none is
free, ``take`` returns None and the step's rows go in a frame: the buffer never blocks and never
overwrites. The shm ring (``ring.ClientRing``) allocates its segment with it too, after the
segment's header, including regions a caller *claims* to write its rows into before they go
(``claim``, ``send``, ``unview``): such a region is free only once no array views it and the
server cannot read it; its generation is given when it goes out, so generations follow the order
of sending, which the cumulative ack relies on.

Also owns the torch-free view of device rows the client core needs (``is_device``,
``device_dtype_ok``): the client's core never imports torch (``target_client.cuda`` does, inside
functions).

Not thread-safe: the CUDA IPC buffer uses it on the I/O thread only, the shm ring under its lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from protocol import DType, RingAck

# torch dtype names a device rows tensor of each wire dtype may have (bf16 also as its bit patterns)
DEVICE_DTYPES: dict[DType, tuple[str, ...]] = {
    DType.BF16: ("torch.bfloat16", "torch.int16", "torch.uint16"),
    DType.F16: ("torch.float16",),
    DType.F32: ("torch.float32",),
    DType.I32: ("torch.int32",),
    DType.I64: ("torch.int64",),
    DType.U8: ("torch.uint8",),
}


def is_device(a: Any) -> bool:
    """Whether ``a`` is a torch tensor in CUDA memory (without importing torch)."""
    return type(a).__module__.startswith("torch") and bool(getattr(a, "is_cuda", False))


def device_dtype_ok(a: Any, dtype: DType) -> bool:
    return str(a.dtype) in DEVICE_DTYPES[dtype]


@dataclass(slots=True)
class _Region:
    rid: int
    generation: int  # 0 while a claimed region has not gone out
    start: int
    end: int
    done: bool = False  # the server cannot read it (acknowledged, never sent, or cancelled)
    viewed: bool = False  # a caller's array views it (a claimed region): not free before it is let go


class Regions:
    """The regions of one buffer of ``size`` bytes (``align``-aligned starts). See the module docstring."""

    def __init__(self, size: int, align: int) -> None:
        self.size = size
        self.align = align
        self.generation = 0  # of the newest region sent
        self._live: list[_Region] = []  # by start
        self._by_id: dict[int, _Region] = {}
        self._ids = 0
        self._head = 0  # where the last region taken ended: the next is placed at or after it when it fits

    @property
    def free_bytes(self) -> int:
        """Bytes not held by live regions (tests and stats)."""
        return self.size - sum(r.end - r.start for r in self._live)

    @property
    def live(self) -> list[tuple[int, int, int]]:
        """(generation, start, end) of every region the server may still read (tests)."""
        return [(r.generation, r.start, r.end) for r in self._live if not r.done]

    def _place(self, need: int) -> int | None:
        """Next fit: the first gap at or after the last region's end that holds ``need``, else the
        first from the buffer's start (a region one slow caller keeps does not stop the others)."""
        gaps, end = [], 0
        for r in self._live:
            if r.start - end >= need:
                gaps.append(end)
            end = r.end
        if self.size - end >= need:
            gaps.append(end)
        return next((g for g in gaps if g >= self._head), gaps[0] if gaps else None)

    def _new(self, nbytes: int, generation: int, done: bool, viewed: bool) -> _Region | None:
        need = max(self.align, (nbytes + self.align - 1) // self.align * self.align)
        start = self._place(need)
        if start is None:
            return None
        self._ids += 1
        r = _Region(self._ids, generation, start, start + need, done, viewed)
        self._live.insert(bisect.bisect(self._live, start, key=lambda x: x.start), r)
        self._by_id[r.rid] = r
        self._head = r.end
        return r

    def take(self, nbytes: int) -> tuple[int, int] | None:
        """A region of ``nbytes`` about to be written and sent: (generation, offset), or None when
        no space is free."""
        r = self._new(nbytes, self.generation + 1, False, False)
        if r is None:
            return None
        self.generation += 1
        return r.generation, r.start

    def claim(self, nbytes: int) -> tuple[int, int] | None:
        """A region of ``nbytes`` a caller writes rows into before they go (``send``): (region id,
        offset), or None. Held until ``unview`` (and, once sent, until the server is done with it)."""
        r = self._new(nbytes, 0, True, True)
        return None if r is None else (r.rid, r.start)

    def send(self, rid: int) -> int | None:
        """A claimed region goes out as it lies: its generation (the next), or None when it is not
        a live claimed region that has not gone out yet."""
        r = self._by_id.get(rid)
        if r is None or r.generation or not r.viewed:
            return None
        self.generation += 1
        r.generation, r.done = self.generation, False
        return r.generation

    def unview(self, rid: int) -> None:
        """No array views the claimed region any more: free once the server cannot read it."""
        r = self._by_id.get(rid)
        if r is not None:
            r.viewed = False
            self._sweep()

    def cancel(self, generation: int) -> None:
        """A region whose Step was never sent: free it at once."""
        self._done(lambda r: r.generation == generation)

    def ack(self, ack: RingAck) -> None:
        """Free every region the server says it is done with (cumulative: any ack may be lost)."""
        held = set(ack.held)
        self._done(lambda r: r.generation <= ack.seen and r.generation not in held)

    def reset(self) -> None:
        """Every region free (a new server imported the buffer: nothing of it is read by anyone),
        but a claimed one still viewed. Generations go on counting, so an old server's late ack
        frees nothing new."""
        self._done(lambda r: True)
        if not self._live:
            self._head = 0

    def _done(self, pred: Callable[[_Region], bool]) -> None:
        for r in self._live:
            if not r.done and pred(r):
                r.done = True
        self._sweep()

    def _sweep(self) -> None:
        if any(r.done and not r.viewed for r in self._live):
            for r in self._live:
                if r.done and not r.viewed:
                    del self._by_id[r.rid]
            self._live = [r for r in self._live if not (r.done and not r.viewed)]
        if not self._live:
            self._head = 0
