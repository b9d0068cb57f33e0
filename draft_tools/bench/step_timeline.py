"""Where a draft step's wall time goes that the GPU does not: one step's host phases and GPU gaps.

For each preset and batch size: the step (ingest 3 rows per session + 7 greedy drafts, 1,024
context rows, taps in registered memory, one ``Drafter.step`` as the server calls it) timed
unprofiled, then a few steps under torch.profiler with the step's host phases annotated
(``record_function`` around the drafter's methods, patched in here: the server's code is as it
ships). The chrome trace of each goes to ``--trace-dir`` (gzip); the JSON has, per step, its wall
time, the GPU's busy time (the union of kernels and copies), the time before the GPU's first
work and after its last, the gaps between (with the host phase that was running when each began),
and each phase's host time; and, unprofiled, each phase's host time by ``time.perf_counter``
(``host_clock_us``: the profiler's own cost inflates the traced host phases several times).

    python3 -m draft_tools.bench.step_timeline --presets k3 --batches 1,8,64 --out $OUT/step_timeline.json
"""

from __future__ import annotations

import argparse
import functools
import gzip
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from draft_server.models import drafter as drafter_mod
from draft_server.models import step as step_mod
from draft_server.models.kv_cache import PagedKVCache
from draft_server.models.presets import PRESETS, random_drafter
from draft_tools.bench.draft_step_gpu import CTX, NEW_ROWS, Sessions, gpu_machine, log, timed

PHASES = {  # annotation -> (owner, method)
    "drafter.step": (drafter_mod.DSparkDrafter, "step"),
    "drafter.draft_fast": (drafter_mod.DSparkDrafter, "_draft_fast"),
    "fast.ingest": (step_mod.FastStep, "ingest"),
    "fast.ingest_rows": (step_mod.FastStep, "_ingest_rows"),
    "fast.stage": (step_mod.FastStep, "_stage"),
    "fast.draft": (step_mod.FastStep, "draft"),
    "graph.replay": (torch.cuda.CUDAGraph, "replay"),
}
# the host clock's finer split of the ingest and staging (not traced: the wrappers' own cost, about
# 1 us a call, is paid by the many-call ones at 64 sessions, so ``host_clock_fine_us`` is for attribution)
FINE = {
    "fast.registered_runs": (step_mod.FastStep, "_registered_runs"),
    "fast.describe": (step_mod.FastStep, "_describe"),
    "fast.zero_tail": (step_mod.FastStep, "_zero_tail"),
    "cache.pages": (PagedKVCache, "pages"),
    "tensor.copy_": (torch.Tensor, "copy_"),
    "event.record": (torch.cuda.Event, "record"),
    "event.synchronize": (torch.cuda.Event, "synchronize"),
}


def _wrap_phases(
    targets: dict[str, tuple[Any, str]], around: Callable[[str, Callable[..., Any]], Callable[..., Any]]
) -> Callable[[], None]:
    """Replace each target method with ``around(name, method)``; returns the undo."""
    saved = []
    for name, (owner, attr) in targets.items():
        fn = getattr(owner, attr)
        setattr(owner, attr, functools.update_wrapper(around(name, fn), fn))
        saved.append((owner, attr, fn))

    def undo() -> None:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)

    return undo


def annotate() -> Callable[[], None]:
    """Wrap each phase's method in a ``record_function`` of its name; returns the undo."""

    def around(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **kw: Any) -> Any:
            with torch.profiler.record_function(name):
                return fn(*a, **kw)

        return wrapped

    return _wrap_phases(PHASES, around)


