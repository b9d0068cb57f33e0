"""The one-session MLA launch shape in the whole K3 step, A/B in one process: the step captured with
``step.ONE_SESSION_MLA_CHUNK`` and ``pa.MLA_CONFIG_ONE`` for one-session batches, and again with the
rule before it (16 work items of 64 tokens, ``MLA_CONFIG``), timed interleaved at 1 and 2 sessions
(2 runs the same kernels in both: a control), floor measured in the same run, drafts compared.

    python -m draft_tools.bench.one_session_mla --out bench/results/one_session_mla_h200.json
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

from draft_server.models import step
from draft_server.models.presets import PRESETS, random_drafter
from draft_tools.bench.draft_step_gpu import (
    CTX,
    NEW_ROWS,
    Sessions,
    floor_ms,
    interleaved,
    log,
    measure_floors,
    step_cost,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/one_session_mla_h200.json")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    report: dict[str, Any] = {
        "command": "python -m draft_tools.bench.one_session_mla " + " ".join(sys.argv[1:]),
        "machine": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "floors": measure_floors(dev),
    }
    least, shape = step.MIN_CHUNK, step.FastStep._one_session_shape
    drafters, sessions = {}, {}
    for mode in ("one_session_shape", "before"):
        if mode == "before":  # the rule before: 16 items (64-token chunks at 1 x 1K), MLA_CONFIG
            step.MIN_CHUNK = 64  # the floor then (128 since the GQA sweep)
            step.FastStep._one_session_shape = lambda self, n, chunk: False  # type: ignore[method-assign]
        t0 = time.perf_counter()
        d = random_drafter(PRESETS["k3"], dev, 2 << 30, torch.bfloat16, attention="paged")
        d.prepare(2, 64)
        report[f"capture_s_{mode}"] = time.perf_counter() - t0
        S = Sessions(d, np.random.default_rng(1), 0)
        S.open(2, CTX)
        drafters[mode], sessions[mode] = d, S
    step.MIN_CHUNK, step.FastStep._one_session_shape = least, shape  # type: ignore[method-assign]
    rows = []
    for n in (1, 2):
        times, drafts = interleaved(sessions, n, args.rounds, args.steps)
        row: dict[str, Any] = {
            "sessions": n,
            **floor_ms(step_cost(drafters["before"], n, [CTX] * n, n * NEW_ROWS), report["floors"]),
        }
        for mode, ts in times.items():
            row[f"{mode}_ms"] = statistics.median(ts)
            row[f"{mode}_rounds_ms"] = ts
        row["drafts_equal"] = drafts["one_session_shape"] == drafts["before"]
        rows.append(row)
        log(
            f"B={n} one-session shape {row['one_session_shape_ms']:.3f} ms  before {row['before_ms']:.3f} ms  "
            f"floor {row['floor_ms']:.3f}  drafts equal {row['drafts_equal']}"
        )
    report["steps"] = rows
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
