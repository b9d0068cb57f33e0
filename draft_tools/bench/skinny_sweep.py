"""The draft step's weight GEMMs at decode row counts: cuBLAS against the skinny Triton GEMM (issue 10).

For every dense GEMM shape a K3 / Qwen3-8B step meets at 1-8 sessions (7-56 block rows; the
ingest GEMMs at their 16-64-row buckets), times as CUDA-graph replays, each replay running the
GEMM over enough copies of the weight that the L2 cannot hold them (as in the step, where every
weight comes from HBM):

- ``plain``: ``torch.mm`` / ``addmm`` as called (cuBLAS's pick);
- ``pad``: rows padded to 128 (``models/gemm.py``'s other strategy at these sizes);
- ``trans``: the transposed product (w @ x.T, then a copy back), which makes cuBLAS choose
  among its wide-M kernels;
- ``skinny``: ``kernels/skinny.py`` over a grid of launch shapes (column tile, k block, k split).

Each shape's weight bytes over the time give its bandwidth, beside a device copy measured in the
same run. Prints one line per shape and writes JSON.

    python3 -m draft_tools.bench.skinny_sweep --out bench/results/skinny_sweep_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch

from draft_server.models.kernels.skinny import SkinnyConfig, SkinnyGemm

# (name, out, in, residual, rows)
BLOCK_ROWS = (7, 14, 28, 56)
INGEST_ROWS = (16, 32, 64)
SHAPES = {
    "k3": [
        ("qkv_a", 2112, 7168, False, BLOCK_ROWS),
        ("q_b", 12288, 1536, False, BLOCK_ROWS),
        ("o_proj", 7168, 8192, True, BLOCK_ROWS),
        ("gate_up", 28672, 7168, False, BLOCK_ROWS),
        ("down", 7168, 14336, True, BLOCK_ROWS),
        ("lm_head", 163840, 7168, False, BLOCK_ROWS),
        ("context_proj", 7168, 35840, False, INGEST_ROWS),
        ("context_kv", 2880, 7168, False, INGEST_ROWS),
    ],
    "qwen3-8b": [
        ("qkv", 6144, 4096, False, BLOCK_ROWS),
        ("o_proj", 4096, 4096, True, BLOCK_ROWS),
        ("gate_up", 24576, 4096, False, BLOCK_ROWS),
        ("down", 4096, 12288, True, BLOCK_ROWS),
        ("lm_head", 151936, 4096, False, BLOCK_ROWS),
        ("fc", 4096, 20480, False, INGEST_ROWS),
        ("context_kv", 10240, 4096, False, INGEST_ROWS),
    ],
}
CONFIGS = [
    SkinnyConfig(block_n=bn, block_k=bk, split=s, warps=w, stages=st)
    for bn, bk, s, w, st in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8), (4,), (4,))
]
L2_DEFEAT_BYTES = 256 << 20


def graph_ms(fn, copies: int, reps: int = 10) -> float:
    """Median ms per GEMM of a CUDA graph running ``fn(i)`` for each of ``copies`` weights."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        runs.append(a.elapsed_time(b) / (reps * copies))
    del g
    return statistics.median(runs)


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - t)


