"""Programmatic dependent launch, A/B in one process: the full-size K3 step captured three times
(PDL off; on, the next grid launched right after each kernel's wait; on, launched as each kernel's
programs exit), timed interleaved at every batch size, with the floor measured in the same run.

One process, so the three drafters share the GEMM tuner's choices (the same kernels, the same
sums: their drafts must be equal token for token, which the run checks) and the host's state;
rounds alternate the order. Each timed step is ``Drafter.step`` (ingest 3 rows + 7 drafts per
session, 1,024 context rows), as the server calls it.

    python -m draft_tools.bench.pdl_ab --out bench/results/pdl_ab_h200.json
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

from draft_server.models.kernels import pdl
from draft_server.models.presets import PRESETS, random_drafter
from draft_tools.bench.draft_step_gpu import CTX, NEW_ROWS, Sessions, floor_ms, log, measure_floors, step_cost

MODES = {"off": (False, False), "early": (True, True), "late": (True, False)}  # (ENABLED, EARLY)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/pdl_ab_h200.json")
    ap.add_argument("--preset", default="k3")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per mode per round")
    args = ap.parse_args()
    dev = torch.device("cuda")
    report: dict[str, Any] = {
        "command": "python -m draft_tools.bench.pdl_ab " + " ".join(sys.argv[1:]),
        "machine": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "supported": pdl._supported(dev.index or 0),
    }
    import triton

    report["machine"]["triton"] = triton.__version__
    report["floors"] = floors = measure_floors(dev)
    drafters, sessions, keys = {}, {}, {}
    for mode, (enabled, early) in MODES.items():
        pdl.ENABLED, pdl.EARLY = enabled, early
        t0 = time.perf_counter()
        d = random_drafter(PRESETS[args.preset], dev, 4 << 30, torch.bfloat16, attention="paged")
        d.prepare(64, 4096)
        report[f"capture_s_{mode}"] = time.perf_counter() - t0
        S = Sessions(d, np.random.default_rng(1), 0)  # same rows for every mode
        keys[mode] = S.open(64, CTX)
        drafters[mode], sessions[mode] = d, S
        log(f"{mode}: captured in {report[f'capture_s_{mode}']:.1f} s")
    pdl.ENABLED, pdl.EARLY = False, True
    rows = []
    for n in (1, 2, 4, 8, 16, 32, 64):
        times: dict[str, list[float]] = {m: [] for m in MODES}
        drafts: dict[str, list[list[int]]] = {}
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                S, ks = sessions[mode], keys[mode][:n]
                S.rewind(ks, CTX)
                S.turn = 0
                first = S.step(ks)  # warm (and the drafts compared across modes)
                if r == 0:
                    drafts[mode] = first
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    S.step(ks)
                torch.cuda.synchronize()
                times[mode].append((time.perf_counter() - t0) * 1e3 / args.steps)
        row: dict[str, Any] = {
            "sessions": n,
            **floor_ms(step_cost(drafters["off"], n, [CTX] * n, n * NEW_ROWS), floors),
        }
        for mode in MODES:
            row[f"{mode}_ms"] = statistics.median(times[mode])
            row[f"{mode}_rounds_ms"] = times[mode]
        row["drafts_equal"] = all(drafts[m] == drafts["off"] for m in MODES)
        rows.append(row)
        log(
            f"B={n:3d} off {row['off_ms']:.3f}  early {row['early_ms']:.3f}  late {row['late_ms']:.3f} ms  "
            f"floor {row['floor_ms']:.3f}  drafts equal {row['drafts_equal']}"
        )
    report["steps"] = rows
    for d in drafters.values():
        d.close()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
