"""The host's share of a fast draft step, without a GPU: FastStep's ingest and draft staging on
the CPU with the device bodies (graphs, kernels) stubbed out, tiny K3 model, 1, 8, 16 and 64 sessions
of 1,024 context rows, 3 new rows and 7 drafts each, the rows in registered memory as the server's
receive arena and shm rings hold them. It measures the Python and numpy work that runs before the
step's graphs can launch (page lists, staging): on a GPU the ingest part keeps the GPU idle, the
draft part overlaps the ingest graph. ``step_host_ms``: the drafter's whole ``step`` (as the engine
calls it), ingest and draft in one call.

    python -m draft_tools.bench.host_step [--steps 300] [--out FILE]

With ``--trees OLD,NEW`` it runs this file's measurement under each source tree's ``draft_server``
in turn, ``--rounds`` times interleaved, and writes both series (an A/B of a change on a shared
machine; the measuring code is this one for both).
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

SIZES = (1, 8, 16, 64)


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
    # the rows: 8 steps' worth, each step's sessions one after another (one Step's rows), registered
    # as the server's receive arena and shm rings are
    top = max(SIZES)
    buf = bytearray(8 * top * 3 * w * 2)
    assert d.register_host(memoryview(buf))
    pool = np.frombuffer(buf, dtype=np.uint16).reshape(8, top, 3, w)
    pool[:] = (rng.standard_normal(pool.shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    out: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for n in SIZES:
            keys = list(range(100, 100 + n))
            end = dict.fromkeys(keys, 1024)
            for k in keys:
                assert d.reserve(k, 0, 1024 + 3 * (steps + 40) + 8)
            ing, stage, whole = [], [], []
            for i in range(2 * (steps + 20)):
                items = []
                for j, k in enumerate(keys):
                    d.reserve(k, 0, end[k] + 3 + 7)
                    items.append(IngestItem(k, 0, end[k], pool[i % 8, j]))
                    end[k] += 3
                drafts = [DraftItem(k, 0, end[k], 7, 7, GREEDY) for k in keys]
                t0 = time.perf_counter()
                if i % 2:  # every other step: the drafter's whole step, as the engine calls it
                    d.step(items, drafts)
                    t1 = t2 = time.perf_counter()
                else:
                    fast.ingest(items, wait=False)
                    t1 = time.perf_counter()
                    fast.draft(drafts)
                    t2 = time.perf_counter()
                if i >= 40 and i % 2:
                    whole.append((t2 - t0) * 1e3)
                elif i >= 40:
                    ing.append((t1 - t0) * 1e3)
                    stage.append((t2 - t1) * 1e3)
            out[str(n)] = {
                "ingest_host_ms": statistics.median(ing),
                "draft_host_ms": statistics.median(stage),
                "step_host_ms": statistics.median(whole),
            }
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
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--steps", str(a.steps)]
                p = subprocess.run(cmd, env=env, cwd=t, capture_output=True, text=True, check=True)
                series[t].append(json.loads(p.stdout.strip().splitlines()[-1]))
        from draft_tools.bench.ab import this_tree  # the parent only: a child's draft_tools is its tree's

        report = {"series": series, "commits": {t: this_tree(t) for t in trees}}
        for t, runs in series.items():
            for n in map(str, SIZES):
                for key in ("ingest_host_ms", "draft_host_ms", "step_host_ms"):
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
