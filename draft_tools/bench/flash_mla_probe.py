"""FlashMLA's SM90 decode kernel against our Triton MLA kernel, side by side at K3 dims (one H200).

Per batch (1 x 1K, 8 x 1K, 16 x 1K, 32 x 1K, 64 x 1K, 1 x 32K + 63 x 1K): the same logical latent
cache (random bf16, H = 64 heads, block rows 8, latent 512 + 64, causal) laid out in pages of 16 (the
step's cache today) and of 64 (FlashMLA's page), with the tail of every session's last page and every
unused page set to NaN. Timed as CUDA-graph replays (``do_bench_cudagraph``, as the step replays
them): our kernel (plan + stage 1 + combine) at P = 16 and P = 64 with the step's launch shape and
chunk rule, and FlashMLA (split schedule + kernel + combine). Each beside the batch's floor (cache
bytes over the measured copy rate, FLOPs over the measured bf16 matmul rate); outputs compared with
each other and with a float32 reference on two sessions. Writes JSON and prints a table::

    DRAFT_FLASHMLA_SRC=... python3 -m draft_tools.bench.flash_mla_probe --out $OUT/flash_mla_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
import triton

from draft_server.models.kernels import flash_mla as fm
from draft_server.models.kernels import paged_attention as pa
from draft_tools.bench.mla_sweep import floors, rule_chunk

H, ROWS, LAT, ROPE = 64, 8, 512, 64
D = LAT + ROPE
SCALE = 0.0625
CASES = {
    "1x1K": [1024],
    "8x1K": [1024] * 8,
    "16x1K": [1024] * 16,
    "32x1K": [1024] * 32,
    "64x1K": [1024] * 64,
    "32K+63x1K": [32768] + [1024] * 63,
}


def paged(kv: list[torch.Tensor], page: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The sessions' rows in shuffled pages of ``page`` tokens (NaN elsewhere); (cache, block table)."""
    pages = [-(-len(x) // page) for x in kv]
    total = sum(pages)
    cache = torch.full((total + 1, page, D), float("nan"), dtype=torch.bfloat16, device=dev)
    perm = torch.randperm(total, device=dev)
    table = torch.full((len(kv), max(pages)), total, dtype=torch.int32, device=dev)
    o = 0
    for i, (x, k) in enumerate(zip(kv, pages, strict=True)):
        ids = perm[o : o + k]
        o += k
        table[i, :k] = ids.to(torch.int32)
        padded = torch.full((k * page, D), float("nan"), dtype=torch.bfloat16, device=dev)
        padded[: len(x)] = x
        cache[ids] = padded.view(k, page, D)
    return cache, table


def reference(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """One session's causal block attention in float32: q [ROWS, H, D], kv [T, D] -> [ROWS, H, LAT]."""
    t = kv.shape[0]
    s = torch.einsum("bhd,td->bht", q.float(), kv.float()) * SCALE
    limit = t - ROWS + torch.arange(ROWS, device=q.device) + 1  # row b sees the first t - ROWS + b + 1 tokens
    s = s.masked_fill(torch.arange(t, device=q.device)[None, None, :] >= limit[:, None, None], float("-inf"))
    return torch.einsum("bht,td->bhd", torch.softmax(s, -1), kv[:, :LAT].float())


def case(ctx: list[int], mod: Any, fl: dict[str, float], dev: torch.device) -> dict[str, Any]:
    n = len(ctx)
    kv = [torch.randn(c + ROWS, D, dtype=torch.bfloat16, device=dev) for c in ctx]  # context + the block's rows
    q = torch.randn(n, ROWS, H, D, dtype=torch.bfloat16, device=dev)
    pos = torch.tensor(ctx, dtype=torch.int32, device=dev)
    zeros = torch.zeros(n, dtype=torch.int32, device=dev)
    tokens = sum(c + ROWS for c in ctx)
    flops = 2 * ROWS * H * tokens * (D + LAT)
    floor_ms = max(tokens * D * 2 / fl["copy_bytes_per_s"], flops / fl["bf16_flops_per_s"]) * 1e3
    row: dict[str, Any] = {"sessions": n, "tokens": tokens, "floor_ms": floor_ms}
    outs: dict[str, torch.Tensor] = {}
    for page in (16, 64):
        cache, table = paged(kv, page, dev)
        chunk = max(rule_chunk(sum(ctx)), page)
        plan = pa.plan_work(zeros, pos, rows=ROWS, chunk=chunk, page_size=page)
        ws = pa.Workspace.allocate(plan.capacity, ROWS * H, LAT, dev)
        out = torch.empty(n, ROWS, H, LAT, dtype=torch.bfloat16, device=dev)

        def run(cache=cache, table=table, plan=plan, ws=ws, out=out) -> None:
            pa.mla_paged_attention(
                q[..., :LAT], cache, table, zeros, zeros, pos, scale=SCALE, causal=True, kv_lora=LAT,
                plan=plan, workspace=ws, out=out, q_rope=q[..., LAT:],
            )  # fmt: skip

        run()
        row[f"triton_p{page}_ms"] = float(triton.testing.do_bench_cudagraph(run, rep=40))
        outs[f"triton_p{page}"] = out
        if page == 64 and mod is not None:
            seqlens = (pos + ROWS).contiguous()
            buf = fm.FlashMLABuffers.allocate(mod, n, ROWS, H, dev)
            fout = torch.empty(n, ROWS, H, LAT, dtype=torch.bfloat16, device=dev)
            k4 = cache.view(cache.shape[0], page, 1, D)

            def frun(k4=k4, table=table, seqlens=seqlens, buf=buf, fout=fout) -> None:
                fm.flash_mla_decode(mod, q, k4, seqlens, table, SCALE, True, fout, buf)

            frun()
            row["flashmla_ms"] = float(triton.testing.do_bench_cudagraph(frun, rep=40))
            outs["flashmla"] = fout
    torch.cuda.synchronize()
    for i in sorted({0, n - 1}):  # float32 reference, two sessions
        ref = reference(q[i], kv[i])
        for k, o in outs.items():
            row[f"{k}_vs_ref_s{i}"] = float((o[i].float() - ref).abs().max())
    for k, o in outs.items():
        row[f"{k}_nonfinite"] = int((~torch.isfinite(o)).sum())
        if k != "triton_p16":
            row[f"{k}_vs_triton_p16"] = float((o.float() - outs["triton_p16"].float()).abs().max())
    for k in ("triton_p16", "triton_p64", "flashmla"):
        if f"{k}_ms" in row:
            row[f"{k}_ratio_to_floor"] = row[f"{k}_ms"] / floor_ms
            row[f"{k}_tflops"] = 2 * ROWS * H * tokens * (D + LAT) / (row[f"{k}_ms"] / 1e3) / 1e12
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/flash_mla_probe_h200.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    mod = fm.load()
    build_s = time.perf_counter() - t0
    print(f"FlashMLA: {'built/loaded' if mod is not None else fm.why_not()} in {build_s:.1f} s", flush=True)
    fl = floors(dev)
    report: dict[str, Any] = {
        "command": "python3 -m draft_tools.bench.flash_mla_probe " + " ".join(sys.argv[1:]),
        "machine": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "flashmla": {"loaded": mod is not None, "why_not": fm.why_not(), "build_or_load_s": build_s},
        "floors": fl,
        "cases": {},
    }
    torch.manual_seed(0)
    print(f"{'batch':10s} {'floor':>7s} {'tri16':>7s} {'tri64':>7s} {'flash':>7s}  (ms)  flash/tri16  max|flash-ref|")
    for name, ctx in CASES.items():
        r = case(ctx, mod, fl, dev)
        report["cases"][name] = r
        nan = float("nan")
        fms = r.get("flashmla_ms", nan)
        print(
            f"{name:10s} {r['floor_ms']:7.3f} {r['triton_p16_ms']:7.3f} {r['triton_p64_ms']:7.3f} {fms:7.3f}"
            f"  {fms / r['triton_p16_ms']:.2f}  {r.get('flashmla_vs_ref_s0', nan):.4f}",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