def host_clock(step: Callable[[], Any], iters: int, fine: bool = False) -> dict[str, float]:
    """Unprofiled host time of each phase (inclusive, ``time.perf_counter`` around the same methods
    ``annotate`` marks, and the step's closing stream wait), medians over ``iters`` steps, in us.
    ``fine``: the ``FINE`` methods too (and ``calls.NAME``: how often each ran in a step)."""
    acc: dict[str, float] = {}

    def around(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
                if fine:
                    acc["calls." + name] = acc.get("calls." + name, 0.0) + 1e-6  # in us, a count

        return wrapped

    undo = _wrap_phases(
        {**PHASES, "stream.synchronize": (torch.cuda.Stream, "synchronize"), **(FINE if fine else {})}, around
    )
    rows: list[dict[str, float]] = []
    try:
        for i in range(iters + 3):
            acc.clear()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            if i >= 3:
                rows.append({"wall": time.perf_counter() - t0, **acc})
    finally:
        undo()
    keys = sorted({k for r in rows for k in r})
    return {k: round(statistics.median(r.get(k, 0.0) for r in rows) * 1e6, 1) for k in keys}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def analyse(trace: dict[str, Any], gap_us: float = 2.0) -> list[dict[str, Any]]:
    """Per ``step`` annotation of a chrome trace: wall, GPU busy, head and tail, gaps, host phases."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in ev
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    host = [e for e in ev if e.get("cat") in ("user_annotation", "cuda_runtime", "cuda_driver")]
    steps = sorted((e for e in host if e.get("name") == "step"), key=lambda e: e["ts"])
    res = []
    for s in steps:
        a, b = float(s["ts"]), float(s["ts"]) + float(s["dur"])
        busy = _union([(max(x, a), min(y, b)) for x, y in gpu if y > a and x < b])
        inside = [e for e in host if a <= float(e["ts"]) < b and e is not s]

        def phase_at(t: float, inside: list[dict[str, Any]] = inside) -> str:
            best = None
            for e in inside:
                if float(e["ts"]) <= t < float(e["ts"]) + float(e["dur"]) and e.get("cat") == "user_annotation":
                    if best is None or float(e["dur"]) < float(best["dur"]):
                        best = e
            return best["name"] if best is not None else "step"

        gaps = [
            {"at_us": round(x - a, 1), "us": round(y - x, 1), "phase": phase_at(x)}
            for (_, x), (y, _) in itertools.pairwise(busy)
            if y - x > gap_us
        ]
        phases: dict[str, float] = {}
        for e in inside:
            if e.get("cat") == "user_annotation" or e.get("name") in (
                "cudaGraphLaunch",
                "cudaStreamSynchronize",
                "cudaEventSynchronize",
                "cudaMemcpyAsync",
            ):
                phases[e["name"]] = phases.get(e["name"], 0.0) + float(e["dur"])
        by_phase: dict[str, float] = {}
        for g in gaps:
            by_phase[g["phase"]] = by_phase.get(g["phase"], 0.0) + g["us"]
        res.append(
            {
                "wall_us": b - a,
                "gpu_busy_us": sum(y - x for x, y in busy),
                "head_us": (busy[0][0] - a) if busy else b - a,  # step start to the GPU's first work
                "tail_us": (b - busy[-1][1]) if busy else 0.0,  # the GPU's last work to the step's end
                "gap_us": sum(g["us"] for g in gaps),
                "gaps_by_phase_us": {k: round(v, 1) for k, v in by_phase.items()},
                "largest_gaps": sorted(gaps, key=lambda g: -g["us"])[:8],
                "host_phase_us": {k: round(v, 1) for k, v in phases.items()},
                "gpu_activities": sum(1 for x, y in gpu if a <= x < b),
            }
        )
    return res


def _median_of(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows) if rows else float("nan")


def run_preset(name: str, batches: list[int], trace_dir: str, steps: int) -> dict[str, Any]:
    dev = torch.device("cuda")
    d = random_drafter(PRESETS[name], dev, 24 << 30, torch.bfloat16, attention="paged")
    d.prepare(max(batches), 4096)
    rng = np.random.default_rng(1)
    S = Sessions(d, rng, 0)
    pool_buf = bytearray(len(S.pool) * NEW_ROWS * S.W * 2)
    assert d.register_host(memoryview(pool_buf)), "could not register the taps' host memory"
    slab = np.frombuffer(pool_buf, dtype=np.uint16).reshape(len(S.pool), NEW_ROWS, S.W)
    slab[:] = np.stack(S.pool)
    S.pool = list(slab)
    keys = S.open(max(batches), CTX)
    out: dict[str, Any] = {}
    for n in batches:
        ks = keys[:n]
        S.rewind(ks, CTX)
        t = timed(lambda ks=ks: S.step(ks), 30)
        S.rewind(ks, CTX)
        clock = host_clock(lambda ks=ks: S.step(ks), 30)
        S.rewind(ks, CTX)
        fine = host_clock(lambda ks=ks: S.step(ks), 30, fine=True)
        S.rewind(ks, CTX)
        undo = annotate()
        try:
            from torch.profiler import ProfilerActivity, profile

            for _ in range(3):
                S.step(ks)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    with torch.profiler.record_function("step"):
                        S.step(ks)
                    torch.cuda.synchronize()
        finally:
            undo()
        path = os.path.join(trace_dir, f"timeline_{name}_B{n}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        with gzip.open(path + ".gz", "wt") as f:
            json.dump(trace, f)
        os.remove(path)
        rows = analyse(trace)
        summary = {k: _median_of(rows, k) for k in ("wall_us", "gpu_busy_us", "head_us", "tail_us", "gap_us")}
        out[str(n)] = {
            "timed_ms": t,
            "host_clock_us": clock,
            "host_clock_fine_us": fine,
            "profiled_median_us": summary,
            "steps": rows,
        }
        log(
            f"{name} B={n:3d} step {t['median_ms']:.3f} ms | profiled wall {summary['wall_us']:.0f} us, GPU busy "
            f"{summary['gpu_busy_us']:.0f}, head {summary['head_us']:.0f}, gaps {summary['gap_us']:.0f}, "
            f"tail {summary['tail_us']:.0f} | gaps by phase {rows[len(rows) // 2]['gaps_by_phase_us']}"
        )
        log(f"    host clock (unprofiled, us): {clock}")
        log(f"    finer (wrapped, us; calls.*: per step): {fine}")
    d.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/step_timeline.json")
    ap.add_argument("--presets", default="k3")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps per batch size")
    ap.add_argument("--trace-dir", default=None, help="where the gzipped chrome traces go (default: beside --out)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    trace_dir = args.trace_dir or os.path.dirname(os.path.abspath(args.out))
    os.makedirs(trace_dir, exist_ok=True)
    report: dict[str, Any] = {
        "command": "python3 -m draft_tools.bench.step_timeline " + " ".join(sys.argv[1:]),
        "machine": gpu_machine(dev),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for name in args.presets.split(","):
        report[name] = run_preset(name, [int(b) for b in args.batches.split(",")], trace_dir, args.steps)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
