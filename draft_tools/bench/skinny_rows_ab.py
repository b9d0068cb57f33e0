"""The draft step with the GEMM tuner offering the skinny kernel up to 64 rows against up to 128, one process.

Owns the A/B behind ``gemm.SKINNY_ROWS``. Two ``random:k3`` (or ``--preset``) drafters with the same
seeded weights, each captured under its own ``GemmTuner`` (CUDA graphs keep the kernels their tuner
chose, so the two run side by side after capture): one with the skinny kernel offered to 64 rows (8
sessions x 7 block rows), one to ``--rows`` (128: 16 sessions' 112). Steps of 3 new rows + 7 drafts
per session over 1,024 context rows, taps in registered host memory, timed interleaved (rounds
alternate which goes first) at ``--sizes`` sessions beside the step's floor measured in the same run;
each tuner's choices and timings for the shapes that differ; how often the two drafters' greedy drafts
agree (bf16: the kernels sum in different orders).

    python3 -m draft_tools.bench.skinny_rows_ab --sizes 8,16,32 --out bench/results/skinny_rows_ab_h200.json
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

from draft_server.models import gemm
from draft_server.models.presets import PRESETS, random_drafter
from draft_tools.bench.draft_step_gpu import (
    CTX,
    NEW_ROWS,
    Sessions,
    floor_ms,
    gpu_machine,
    interleaved,
    log,
    measure_floors,
    step_cost,
)
from draft_tools.bench.flash_step import agreement


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/skinny_rows_ab_h200.json")
    ap.add_argument("--preset", default="k3")
    ap.add_argument("--rows", type=int, default=128, help="the after side's gemm.SKINNY_ROWS (before: 64)")
    ap.add_argument("--sizes", default="8,16,32")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    report: dict[str, Any] = {
        "command": "python3 -m draft_tools.bench.skinny_rows_ab " + " ".join(sys.argv[1:]),
        "machine": gpu_machine(dev),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "floors": measure_floors(dev),
    }
    drafters, sessions, tuners = {}, {}, {}
    for mode, rows in (("rows64", 64), (f"rows{args.rows}", args.rows)):
        t0 = time.perf_counter()
        gemm.SKINNY_ROWS, gemm.TUNER = rows, gemm.GemmTuner()  # each drafter tunes and captures under its own
        d = random_drafter(PRESETS[args.preset], dev, 6 << 30, torch.bfloat16, attention="paged")
        prep = d.prepare(64, 4096)
        tuners[mode] = gemm.TUNER
        report[f"{mode}_start"] = {"skinny_rows": rows, "capture_s": time.perf_counter() - t0, **prep}
        S = Sessions(d, np.random.default_rng(1), 0)
        report[f"{mode}_taps_in"] = "registered host memory" if S.register(d) else "ordinary host memory"
        S.open(64, CTX)
        drafters[mode], sessions[mode] = d, S
        log(f"{mode}: ready in {time.perf_counter() - t0:.1f} s, tuner {tuners[mode].summary()}")
    a, b = list(tuners.values())
    report["choices_that_differ"] = {
        repr(k): {"before": a.choice.get(k), "after": b.choice[k], "timings_ms": b.timings.get(k)}
        for k in b.choice
        if a.choice.get(k) != b.choice[k]
    }
    for k, v in report["choices_that_differ"].items():
        log(f"  {k}: {v['before']} -> {v['after']}  {json.dumps(v['timings_ms'], default=float)[:160]}")
    rows_out = []
    first = next(iter(drafters.values()))
    for n in [int(s) for s in args.sizes.split(",")]:
        times, drafts = interleaved(sessions, n, args.rounds, args.steps)
        cost = step_cost(first, n, [CTX] * n, n * NEW_ROWS)
        row: dict[str, Any] = {"sessions": n, **floor_ms(cost, report["floors"])}
        for mode, ts in times.items():
            row[f"{mode}_ms"] = statistics.median(ts)
            row[f"{mode}_rounds_ms"] = ts
            row[f"{mode}_ratio_to_floor"] = row[f"{mode}_ms"] / row["floor_ms"]
        row["draft_agreement"] = agreement(*drafts.values())
        rows_out.append(row)
        log(
            f"B={n:2d} "
            + "  ".join(f"{m} {row[f'{m}_ms']:.3f} ms ({row[f'{m}_ratio_to_floor']:.2f}x)" for m in times)
            + f"  floor {row['floor_ms']:.3f}  agreement {row['draft_agreement']:.2f}"
        )
    report["steps"] = rows_out
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
