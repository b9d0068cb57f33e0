"""Region bookkeeping of a client buffer the server reads from (transport cuda_ipc), and rows on a device.

Owns ``Regions``: the allocator of a buffer's bytes, pure Python. Regions are taken in order and
given back out of order (the front advances over every region the server is done with); each has
the generation of the Step that wrote it; the server's cumulative ``RingAck`` (every generation
<= ``seen`` that is not ``held``) frees them, so a lost reply loses nothing. A region is written
once and never again until the server cannot read it any more; when none is free, ``take``
returns None and the step's rows go in a frame: the buffer never blocks and never overwrites.
The shm ring (``ring.ClientRing``) allocates its segment with it too, after the segment's header.

Also owns the torch-free view of device rows the client core needs (``is_device``,
``device_dtype_ok``): the client's core never imports torch (``target_client.cuda`` does, inside
functions).

I/O thread only (no locks).
"""

from __future__ import annotations

import collections
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
    generation: int
    start: int
    end: int
    done: bool = False


class Regions:
    """The regions of one buffer of ``size`` bytes (``align``-aligned starts). See the module docstring."""

    def __init__(self, size: int, align: int) -> None:
        self.size = size
        self.align = align
        self.generation = 0  # of the newest region
        self._live: collections.deque[_Region] = collections.deque()
        self._head = 0  # where the next region starts when it fits

    @property
    def free_bytes(self) -> int:
        """Bytes not held by live regions (tests and stats)."""
        return self.size - sum(r.end - r.start for r in self._live)

    @property
    def live(self) -> list[tuple[int, int, int]]:
        """(generation, start, end) of every region the server may still read (tests)."""
        return [(r.generation, r.start, r.end) for r in self._live if not r.done]

    def _place(self, need: int) -> int | None:
        live = self._live
        if not live:
            return 0 if need <= self.size else None
        first = live[0].start
        if self._head > first:  # not wrapped: free space is [head, size) and [0, first)
            if self._head + need <= self.size:
                return self._head
            return 0 if need <= first else None
        return self._head if self._head + need <= first else None  # wrapped: [head, first)

    def take(self, nbytes: int) -> tuple[int, int] | None:
        """A region of ``nbytes``: (generation, offset), or None when no space is free."""
        need = max(self.align, (nbytes + self.align - 1) // self.align * self.align)
        start = self._place(need)
        if start is None:
            return None
        self.generation += 1
        self._live.append(_Region(self.generation, start, start + need))
        self._head = start + need
        return self.generation, start

    def cancel(self, generation: int) -> None:
        """A region whose Step was never sent: free it at once."""
        self._done(lambda r: r.generation == generation)

    def ack(self, ack: RingAck) -> None:
        """Free every region the server says it is done with (cumulative: any ack may be lost)."""
        held = set(ack.held)
        self._done(lambda r: r.generation <= ack.seen and r.generation not in held)

    def reset(self) -> None:
        """Every region free (a new server imported the buffer: nothing of it is read by anyone).
        Generations go on counting, so an old server's late ack frees nothing new."""
        self._live.clear()
        self._head = 0

    def _done(self, pred: Callable[[_Region], bool]) -> None:
        for r in self._live:
            if not r.done and pred(r):
                r.done = True
        while self._live and self._live[0].done:
            self._live.popleft()
        if not self._live:
            self._head = 0