def sweep_shape(out: int, inp: int, res: bool, rows: int, budget_configs: list[SkinnyConfig]) -> dict[str, Any]:
    dt = torch.bfloat16
    wbytes = out * inp * 2
    copies = max(1, -(-L2_DEFEAT_BYTES // wbytes))
    ws = [torch.randn(out, inp, dtype=dt, device="cuda") / inp**0.5 for _ in range(copies)]
    x = torch.randn(rows, inp, dtype=dt, device="cuda")
    h = torch.randn(rows, out, dtype=dt, device="cuda") if res else None
    ref = (x.float() @ ws[0].float().t() + (h.float() if h is not None else 0)).to(dt)
    t: dict[str, float] = {}
    if h is None:
        t["plain"] = graph_ms(lambda i: torch.mm(x, ws[i].t()), copies)
        xp = torch.nn.functional.pad(x, (0, 0, 0, -rows % 128))
        t["pad"] = graph_ms(lambda i: torch.mm(xp, ws[i].t())[:rows], copies)
        t["trans"] = graph_ms(lambda i: torch.mm(ws[i], x.t()).t().contiguous(), copies)
    else:
        t["plain"] = graph_ms(lambda i: torch.addmm(h, x, ws[i].t()), copies)
        xp = torch.nn.functional.pad(x, (0, 0, 0, -rows % 128))
        hp = torch.nn.functional.pad(h, (0, 0, 0, -rows % 128))
        t["pad"] = graph_ms(lambda i: torch.addmm(hp, xp, ws[i].t())[:rows], copies)
        ht = h.t().contiguous()
        t["trans"] = graph_ms(lambda i: torch.addmm(ht, ws[i], x.t()).t().contiguous(), copies)
    skinny: dict[str, float] = {}
    worst_err = 0.0
    for cfg in budget_configs:
        if not SkinnyGemm.fits(rows, inp, cfg):
            continue
        key = f"{cfg.block_n}x{cfg.block_k}/s{cfg.split}"
        try:
            g = SkinnyGemm(rows, out, inp, cfg, x.device)
            y = g(x, ws[0], h)
        except Exception as e:  # a launch shape this GPU cannot build (shared memory, registers)
            print(f"  {key}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        err = (y.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
        worst_err = max(worst_err, err)
        if err > 2e-2:
            skinny[key] = float("nan")
            continue
        skinny[key] = graph_ms(lambda i, g=g: g(x, ws[i], h), copies)
    best = min((k for k in skinny if skinny[k] == skinny[k]), key=lambda k: skinny[k])
    t["skinny"] = skinny[best]
    return {
        "weight_bytes": wbytes,
        "ms": t,
        "skinny_best": best,
        "skinny_all": skinny,
        "skinny_rel_err": worst_err,
        "gbps": {k: wbytes / (v * 1e-3) / 1e9 for k, v in t.items()},
        "skinny_over_plain": t["skinny"] / t["plain"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/skinny_sweep_h200.json")
    ap.add_argument("--presets", default="k3,qwen3-8b")
    ap.add_argument("--rows", default="", help="block rows to sweep instead of 7,14,28,56 (112: 16 sessions)")
    ap.add_argument("--shapes", default="", help="only these GEMMs (names, e.g. o_proj,down); default all")
    args = ap.parse_args()
    block_rows = tuple(int(r) for r in args.rows.split(",")) if args.rows else BLOCK_ROWS
    only = set(args.shapes.split(",")) if args.shapes else None
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    res: dict[str, Any] = {
        "command": "python3 -m draft_tools.bench.skinny_sweep " + " ".join(sys.argv[1:]),
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "copy_bytes_per_s": bw,
        "shapes": {},
    }
    for preset in args.presets.split(","):
        for name, out, inp, r, rows_list in SHAPES[preset]:
            if only is not None and name not in only:
                continue
            for rows in block_rows if rows_list is BLOCK_ROWS else rows_list:
                t0 = time.perf_counter()
                d = sweep_shape(out, inp, r, rows, CONFIGS)
                res["shapes"][f"{preset}/{name}/{rows}"] = d
                ms = d["ms"]
                print(
                    f"{preset:9s} {name:13s} rows {rows:3d}  plain {ms['plain']:.4f}  pad {ms['pad']:.4f}  "
                    f"trans {ms['trans']:.4f}  skinny {ms['skinny']:.4f} ({d['skinny_best']})  "
                    f"x{d['skinny_over_plain']:.2f}  {d['gbps']['plain']:.0f}/{d['gbps']['skinny']:.0f} GB/s"
                    f"  [{time.perf_counter() - t0:.1f} s]",
                    flush=True,
                )
                torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
