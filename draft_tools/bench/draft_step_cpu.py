"""Time the CPU draft step of the tiny DSpark models at 1, 4 and 16 sessions.

One step = what the engine thread does per decode iteration: ingest 3 new context rows per
session (one batched ingest), then draft k = block_size for every session (one batched
draft). Sessions start with 64 rows of context and grow as the steps run. Greedy drafting.
Writes bench/results/draft_step_cpu.json with machine info, the command and the numbers.

    .venv/bin/python -m draft_tools.bench.draft_step_cpu [--steps 40] [--dtype float32] [--threads 1] [--out PATH]

The machine it ran on was shared (see loadavg in the JSON): read the numbers as an upper bound.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from draft_server.drafters.base import DraftItem, IngestItem
from draft_server.models import load_drafter
from draft_server.models.tiny import make_tiny
from draft_tools.common import write_report
from protocol import GREEDY


def taps(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    x = torch.from_numpy(rng.standard_normal((rows, width)).astype(np.float32))
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def bench_one(drafter, sessions: int, steps: int, warmup: int = 5, prefix: int = 64) -> dict:
    c = drafter.contract
    rng = np.random.default_rng(0)
    ends = {}
    for s in range(sessions):
        assert drafter.reserve(s, 0, prefix)
        drafter.ingest([IngestItem(s, 0, 0, taps(rng, prefix, c.tap_width))])
        ends[s] = prefix
    ingest_ms, draft_ms, step_ms = [], [], []
    for i in range(warmup + steps):
        items = []
        for s in range(sessions):
            assert drafter.reserve(s, 0, ends[s] + 3)
            items.append(IngestItem(s, 0, ends[s], taps(rng, 3, c.tap_width)))
        t0 = time.perf_counter()
        drafter.ingest(items)
        t1 = time.perf_counter()
        for s in range(sessions):
            ends[s] += 3
        drafter.draft([DraftItem(s, 0, ends[s], 5, c.block_size, GREEDY) for s in range(sessions)])
        t2 = time.perf_counter()
        if i >= warmup:
            ingest_ms.append((t1 - t0) * 1e3)
            draft_ms.append((t2 - t1) * 1e3)
            step_ms.append((t2 - t0) * 1e3)
    for s in range(sessions):
        drafter.release(s)

    def stats(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"median": round(statistics.median(xs), 3), "p90": round(xs[int(0.9 * (len(xs) - 1))], 3)}

    return {
        "sessions": sessions,
        "k": c.block_size,
        "ingest_rows_per_session": 3,
        "ingest_ms": stats(ingest_ms),
        "draft_ms": stats(draft_ms),
        "step_ms": stats(step_ms),
        "drafted_tokens_per_s": round(sessions * c.block_size / (statistics.median(step_ms) / 1e3), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable on a shared box)")
    ap.add_argument("--out", default="bench/results/draft_step_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("k3", "qwen3"):
            paths = make_tiny(variant, os.path.join(tmp, variant))
            drafter = load_drafter(paths.draft, paths.target, "cpu", args.dtype, kv_budget_bytes=64 << 20)
            cfg = drafter.cfg
            model = {
                "variant": variant,
                "layers": cfg.num_layers,
                "hidden": cfg.hidden_size,
                "heads": cfg.num_heads,
                "vocab": cfg.vocab_size,
                "block_size": cfg.block_size,
                "taps": cfg.n_taps,
            }
            for n in (1, 4, 16):
                r = bench_one(drafter, n, args.steps)
                results.append({**model, **r})
                print(f"{variant:6s} sessions={n:2d} step median {r['step_ms']['median']:.2f} ms", flush=True)
    out = {
        "what": "CPU draft step of the tiny DSpark models: batched ingest of 3 rows/session + batched draft of k=block",
        "command": " ".join([os.path.relpath(sys.executable, os.getcwd()), *sys.argv]),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        },
        "dtype": args.dtype,
        "steps": args.steps,
        "results": results,
    }
    write_report(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
