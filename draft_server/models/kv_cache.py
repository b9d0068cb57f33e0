"""Paged draft KV cache: one pool of fixed-size pages, a block table per session.

Owns page allocation (``reserve`` / ``release``), the position -> slot map, writes of context
rows and the per-layer gather of a batch's context for the block forward.

Addressing is by position from the span's start: a session's span begins at ``base`` (its start
when the span was made), and position t lives in its logical page (t - base) // P at offset
(t - base) % P, so a rewrite of position t (a resend, a rejected block's overwrite) simply lands
in the same slot; there is no rollback bookkeeping. Every context therefore starts on a page
boundary, whatever position it starts at (a restart mid-sequence too), which is what a kernel
that reads a sequence from its table's first token needs (FlashMLA). ``reserve(key, start, end)``
makes the session hold exactly the pages covering [start, end), freeing the rest, or returns False
and changes nothing; the same start keeps every row it still covers, another start is a new span
(a restart: rows are not kept). Capacity and use are counted in page-granular tokens (pages x P).

Scratch: the paged attention path writes a draft block's own rows at [pos, pos + block) before it
attends (the engine reserves them: ``Drafter.scratch_rows``); they lie past the committed
context and the next ingest overwrites them by position. One extra page, never handed to a
session (``trash_slot``), takes the writes of a CUDA graph's padding rows.

Storage: ``data[layer, page, offset, *token_shape]``; MLA: token_shape (576,) (512 normalised
latent + 64 roped key); GQA: (2, kv_heads, head_dim) for K and V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class _Session:
    base: int = 0  # the position at offset 0 of pages[0] (the span's start)
    pages: list[int] = field(default_factory=list)
    array: np.ndarray | None = None  # ``pages`` as int64, made when asked for, dropped when they change


def _array(s: _Session) -> np.ndarray:
    """The session's pages as a read-only int64 array, made once per change of its pages."""
    if s.array is None:
        s.array = np.asarray(s.pages, dtype=np.int64)
        s.array.flags.writeable = False
    return s.array


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        token_shape: tuple[int, ...],
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages < 1:
            raise ValueError("KV budget too small for one page")
        self.page_size = page_size
        self.num_pages = num_pages
        self.token_shape = token_shape
        # one page more than the budget: the trash page for padding writes
        self.data = torch.zeros((num_layers, num_pages + 1, page_size, *token_shape), dtype=dtype, device=device)
        self._flat = self.data.view(num_layers, (num_pages + 1) * page_size, *token_shape)
        self.trash_slot = num_pages * page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._sessions: dict[int, _Session] = {}

    @staticmethod
    def bytes_per_token(num_layers: int, token_shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return num_layers * int(np.prod(token_shape)) * torch.empty((), dtype=dtype).element_size()

    # -- accounting -------------------------------------------------------------------------
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def used_tokens(self) -> int:
        return (self.num_pages - len(self._free)) * self.page_size

    def held_tokens(self, key: int) -> int:
        s = self._sessions.get(key)
        return len(s.pages) * self.page_size if s else 0

    # -- allocation -------------------------------------------------------------------------
    def reserve(self, key: int, start: int, end: int) -> bool:
        P = self.page_size
        n = (end - start - 1) // P + 1 if end > start else 0
        s = self._sessions.get(key)
        if s is not None and s.base == start:  # the span grows or shrinks at its end: rows kept
            have = len(s.pages)
            if n == have:
                return True  # the common case: a decode step within its page
            if n > have:
                if n - have > len(self._free):
                    return False
                s.pages.extend(self._free.pop() for _ in range(n - have))
            else:
                self._free.extend(s.pages[n:])
                del s.pages[n:]
            s.array = None
            return True
        held = len(s.pages) if s is not None else 0
        if n > len(self._free) + held:
            return False
        if s is not None:
            self._free.extend(s.pages)
        self._sessions[key] = _Session(base=start, pages=[self._free.pop() for _ in range(n)])
        return True

    def release(self, key: int) -> None:
        s = self._sessions.pop(key, None)
        if s is not None:
            self._free.extend(s.pages)

    # -- addressing -------------------------------------------------------------------------
    def slots(self, key: int, positions: np.ndarray) -> np.ndarray:
        """Flat slot of each absolute position; raises if the session does not hold it."""
        s = self._sessions.get(key)
        P = self.page_size
        rel = positions - (s.base if s else 0)
        lp = rel // P
        if s is None or (len(positions) and (lp.min() < 0 or lp.max() >= len(s.pages))):
            span = f"[{positions.min()}, {positions.max() + 1})" if len(positions) else "[]"
            raise RuntimeError(f"KV cache: session {key} has no pages reserved for positions {span}")
        return _array(s)[lp] * P + rel % P

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [num_layers, R, *token_shape] -> their slots (int32 or int64; distinct within a call:
        ingest splits repeats)."""
        self._flat.index_copy_(1, slots.long(), rows.to(self.data.dtype))

    def slots_view(self) -> torch.Tensor:
        """Every layer's slots: [num_layers, (num_pages + 1) * page_size, *token_shape], a view (kernels
        that write rows at their slots themselves)."""
        return self._flat

    def write_layer(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [R, *token_shape] of one layer -> their slots."""
        self._flat[layer].index_copy_(0, slots.long(), rows.to(self.data.dtype))

    def pages(self, key: int, start: int, end: int) -> tuple[int, np.ndarray]:
        """(origin, physical pages: a read-only int64 view) covering positions [start, end), where
        position t is at offset (t - origin) % P of page (t - origin) // P of the list (origin: the
        position at offset 0 of its first page); raises if not held."""
        origins, pages = self.spans((key,), (start,), (end,))
        return origins[0], pages[0]

    def spans(
        self, keys: Sequence[int], starts: Sequence[int], ends: Sequence[int]
    ) -> tuple[list[int], list[np.ndarray]]:
        """``pages`` of many sessions in one pass (a step's batch): their origins and page views, in
        order. A step asks for the same pages step after step: each session's array is kept until its
        pages change, so a view is a slice, not a copy."""
        P, sessions = self.page_size, self._sessions
        origins: list[int] = []
        pages: list[np.ndarray] = []
        for key, start, end in zip(keys, starts, ends, strict=True):
            s = sessions.get(key)
            base = s.base if s is not None else 0
            lo, hi = (start - base) // P, (end - 1 - base) // P + 1
            if s is None or lo < 0 or hi > len(s.pages):
                raise RuntimeError(f"KV cache: session {key} has no pages reserved for [{start}, {end})")
            origins.append(base + lo * P)
            pages.append((s.array if s.array is not None else _array(s))[lo:hi])
        return origins, pages

    def layer(self, layer: int) -> torch.Tensor:
        """One layer's pages: [num_pages + 1, page_size, *token_shape] (the last is the trash page)."""
        return self.data[layer]

    def gather_plan(self, spans: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """For (key, start, pos) spans: page ids [N, maxp] and a visibility mask [N, maxp*P].

        The mask is True exactly for absolute positions in [start, pos); padding pages point at
        page 0 and are masked out.
        """
        P = self.page_size
        firsts, counts = [], []
        for key, start, pos in spans:
            if pos <= start:
                firsts.append(0)
                counts.append(0)
                continue
            s = self._sessions.get(key)
            base = s.base if s is not None else 0
            lo, hi = (start - base) // P, (pos - 1 - base) // P + 1
            if s is None or lo < 0 or hi > len(s.pages):
                raise RuntimeError(f"KV cache: session {key} has no pages reserved for context [{start}, {pos})")
            firsts.append(lo)
            counts.append(hi - lo)
        maxp = max(max(counts, default=0), 1)
        table = np.zeros((len(spans), maxp), dtype=np.int64)
        mask = np.zeros((len(spans), maxp * P), dtype=bool)
        for n, ((key, start, pos), lo, cnt) in enumerate(zip(spans, firsts, counts, strict=True)):
            if not cnt:
                continue
            s = self._sessions[key]
            table[n, :cnt] = s.pages[lo : lo + cnt]
            abs_pos = s.base + lo * P + np.arange(cnt * P)
            mask[n, : cnt * P] = (abs_pos >= start) & (abs_pos < pos)
        dev = self.data.device
        return torch.from_numpy(table).to(dev), torch.from_numpy(mask).to(dev)

    def gather(self, layer: int, table: torch.Tensor) -> torch.Tensor:
        """Context rows of one layer for a batch: [N, maxp*P, *token_shape]."""
        n, maxp = table.shape
        return self.data[layer][table].view(n, maxp * self.page_size, *self.token_shape)
