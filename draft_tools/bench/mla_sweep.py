"""Sweep the MLA paged-attention kernel's launch shapes and split-K chunks on one GPU.

Times stage 1 + stage 2 (the plan prebuilt, as in a captured step) at Kimi-K3 DSpark dims
(H = 64, block rows 8, latent 512 + 64, pages of 16, bf16, causal) on the batches the draft
step meets: 1 x 1K, 8 x 1K, 64 x 1K and 1 x 32K + 63 x 1K, for every launch shape in the grid
below and the split-K chunks around the step's rule. Each timing is beside the batch's floor:
its cache bytes over the copy bandwidth, its FLOPs over the bf16 matmul rate, both measured here.

    python3 -m draft_tools.bench.mla_sweep --out bench/results/mla_sweep_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from typing import Any

import torch
import triton

from draft_server.models.kernels import paged_attention as pa

H, ROWS, LAT, ROPE, P = 64, 8, 512, 64, 16
CASES = {
    "1x1K": [1024],
    "2x1K": [1024] * 2,
    "4x1K": [1024] * 4,
    "8x1K": [1024] * 8,
    "64x1K": [1024] * 64,
    "32K+63x1K": [32768] + [1024] * 63,
}
SHAPES = [  # mla_sweep_h200.json swept (64 | 128) x (32 | 64) x (4 warps | 8) x 2 stages and split value dims;
    # mla_sweep_h200_v2.json these and the queries re-read every tile (no gain anywhere: gone)
    pa.KernelConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
    for bm, bn, w, st in [
        (64, 64, 8, 2),  # the step's MLA_CONFIG
        (32, 64, 4, 2),
        (32, 64, 8, 2),
        (64, 32, 8, 3),
        (32, 32, 4, 3),
        (16, 64, 4, 2),
        (32, 64, 4, 3),
    ]
]


def rule_chunk(tokens: int, items: int = 32) -> int:
    """The step's rule (``FastStep._chunk``): about ``items`` chunks, 64..2048."""
    return max(64, min(2048, 1 << max(0, (max(1, tokens // items) - 1).bit_length())))


def floors(dev: torch.device) -> dict[str, float]:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    fl = triton.testing.do_bench(lambda: a @ a, warmup=5, rep=50)
    return {"copy_bytes_per_s": 2 * x.numel() / (ms / 1e3), "bf16_flops_per_s": 2 * 8192**3 / (fl / 1e3)}


def batch(ctx: list[int], dev: torch.device) -> dict[str, Any]:
    n = len(ctx)
    pages = [-(-(c + ROWS) // P) for c in ctx]
    total = sum(pages)
    cache = torch.randn(total + 1, P, LAT + ROPE, dtype=torch.bfloat16, device=dev)
    perm = torch.randperm(total, device=dev).to(torch.int32)
    table = torch.zeros(n, max(pages), dtype=torch.int32, device=dev)
    o = 0
    for i, k in enumerate(pages):
        table[i, :k] = perm[o : o + k]
        o += k
    q = torch.randn(n, ROWS, H, LAT + ROPE, dtype=torch.bfloat16, device=dev)
    pos = torch.tensor(ctx, dtype=torch.int32, device=dev)
    zeros = torch.zeros(n, dtype=torch.int32, device=dev)
    tokens = sum(c + ROWS for c in ctx)
    return {
        "args": (q[..., :LAT], cache, table, zeros, zeros, pos),
        "q_rope": q[..., LAT:],
        "bytes": tokens * (LAT + ROPE) * 2,
        "flops": 2 * ROWS * H * tokens * (LAT + ROPE + LAT),
        "ctx": ctx,
    }


def time_one(b: dict[str, Any], cfg: pa.KernelConfig, chunk: int) -> tuple[float, torch.Tensor]:
    q, cache, table, first, lo, pos = b["args"]
    plan = pa.plan_work(lo, pos, rows=ROWS, chunk=chunk, page_size=P)
    ws = pa.Workspace.allocate(plan.capacity, ROWS * H, LAT, q.device)
    out = torch.empty(q.shape[0], ROWS, H, LAT, dtype=q.dtype, device=q.device)

    def run() -> None:
        pa.mla_paged_attention(
            q, cache, table, first, lo, pos, scale=0.07, causal=True, kv_lora=LAT,
            plan=plan, workspace=ws, out=out, config=cfg, q_rope=b["q_rope"],
        )  # fmt: skip

    run()  # compiled before the capture
    return float(triton.testing.do_bench_cudagraph(run, rep=30)), out  # as the step replays it: no launch cost


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/mla_sweep_h200.json")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping shapes after this long")
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    fl = floors(dev)
    report: dict[str, Any] = {
        "command": "python3 -m draft_tools.bench.mla_sweep " + " ".join(sys.argv[1:]),
        "machine": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "floors": fl,
        "cases": {},
    }
    batches = {k: batch(v, dev) for k, v in CASES.items()}
    floor = {
        k: max(b["bytes"] / fl["copy_bytes_per_s"], b["flops"] / fl["bf16_flops_per_s"]) * 1e3
        for k, b in batches.items()
    }
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in batches}
    first: dict[str, torch.Tensor] = {}  # each batch's output under the first shape measured

    def measure(name: str, cfg: pa.KernelConfig, chunk: int) -> None:
        try:
            ms, out = time_one(batches[name], cfg, chunk)
            ref = first.setdefault(name, out.float())
            diff = float((out.float() - ref).abs().max())  # another shape: its rounding, never more
            row = {"config": repr(cfg), "chunk": chunk, "ms": ms, "ratio_to_floor": ms / floor[name]}
            rows[name].append({**row, "max_abs_diff": diff})
        except Exception as e:  # shapes that do not fit shared memory or registers
            rows[name].append({"config": repr(cfg), "chunk": chunk, "error": f"{type(e).__name__}: {e}"[:200]})

    for name in batches:  # before: the previous step's one chunk of 2048 for every batch
        measure(name, pa.MLA_CONFIG, 2048)
    for cfg in SHAPES:  # every shape at the step's chunk
        if time.perf_counter() - t0 > args.budget_s:
            report["stopped_early"] = repr(cfg)
            break
        for name, b in batches.items():
            measure(name, cfg, rule_chunk(sum(b["ctx"])))
    for name, b in batches.items():  # the chunk, around the rule, for the two best shapes
        ranked = sorted((r for r in rows[name] if "ms" in r), key=lambda r: r["ms"])
        cfgs = [c for c in SHAPES if repr(c) in {r["config"] for r in ranked[:2]}]
        for cfg, items in itertools.product(cfgs, (8, 16, 64, 128)):
            measure(name, cfg, rule_chunk(sum(b["ctx"]), items))
    for name in batches:
        ok = sorted((r for r in rows[name] if "ms" in r), key=lambda r: r["ms"])
        cur = [r for r in ok if r["config"] == repr(pa.MLA_CONFIG) and r["chunk"] == rule_chunk(sum(CASES[name]))]
        before = rows[name][0]
        report["cases"][name] = {
            "floor_ms": floor[name],
            "before": before,
            "current": cur[:1],
            "best": ok[:5],
            "all": rows[name],
        }
        best = ok[0] if ok else {}
        nan = float("nan")
        cur_ms = cur[0]["ms"] if cur else nan
        print(
            f"{name:10s} floor {floor[name]:7.3f} ms  before {before.get('ms', nan):7.3f} ms  "
            f"current {cur_ms:7.3f} ms  best {best.get('ms', nan):7.3f} ms  {best.get('config')} "
            f"chunk {best.get('chunk')}"
        )
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
