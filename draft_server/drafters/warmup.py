"""``warm_up``: run a drafter once at every batch shape class before the server takes traffic."""

from __future__ import annotations

import time

import numpy as np

from draft_server.drafters.base import Drafter, DraftItem, IngestItem
from protocol import Sampling
from protocol.codec import NUMPY_DTYPE


def warm_up(drafter: Drafter, max_batch_sessions: int, prefill_chunk_rows: int) -> dict[str, float]:
    """Run the drafter once at each batch shape class it will meet, on throwaway sessions.

    Called before the socket binds, so the first real steps after a (re)start do not pay for
    lazy kernel loading, library handles and the caching allocator's first blocks (on a GPU the
    first K3 steps took hundreds of ms and a restarted server missed its first budgets). Draft
    batches of 1, 2, 4, ... up to ``max_batch_sessions`` sessions (as many as the KV cache
    takes), then one prefill chunk. Everything is released afterwards. Returns the seconds spent
    and the largest batch warmed.
    """
    c = drafter.contract
    rng = np.random.default_rng(0)

    def taps(rows: int) -> np.ndarray:
        x = rng.standard_normal((rows, c.tap_width), dtype=np.float32)
        if NUMPY_DTYPE[c.tap_dtype] == np.uint16:  # bf16 travels as its bit pattern
            return (x.view(np.uint32) >> 16).astype(np.uint16)
        return x.astype(NUMPY_DTYPE[c.tap_dtype])

    t0 = time.perf_counter()
    rows, k = 4, c.block_size
    keys: list[int] = []  # negative: never a real session's handle
    largest = 0
    top = max(1, max_batch_sessions)
    try:
        for n in sorted({min(1 << i, top) for i in range(top.bit_length() + 1)}):  # 1, 2, 4, ..., top
            while len(keys) < n and drafter.reserve(-(len(keys) + 1), 0, rows + k + 1):
                keys.append(-(len(keys) + 1))
            if len(keys) < n:
                break  # the KV cache holds no more warm-up sessions
            drafter.ingest([IngestItem(key, 0, 0, taps(rows)) for key in keys[:n]])
            drafter.draft([DraftItem(key, 0, rows, 0, k, Sampling()) for key in keys[:n]])
            largest = n
        chunk = max(1, prefill_chunk_rows)
        key = -(len(keys) + 1)
        if drafter.reserve(key, 0, chunk + k + 1):
            keys.append(key)
            drafter.ingest([IngestItem(key, 0, 0, taps(chunk))])
    finally:
        for key in keys:
            drafter.release(key)
    return {"seconds": time.perf_counter() - t0, "largest_batch": float(largest)}
