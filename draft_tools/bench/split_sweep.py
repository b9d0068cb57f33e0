"""The GQA draft step's split-K chunking (``step.WORK_ITEMS``) swept in one process (GPU).

``FastStep`` cuts a batch's contexts into about ``WORK_ITEMS[layout]`` chunks (each a program of the
attention's stage 1, merged by stage 2). MLA's 16 was chosen by a sweep of CUDA-graph replays on the
H200 (``mla_sweep_h200_v3.json``); GQA's 40 came from eager calls, launch-bound at small batches.
Here one Qwen3-size drafter (random weights, bf16) is captured once per value (every FastStep shares
the weights, the KV cache and the GEMM tuner's choices: only the chunking differs), and steps of 3
new rows + 7 drafts per session at 1,024 context rows (taps in registered host memory, CUDA graphs)
are timed interleaved, the order of the values rotating each round, at B = 1..64, beside the floor
measured in the same run; with whether each value's greedy drafts equal the first's.

    python3 -m draft_tools.bench.split_sweep --items 40,16,8,4 --out bench/results/split_sweep_h100.json
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

from draft_server.models import step as step_mod
from draft_server.models.presets import PRESETS, random_drafter
from draft_tools.bench.draft_step_gpu import (
    CTX,
    NEW_ROWS,
    Sessions,
    captures_interleaved,
    floor_ms,
    gpu_machine,
    log,
    measure_floors,
    share_registered,
    step_cost,
)
from draft_tools.bench.flash_step import agreement

SIZES = (1, 2, 4, 8, 16, 32, 64)


def sweep(
    name: str, items: list[int], floors: dict[str, float], rounds: int, steps: int, dev: torch.device
) -> dict[str, Any]:
    d = random_drafter(PRESETS[name], dev, 8 << 30, torch.bfloat16, attention="paged")
    mla = d.model.layout.mla
    res: dict[str, Any] = {"preset": name, "layout": "mla" if mla else "gqa", "items": items}
    fasts: dict[int, Any] = {}
    saved = step_mod.WORK_ITEMS[mla]
    for it in items:
        step_mod.WORK_ITEMS[mla] = it
        t0 = time.perf_counter()
        try:
            d.prepare(max(SIZES), 4096)
        finally:
            step_mod.WORK_ITEMS[mla] = saved
        fasts[it] = d.fast
        res[f"prepare_s_{it}"] = time.perf_counter() - t0
        chunks = {n: g.chunk for n, g in sorted(d.fast._draft_graphs.items())}
        res[f"chunks_{it}"] = chunks
        log(f"{name} items {it}: captured in {res[f'prepare_s_{it}']:.1f} s, chunk by bucket {chunks}")
    S = Sessions(d, np.random.default_rng(1), 0)
    registered = share_registered(list(fasts.values()), S)
    res["taps_in"] = "registered host memory" if registered else "ordinary host memory (staged copy)"
    keys = S.open(max(SIZES), CTX)
    rows = []
    for n in SIZES:
        times, drafts = captures_interleaved(S, fasts, n, rounds, steps)
        row: dict[str, Any] = {"sessions": n, **floor_ms(step_cost(d, n, [CTX] * n, n * NEW_ROWS), floors)}
        for it, ts in times.items():
            row[f"items_{it}_ms"] = statistics.median(ts)
            row[f"items_{it}_rounds_ms"] = ts
            row[f"items_{it}_ratio_to_floor"] = row[f"items_{it}_ms"] / row["floor_ms"]
            row[f"items_{it}_agreement"] = agreement(drafts[it], drafts[items[0]])
        rows.append(row)
        log(
            f"{name:9s} B={n:2d} floor {row['floor_ms']:.3f} | "
            + "  ".join(
                f"{it}: {row[f'items_{it}_ms']:.3f} ({row[f'items_{it}_ratio_to_floor']:.2f}x, "
                f"agree {row[f'items_{it}_agreement']:.2f})"
                for it in items
            )
        )
    res["steps"] = rows
    d.fast = None
    if S.registered is not None:
        fasts[items[0]].unregister_host(memoryview(S.registered))
    S.close(keys)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/split_sweep.json")
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--items", default="40,16,8,4", help="WORK_ITEMS values, the first the reference for drafts")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    report: dict[str, Any] = {
        "command": "python3 -m draft_tools.bench.split_sweep " + " ".join(sys.argv[1:]),
        "machine": gpu_machine(dev),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "floors": measure_floors(dev),
    }
    report[args.preset] = sweep(
        args.preset, [int(x) for x in args.items.split(",")], report["floors"], args.rounds, args.steps, dev
    )
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
