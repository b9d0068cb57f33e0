"""``SlowDrafter``: wraps any drafter and sleeps before a random fraction of its draft batches.

Simulates a slow GPU step (a hiccup, a long kernel) inside the engine: deadlines keep
running, the watchdog sees the engine busy, and every other part of the server is the real
one. Each injected sleep prints one ``chaos delay`` line that draft-soak's supervisor reads.

``ingest_s_per_row``: every ingest also sleeps this long per row, so that a burst (many
sessions' prefill in one step, as K3 taps of 16 x 256 rows are 294 MB) takes longer than a
budget to get in while decode steps of a few rows stay cheap: a CPU stand-in for a burst whose
bytes take longer than the budget to cross the network or reach the GPU (no line is printed:
it is every ingest, not an event).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

from draft_server.drafters import Drafter, DraftItem, DraftOut, IngestItem
from protocol import WireOffer


class SlowDrafter(Drafter):
    def __init__(
        self, inner: Drafter, p: float, delay_s: float, seed: int | None = None, ingest_s_per_row: float = 0.0
    ) -> None:
        if not 0.0 <= p <= 1.0 or delay_s < 0 or ingest_s_per_row < 0:
            raise ValueError("the slow fraction must be in [0, 1], the delay and the ingest time per row >= 0")
        self.ingest_s_per_row = ingest_s_per_row
        self.inner = inner
        self.contract = inner.contract
        self.scratch_rows = inner.scratch_rows
        self.p = p
        self.delay_s = delay_s
        self._rng = random.Random(seed)

    def _maybe_sleep(self) -> None:
        if self.p and self._rng.random() < self.p:
            print(f"chaos delay: this batch sleeps {self.delay_s * 1000.0:.1f} ms first", flush=True)
            time.sleep(self.delay_s)

    def capacity_tokens(self) -> int:
        return self.inner.capacity_tokens()

    def used_tokens(self) -> int:
        return self.inner.used_tokens()

    def reserve(self, key: int, start: int, end: int) -> bool:
        return self.inner.reserve(key, start, end)

    def release(self, key: int) -> None:
        self.inner.release(key)

    def ingest(self, items: Sequence[IngestItem]) -> None:
        if self.ingest_s_per_row:
            time.sleep(self.ingest_s_per_row * sum(len(i.taps) for i in items))
        self.inner.ingest(items)

    def draft(self, items: Sequence[DraftItem]) -> list[DraftOut]:
        self._maybe_sleep()
        return self.inner.draft(items)

    def cuda_device(self) -> object | None:
        return self.inner.cuda_device()

    def wire_offer(self) -> WireOffer:
        return self.inner.wire_offer()

    def close(self) -> None:
        self.inner.close()
