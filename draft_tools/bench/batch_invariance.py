"""Is a session's greedy draft independent of what else is in its batch? (full-size random K3)

16 sessions, 96 context rows each, then 4 decode steps (3 rows + draft k = block_size). The same
sessions go through the drafter three ways on one set of weights:
* alone: each session ingested and drafted in batches of 1;
* batched: all 16 ingested and drafted together;
* batched again: the same, a second time (run-to-run determinism at equal shapes).
Reported per dtype: sessions whose drafts are identical to the alone path, and the share of
draft tokens that agree. A soak compares a chaos pass with a fault-free pass whose batches differ,
so its exact-equality check needs a drafter whose drafts do not depend on the batch.

    python3 -m draft_tools.bench.batch_invariance --out OUT.json [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np
import torch

from draft_server.drafters.base import DraftItem, IngestItem
from draft_server.models import load_preset
from protocol import GREEDY
from protocol.codec import NUMPY_DTYPE

S, CTX, STEPS = 16, 96, 4


def run(drafter, groups: list[list[int]], key_base: int, seed: int) -> dict[int, list[int]]:
    """Every session's drafts over the steps, batching sessions as ``groups`` says."""
    c = drafter.contract
    k = c.block_size
    rng = np.random.default_rng(seed)
    rows = [CTX] + [3] * STEPS
    taps = [[rng.standard_normal((r, c.tap_width), dtype=np.float32) for r in rows] for _ in range(S)]
    anchors = [[int(a) for a in rng.integers(0, c.vocab_size, len(rows))] for _ in range(S)]

    def wire(x: np.ndarray) -> np.ndarray:
        return (x.view(np.uint32) >> 16).astype(np.uint16) if NUMPY_DTYPE[c.tap_dtype] == np.uint16 else x

    out: dict[int, list[int]] = {i: [] for i in range(S)}
    ends = [0] * S
    for step, r in enumerate(rows):
        for g in groups:
            for i in g:
                assert drafter.reserve(key_base + i, 0, ends[i] + r + k + 1)
            drafter.ingest([IngestItem(key_base + i, 0, ends[i], wire(taps[i][step])) for i in g])
            for i in g:
                ends[i] += r
            res = drafter.draft([DraftItem(key_base + i, 0, ends[i], anchors[i][step], k, GREEDY) for i in g])
            for i, d in zip(g, res, strict=True):
                out[i] += d.tokens
    for i in range(S):
        drafter.release(key_base + i)
    return out


def compare(a: dict[int, list[int]], b: dict[int, list[int]]) -> dict[str, float]:
    same = sum(a[i] == b[i] for i in range(S))
    tok = sum(x == y for i in range(S) for x, y in zip(a[i], b[i], strict=True))
    total = sum(len(a[i]) for i in range(S))
    return {"sessions_identical": same, "sessions": S, "token_agreement": round(tok / total, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", default="bf16,float32")
    args = ap.parse_args()
    results = []
    for dt in args.dtypes.split(","):
        t0 = time.time()
        drafter = load_preset("k3", args.device, dt, 2 << 30)
        alone = run(drafter, [[i] for i in range(S)], 0, seed=1)
        batched = run(drafter, [list(range(S))], 100, seed=1)
        again = run(drafter, [list(range(S))], 200, seed=1)
        halves = run(drafter, [list(range(0, S, 2)), list(range(1, S, 2))], 300, seed=1)
        row = {
            "dtype": dt,
            "batched_vs_alone": compare(batched, alone),
            "halves_vs_batched": compare(halves, batched),
            "batched_vs_batched_again": compare(again, batched),
            "seconds": round(time.time() - t0, 1),
        }
        results.append(row)
        print(
            f"{dt:8s} batched vs alone {row['batched_vs_alone']}  halves vs batched {row['halves_vs_batched']}"
            f"  again {row['batched_vs_batched_again']}",
            flush=True,
        )
        del drafter
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    info = {
        "command": "python3 -m draft_tools.bench.batch_invariance " + " ".join(sys.argv[1:]),
        "machine": {
            "host": platform.node(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "sessions": S,
        "context_rows": CTX,
        "decode_steps": STEPS,
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
