"""The host's share of a fast draft step, without a GPU: FastStep's ingest and draft staging on
the CPU with the device bodies (graphs, kernels) stubbed out, tiny K3 model, 1 and 64 sessions of
1,024 context rows, 3 new rows and 7 drafts each. It measures the Python and numpy work that
runs before the step's graphs can launch (slots, page lists, staging): on a GPU the ingest part
keeps the GPU idle, the draft part overlaps the ingest graph.

    python -m draft_tools.bench.host_step [--steps 300] [--out FILE]

With ``--trees OLD,NEW`` it runs itself under each source tree in turn, ``--rounds`` times
interleaved, and writes both series (an A/B of a change on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any


def measure(steps: int) -> dict[str, dict[str, float]]:
    import numpy as np
    import torch

    from draft_server.drafters import DraftItem, IngestItem
    from draft_server.models.presets import random_drafter
    from draft_server.models.step import FastStep
    from draft_server.models.tiny import K3_CONFIG
    from protocol import GREEDY

    FastStep._ingest_body = lambda self, fmt, r: None  # type: ignore[method-assign]
    FastStep._draft_body = lambda self, n, batch: None  # type: ignore[method-assign]
    d = random_drafter(dict(K3_CONFIG), torch.device("cpu"), 64 << 20, torch.float32, attention="paged")
    d.prepare(64, 512)
    fast = d.fast
    assert fast is not None
    rng = np.random.default_rng(0)
    w = d.contract.tap_width
    pool = [(rng.standard_normal((3, w), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16) for _ in range(8)]
    out: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for n in (1, 64):
            keys = list(range(100, 100 + n))
            end = dict.fromkeys(keys, 1024)
            for k in keys:
                assert d.reserve(k, 0, 1024 + 3 * (steps + 40) + 8)
            ing, stage = [], []
            for i in range(steps + 20):
                items = []
                for k in keys:
                    d.reserve(k, 0, end[k] + 3 + 7)
                    items.append(IngestItem(k, 0, end[k], pool[i % 8]))
                    end[k] += 3
                t0 = time.perf_counter()
                fast.ingest(items, wait=False)
                t1 = time.perf_counter()
                fast.draft([DraftItem(k, 0, end[k], 7, 7, GREEDY) for k in keys])
                t2 = time.perf_counter()
                if i >= 20:
                    ing.append((t1 - t0) * 1e3)
                    stage.append((t2 - t1) * 1e3)
            out[str(n)] = {"ingest_host_ms": statistics.median(ing), "draft_host_ms": statistics.median(stage)}
            for k in keys:
                d.release(k)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--trees", default="", help="OLD,NEW source trees: interleaved A/B rounds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child or not a.trees:
        res = measure(a.steps)
        if a.child:
            print(json.dumps(res))
            return 0
        report: dict[str, Any] = {"runs": res}
    else:
        trees = a.trees.split(",")
        series: dict[str, list[Any]] = {t: [] for t in trees}
        for _ in range(a.rounds):
            for t in trees:
                env = {**os.environ, "PYTHONPATH": os.path.abspath(t)}
                cmd = [sys.executable, "-m", "draft_tools.bench.host_step", "--child", "--steps", str(a.steps)]
                p = subprocess.run(cmd, env=env, cwd=t, capture_output=True, text=True, check=True)
                series[t].append(json.loads(p.stdout.strip().splitlines()[-1]))
        report = {"series": series}
        for t, runs in series.items():
            for n in ("1", "64"):
                for key in ("ingest_host_ms", "draft_host_ms"):
                    vals = [r[n][key] for r in runs]
                    report.setdefault("median_of_rounds", {}).setdefault(t, {})[f"{n}_{key}"] = statistics.median(vals)
    report.update(
        command="python -m draft_tools.bench.host_step " + " ".join(sys.argv[1:]),
        machine={"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    text = json.dumps(report, indent=1)
    print(json.dumps(report.get("median_of_rounds", report.get("runs")), indent=1))
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
