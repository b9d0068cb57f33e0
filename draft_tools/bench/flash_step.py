"""The K3 draft step with FlashMLA against the step with our Triton MLA kernel, in one process (H200).

Two ``random:k3`` drafters with the same seeded weights: one with 64-token pages, whose MLA runs
through FlashMLA (``kernels/flash_mla.py``; needs ``DRAFT_FLASHMLA_SRC``), one with the 16-token
pages and Triton kernel of the step before. Each holds 64 sessions of 1,024 context rows; steps of
3 new rows + 7 drafts per session (CUDA graphs; taps in registered host memory, as the server's
receive arena holds them) are timed interleaved, rounds alternating which
drafter goes first, at 1, 2, 4, ..., 64 sessions, beside the step's floor measured in the same run;
then the mixed batch (one 32K session + 63 of 1K), kernels and host syncs per step at 1 and 64
sessions (torch.profiler), and how often the two drafters' greedy drafts agree (bf16: the two
kernels round differently, so a random drafter's argmax may flip).

    DRAFT_FLASHMLA_SRC=... python3 -m draft_tools.bench.flash_step --out bench/results/flash_step_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from draft_server.models.kernels import flash_mla as fm
from draft_server.models.presets import PRESETS, random_drafter
from draft_tools.bench.draft_step_gpu import (
    CTX,
    NEW_ROWS,
    Sessions,
    floor_ms,
    interleaved,
    log,
    measure_floors,
    profile_counts,
    step_cost,
)

SIZES = (1, 2, 4, 8, 16, 32, 64)
MIXED = [32768] + [1024] * 63


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/flash_step_h200.json")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    kernel = fm.load()
    report: dict[str, Any] = {
        "command": "python3 -m draft_tools.bench.flash_step " + " ".join(sys.argv[1:]),
        "machine": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "flashmla_build_or_load_s": time.perf_counter() - t0,
        "floors": measure_floors(dev),
    }
    if kernel is None:
        log(f"FlashMLA unavailable: {fm.why_not()}")
        report["error"] = fm.why_not()
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        return 1
    drafters, sessions = {}, {}
    for mode, page in (("flashmla", None), ("triton", 16)):
        t0 = time.perf_counter()
        d = random_drafter(PRESETS["k3"], dev, 6 << 30, torch.bfloat16, attention="paged", page_size=page)
        prep = d.prepare(64, 4096)
        assert d.fast is not None and (d.fast.flash is not None) == (mode == "flashmla"), mode
        report[f"{mode}_start"] = {"page_size": d.cache.page_size, "capture_s": time.perf_counter() - t0, **prep}
        S = Sessions(d, np.random.default_rng(1), 0)
        # taps in registered host memory, as the server's receive arena holds frames (draft_step_gpu's way)
        registered = S.register(d)
        report[f"{mode}_taps_in"] = "registered host memory" if registered else "ordinary host memory (staged copy)"
        S.open(64, CTX)
        drafters[mode], sessions[mode] = d, S
        log(f"{mode}: pages of {d.cache.page_size}, ready in {time.perf_counter() - t0:.1f} s")
    rows = []
    for n in SIZES:
        times, drafts = interleaved(sessions, n, args.rounds, args.steps)
        row: dict[str, Any] = {
            "sessions": n,
            **floor_ms(step_cost(drafters["triton"], n, [CTX] * n, n * NEW_ROWS), report["floors"]),
        }
        for mode, ts in times.items():
            row[f"{mode}_ms"] = statistics.median(ts)
            row[f"{mode}_rounds_ms"] = ts
            row[f"{mode}_ratio_to_floor"] = row[f"{mode}_ms"] / row["floor_ms"]
        row["draft_agreement"] = agreement(drafts["flashmla"], drafts["triton"])
        rows.append(row)
        log(
            f"B={n:2d} flashmla {row['flashmla_ms']:.3f} ms ({row['flashmla_ratio_to_floor']:.2f}x)  "
            f"triton {row['triton_ms']:.3f} ms ({row['triton_ratio_to_floor']:.2f}x)  floor {row['floor_ms']:.3f}  "
            f"agreement {row['draft_agreement']:.2f}"
        )
    report["steps"] = rows
    prof = {}
    for mode, S in sessions.items():
        for n in (1, 64):
            ks = list(range(n))
            S.rewind(ks, CTX)
            prof[f"{mode}_B{n}"] = profile_counts(lambda S=S, ks=ks: S.step(ks))
            p = prof[f"{mode}_B{n}"]
            log(
                f"{mode} B={n}: {p['kernels']} kernels, {p['host_syncs']} host syncs, "
                f"GPU busy {p['gpu_busy_ms']:.3f} ms"
            )
    report["profile"] = prof
    mixed: dict[str, Any] = {}
    for mode, d in drafters.items():
        for k in range(64):
            d.release(k)
        S = Sessions(d, np.random.default_rng(2), 1000)
        S.pool = sessions[mode].pool  # the registered taps
        ks = S.open(len(MIXED), MIXED)
        ts = []
        for _ in range(args.rounds):
            S.rewind(ks, 0)
            for k, c in zip(ks, MIXED, strict=True):
                S.end[k] = c
            S.step(ks)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            for _ in range(args.steps):
                S.step(ks)
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t1) * 1e3 / args.steps)
        mixed[f"{mode}_ms"] = statistics.median(ts)
        mixed[f"{mode}_rounds_ms"] = ts
        mixed[f"{mode}_eager_steps"] = d.fast.eager_steps if d.fast else -1
    mixed.update(floor_ms(step_cost(drafters["triton"], len(MIXED), MIXED, len(MIXED) * NEW_ROWS), report["floors"]))
    for mode in drafters:
        mixed[f"{mode}_ratio_to_floor"] = mixed[f"{mode}_ms"] / mixed["floor_ms"]
    report["mixed_32k_plus_63x1k"] = mixed
    log(
        f"mixed: flashmla {mixed['flashmla_ms']:.3f} ms  triton {mixed['triton_ms']:.3f} ms  "
        f"floor {mixed['floor_ms']:.3f}"
    )
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
