"""CUDA check and timing of the DSpark drafter (eager PyTorch, no CUDA graphs yet).

1. Numerics on the GPU: the tiny checkpoints in float32 on CUDA against the float64 CPU
   reference (same scenario as tests/numerics/test_dspark_numerics.py), and bf16 on CUDA against the
   float64 CPU drafter (greedy token agreement: bf16 cannot be token-exact).
2. Draft-step latency at real sizes with random weights: Kimi-K3 DSpark (5 MLA layers, hidden
   7168, vocab 163840) and a Qwen3-8B-sized DSpark (5 GQA layers, hidden 4096, vocab 151936),
   bf16, 1/4/16 sessions with 1024 context rows each; one step = ingest 3 rows per session +
   draft k = block_size, timed with CUDA synchronisation.

Writes JSON (machine, command, numbers) to --out.
    python3 -m draft_tools.bench.draft_step_cuda --out bench/results/draft_step_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from draft_server.drafters.base import DraftItem, IngestItem
from draft_server.models import DSparkDrafter, load_drafter
from draft_server.models.presets import K3_FULL, QWEN3_8B, random_drafter
from draft_server.models.tiny import make_tiny
from protocol import GREEDY, Sampling


def taps(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    x = torch.from_numpy(rng.standard_normal((rows, width)).astype(np.float32))
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def time_steps(d: DSparkDrafter, sessions: int, ctx: int, steps: int, warmup: int = 5) -> dict:
    c = d.contract
    rng = np.random.default_rng(0)
    ends = {}
    chunk = taps(rng, min(512, ctx), c.tap_width)  # every session's context from one random chunk: the
    for s in range(sessions):  # step's cost does not depend on the values, making them dominated the run
        assert d.reserve(s, 0, ctx + 3 * (steps + warmup) + 16)
        for a in range(0, ctx, 512):
            d.ingest([IngestItem(s, 0, a, chunk[: min(512, ctx - a)])])
        ends[s] = ctx
    new = [taps(rng, 3, c.tap_width) for _ in range(sessions)]
    ing_ms, dr_ms, st_ms = [], [], []
    for i in range(warmup + steps):
        items = [IngestItem(s, 0, ends[s], new[s]) for s in range(sessions)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        d.ingest(items)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for s in range(sessions):
            ends[s] += 3
        d.draft([DraftItem(s, 0, ends[s], 11, c.block_size, GREEDY) for s in range(sessions)])
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= warmup:
            ing_ms.append((t1 - t0) * 1e3)
            dr_ms.append((t2 - t1) * 1e3)
            st_ms.append((t2 - t0) * 1e3)
    for s in range(sessions):
        d.release(s)
    med = statistics.median
    return {
        "sessions": sessions,
        "context_rows": ctx,
        "k": c.block_size,
        "ingest_ms_median": round(med(ing_ms), 3),
        "draft_ms_median": round(med(dr_ms), 3),
        "step_ms_median": round(med(st_ms), 3),
        "step_ms_p90": round(sorted(st_ms)[int(0.9 * (len(st_ms) - 1))], 3),
    }


def numerics(dev: torch.device) -> list[dict]:
    from tests.numerics.dspark_reference import Reference
    from tests.numerics.test_dspark_numerics import run_scenario

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("k3", "qwen3"):
            p = make_tiny(variant, os.path.join(tmp, variant), seed=3)
            ref = Reference(p.draft, p.target)
            d32 = load_drafter(p.draft, p.target, str(dev), "float32", 8 << 20)
            n = run_scenario(d32, ref, seed=2, rel_tol=1e-4, steps=3)  # asserts token-exact, 1e-4 logits
            out.append({"variant": variant, "check": "cuda float32 vs float64 reference", "drafts_compared": n})
            cpu = load_drafter(p.draft, p.target, "cpu", "float64", 8 << 20)
            bf = load_drafter(p.draft, p.target, str(dev), "bf16", 8 << 20)
            rng = np.random.default_rng(5)
            same_first = same_all = total = 0
            for s in range(64):
                rows = 1 + (7 * s) % 50
                t = taps(rng, rows, cpu.contract.tap_width)
                for d in (cpu, bf):
                    assert d.reserve(s, 0, rows)
                    d.ingest([IngestItem(s, 0, 0, t)])
                it = [DraftItem(s, 0, rows, (31 * s) % 300, cpu.contract.block_size, GREEDY)]
                a, b = cpu.draft(it)[0].tokens, bf.draft(it)[0].tokens
                same_first += a[0] == b[0]
                same_all += a == b
                total += 1
            c64 = load_drafter(p.draft, p.target, str(dev), "float64", 8 << 20)
            same = 0
            for s in range(32):
                rows = 2 + (5 * s) % 40
                t = taps(rng, rows, cpu.contract.tap_width)
                for d in (cpu, c64):
                    assert d.reserve(100 + s, 0, rows)
                    d.ingest([IngestItem(100 + s, 0, 0, t)])
                samp = Sampling(temperature=0.9, top_k=40 * (s % 3), top_p=1.0 - 0.1 * (s % 4), seed=s)
                it = [DraftItem(100 + s, 0, rows, (7 * s) % 300, cpu.contract.block_size, samp)]
                same += cpu.draft(it)[0].tokens == c64.draft(it)[0].tokens
            out.append({"variant": variant, "check": "sampled, cuda float64 vs cpu float64", "identical": same / 32})
            out.append(
                {
                    "variant": variant,
                    "check": "cuda bf16 vs cpu float64 drafter, greedy",
                    "sessions": total,
                    "first_token_agreement": same_first / total,
                    "whole_block_agreement": same_all / total,
                }
            )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="draft_step_cuda.json")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ctx", type=int, default=1024)
    args = ap.parse_args()
    dev = torch.device("cuda")
    report: dict = {
        "what": __doc__.split("\n")[0],
        "command": " ".join(["python3", *sys.argv]),
        "machine": {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
    }
    report["numerics"] = numerics(dev)
    print(json.dumps(report["numerics"], indent=1), flush=True)
    report["latency"] = []
    for name, cfg in (("k3-dspark-full", K3_FULL), ("qwen3-8b-dspark", QWEN3_8B)):
        d = random_drafter(cfg, dev, kv_bytes=8 << 30)
        params = sum(t.numel() for t in d.model.w.values())
        for n in (1, 4, 16):
            r = {"model": name, "params_incl_embed_and_head": params, **time_steps(d, n, args.ctx, args.steps)}
            report["latency"].append(r)
            print(json.dumps(r), flush=True)
        del d
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
