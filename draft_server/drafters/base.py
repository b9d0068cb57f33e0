"""The interface between the scheduler and a model backend.

The scheduler owns sessions, positions, batching and deadlines; a ``Drafter`` owns the
model, its KV cache and the math. Sessions reach the drafter as small integer keys (the
drafter never sees client identities). Positional semantics are resolved by the scheduler
before the drafter is called: ``IngestItem.start`` is the session's context start after the
ingest, so a gap restart is simply a new ``start``.

Call order inside one engine iteration: ``reserve`` (per session, may fail -> overloaded),
``ingest`` (all sessions' new rows at once), ``draft`` (all sessions wanting drafts at once).
Rows reach ``ingest`` in the wire format their client negotiated (``IngestItem.fmt``, one of
``wire_offer().formats``; layouts in ``protocol.wire``), as host numpy arrays or, from a client on
transport cuda_ipc, as ``DeviceRows`` already in the drafter's device memory (only a drafter whose
``cuda_device()`` is not None gets those).
All calls come from the engine thread only.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol import ModelContract, Sampling, WireFormat, WireOffer


class DeviceRows:
    """Rows already in the drafter's device memory (transport cuda_ipc): a torch tensor [rows, width]
    in wire storage (bf16 bit patterns as int16, fp8 rows as uint8, f32 as float32), written by a
    copy on the I/O thread's stream that ``ready`` marks done. Sliced like an array (the scheduler
    cuts each entry's rows and prefill chunks out of a Step's); a slice is where it lies in the rows
    it was cut from (``base``, ``lo``, ``len``), its tensor made only when asked for, so cutting costs
    no torch call and neighbouring slices go back together as one (``device_runs``). ``tensor()`` hands
    them to the calling thread's stream."""

    __slots__ = ("_n", "_t", "base", "lo", "ready")

    def __init__(self, t: Any, ready: Any) -> None:
        self._t = t
        self.ready = ready  # a torch.cuda.Event recorded after the copy that wrote ``t``
        self.base = t  # the rows this is a slice of: t == base[lo : lo + len]
        self.lo = 0
        self._n = -1  # rows; -1: those of ``t``

    @classmethod
    def cut(cls, base: Any, ready: Any, lo: int, n: int) -> DeviceRows:
        """Rows [lo, lo + n) of ``base`` (no torch call until their tensor is asked for)."""
        d = cls.__new__(cls)
        d._t, d.ready, d.base, d.lo, d._n = None, ready, base, lo, n
        return d

    @property
    def t(self) -> Any:
        if self._t is None:
            self._t = self.base[self.lo : self.lo + self._n]
        return self._t

    def __len__(self) -> int:
        return self._n if self._n >= 0 else int(self._t.shape[0])

    def __getitem__(self, key: Any) -> DeviceRows:
        if isinstance(key, slice) and key.step in (None, 1):
            start, stop, _ = key.indices(len(self))
            return DeviceRows.cut(self.base, self.ready, self.lo + start, max(0, stop - start))
        return DeviceRows(self.t[key], self.ready)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.base.shape[1:])

    @property
    def ndim(self) -> int:
        return int(self.base.dim())

    @property
    def nbytes(self) -> int:
        return len(self) * math.prod(self.base.shape[1:]) * self.base.element_size()

    def tensor(self) -> Any:
        """The rows for the calling thread's current stream: it waits (on the GPU, no host sync) for
        the copy that wrote them, and the allocator keeps their memory until that stream used them.
        Rows in host memory (tests on the CPU) are the tensor itself."""
        t = self.t
        if t.device.type != "cuda":
            return t
        import torch

        s = torch.cuda.current_stream(t.device)
        s.wait_event(self.ready)
        t.record_stream(s)
        return t

    def host(self) -> np.ndarray:
        """The rows on the host in wire storage (bf16 as uint16): a device-to-host copy (the checksum
        drafter's digests; a model never needs it)."""
        a = self.tensor().cpu().numpy()
        return a.view(np.uint16) if a.dtype == np.int16 else a


def device_runs(parts: Sequence[DeviceRows]) -> list[DeviceRows]:
    """``parts`` in order, each run of neighbours (slices of the same rows, each starting where the one
    before it ends, written by the same copy) joined into one: a Step's entries cut from its rows go to
    the device's staging buffer in one copy (and one stream wait), not one per entry."""
    out: list[DeviceRows] = []
    for p in parts:
        last = out[-1] if out else None
        if last is not None and p.base is last.base and p.ready is last.ready and p.lo == last.lo + len(last):
            out[-1] = DeviceRows.cut(last.base, last.ready, last.lo, len(last) + len(p))
        else:
            out.append(p)
    return out


Rows = np.ndarray | DeviceRows  # what a session's rows are on their way to ``ingest``


@dataclass(slots=True)
class IngestItem:
    key: int
    start: int  # context start of the session after this ingest
    pos: int  # absolute position of taps[0]; context becomes [start, pos + len(taps))
    # [rows, width] of ``fmt``'s layout, as received (uint16 bit patterns for bf16), or DeviceRows
    taps: Rows
    fmt: str = WireFormat.BF16.value  # the wire format of the rows


def by_format(items: Sequence[IngestItem]) -> list[tuple[str, Sequence[IngestItem]]]:
    """``items`` grouped by wire format, each group in order (one group, the items themselves, when all share one)."""
    fmt = items[0].fmt if items else ""
    if all(it.fmt == fmt for it in items):
        return [(fmt, items)] if items else []
    groups: dict[str, list[IngestItem]] = {}
    for it in items:
        groups.setdefault(it.fmt, []).append(it)
    return list(groups.items())


@dataclass(slots=True)
class DraftItem:
    key: int
    start: int  # context is [start, pos)
    pos: int  # position of the anchor token
    anchor: int
    k: int
    sampling: Sampling


@dataclass(slots=True)
class DraftOut:
    tokens: list[int]
    confidence: list[float] = field(default_factory=list)  # per draft, when served
    probs: np.ndarray | None = None  # [k, n] float32 top-n draft probabilities
    prob_ids: np.ndarray | None = None  # [k, n] int32 their token ids


class Drafter(ABC):
    """A model backend. Implementations: ChecksumDrafter (tests), the DSpark models."""

    contract: ModelContract
    scratch_rows: int = 0  # KV rows past a session's context that drafting writes (its block)

    @abstractmethod
    def capacity_tokens(self) -> int:
        """Total context tokens the KV cache can hold across all sessions."""

    @abstractmethod
    def used_tokens(self) -> int:
        """Context tokens currently held."""

    @abstractmethod
    def reserve(self, key: int, start: int, end: int) -> bool:
        """Make the session hold KV room for positions [start, end) and nothing outside it.

        ``end`` includes ``scratch_rows`` past the context when the session drafts. Returns False, changing
        nothing, when the room is not there; the scheduler then evicts or answers overloaded.
        """

    @abstractmethod
    def release(self, key: int) -> None:
        """Forget the session and free its KV (unknown keys are a no-op)."""

    @abstractmethod
    def ingest(self, items: Sequence[IngestItem]) -> None:
        """Write context rows for several sessions (each already reserved)."""

    @abstractmethod
    def draft(self, items: Sequence[DraftItem]) -> list[DraftOut]:
        """Draft ``k`` tokens after each anchor, batched over sessions."""

    def step(self, ingest: Sequence[IngestItem], drafts: Sequence[DraftItem]) -> list[DraftOut]:
        """One batch: ingest, then draft (after the ingest, so drafts see its rows). The ingest's rows
        are the caller's again when it returns, as after ``ingest``. A backend may overlap the two
        (the default runs them one after the other)."""
        if ingest:
            self.ingest(ingest)
        return self.draft(drafts) if drafts else []

    def wire_offer(self) -> WireOffer:
        """The wire formats ``ingest`` takes (and, with ``projected``, the projection's id, width
        and dtype). Default: bf16 taps only."""
        return WireOffer()

    def register_host(self, buf: memoryview) -> bool:
        """Pin a host buffer that rows will arrive in (a shared-memory ring) so ingest can copy
        them to the device directly. False (the default): not supported, rows are copied as usual."""
        return False

    def unregister_host(self, buf: memoryview) -> None:
        """Undo ``register_host`` before the buffer goes away."""
        return None

    def prepare(self, max_batch_sessions: int, max_batch_rows: int) -> dict[str, float]:
        """Get ready for traffic at these batch limits (compiled kernels, CUDA graphs and their
        self-test); called once before the server binds. Returns what it did, for the log."""
        return {}

    def cuda_device(self) -> object | None:
        """The torch CUDA device this drafter computes on, or None (CPU, checksum)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release device resources."""
