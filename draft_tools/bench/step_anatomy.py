"""Where a draft step's GPU time goes, and what each piece could cost: a measurement aid for issue 10.

One run, on one GPU, prints short tables and writes one JSON:

1. floors: device-to-device copy bandwidth and the bf16 matmul rate, measured here;
2. gemms: every weight GEMM of the step (full-size ``random:k3`` and ``random:qwen3-8b`` weights)
   at the row counts a step meets (block rows B*7 and ingest rows), through ``F.linear`` as the
   model calls it, beside alternatives computing the same product: rows padded to a tile multiple,
   the transposed product (``W @ x.T``) and a plain Triton matmul; each with its floor;
3. anatomy: the step's kernels (eager run of the fast path's own kernels) grouped by op and input
   shape, at B = 1, 8, 64, so every millisecond has a name; plus the captured graph's GPU time and
   the whole step's wall time;
4. mla: MLA paged-attention launch shapes not swept before (16 warps, 1/3/4 pipeline stages).

    python3 -m draft_tools.bench.step_anatomy --out $OUT/step_anatomy.json [--parts gemms,anatomy,mla]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from draft_server.models.kernels import paged_attention as pa
from draft_server.models.presets import PRESETS, random_drafter
from draft_tools.bench import mla_sweep
from draft_tools.bench.draft_step_gpu import CTX, Sessions, measure_floors


def log(*a: object) -> None:
    print(*a, flush=True)


# ------------------------------------------------------------------------------------ Triton GEMM


@triton.jit
def _mm_kernel(X, W, Y, M, N, K, sxm, swn, sym, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               GROUP: tl.constexpr):  # fmt: skip
    """y[M, N] = x[M, K] @ w[N, K]^T (bf16 in, fp32 accumulate), grouped tile order for L2 reuse."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP * num_n
    g = pid // per_group
    first_m = g * GROUP
    gm = tl.minimum(num_m - first_m, GROUP)
    pm = first_m + (pid % per_group) % gm
    pn = (pid % per_group) // gm
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(X + rm[:, None] * sxm + (k0 + rk)[None, :], mask=(rm[:, None] < M) & ((k0 + rk)[None, :] < K))
        b = tl.load(W + rn[:, None] * swn + (k0 + rk)[None, :], mask=(rn[:, None] < N) & ((k0 + rk)[None, :] < K))
        acc = tl.dot(a, tl.trans(b), acc)
    tl.store(
        Y + rm[:, None] * sym + rn[None, :], acc.to(Y.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N)
    )


TRITON_MM = [(64, 256, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (16, 128, 128, 4, 4)]


def triton_linear(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, ...], y: torch.Tensor) -> torch.Tensor:
    bm, bn, bk, warps, stages = cfg
    M, K = x.shape
    N = w.shape[0]
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _mm_kernel[grid](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), BM=bm, BN=bn, BK=bk, GROUP=8,
                     num_warps=warps, num_stages=stages)  # fmt: skip
    return y


def bench_ms(fn: Any) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def gemm_part(name: str, floors: dict[str, float], dev: torch.device) -> list[dict[str, Any]]:
    d = random_drafter(PRESETS[name], dev, 1 << 30, torch.bfloat16, attention="paged")
    m = d.model
    B = d.cfg.block_size
    sites: dict[str, torch.Tensor] = {"lm_head": m.lm_head, "context_proj": m.ctx_proj}
    for i in (0,):
        for key, t in m.w.items():
            if key.startswith(f"layers.{i}.") and t.dim() == 2 and t.shape[0] > 256:
                sites[key.split(".", 2)[2]] = t
    if m.markov_w2 is not None:
        sites["markov_w2"] = m.markov_w2
    if m.layout.mla:
        sites["context_kv_proj"] = m.kv_a_all
    rows_out: list[dict[str, Any]] = []
    for site, w in sites.items():
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            continue
        if site in ("context_proj", "context_kv_proj"):
            Ms = [3, 48, 192]
        elif site == "markov_w2":
            Ms = [1, 8, 64]
        else:
            Ms = [B * n for n in (1, 4, 16, 32, 64)]
        for M in Ms:
            N, K = w.shape
            x = torch.randn(M, K, dtype=w.dtype, device=dev)
            flops, by = 2 * M * N * K, (M * K + N * K + M * N) * 2
            floor = max(flops / floors["bf16_flops_per_s"], by / floors["copy_bytes_per_s"]) * 1e3
            r: dict[str, Any] = {"preset": name, "site": site, "M": M, "N": N, "K": K, "floor_ms": floor}
            r["linear_ms"] = bench_ms(lambda x=x, w=w: F.linear(x, w))
            pad = -(-M // 128) * 128
            if pad != M:
                xp = torch.randn(pad, K, dtype=w.dtype, device=dev)
                r["padded128_ms"] = bench_ms(lambda xp=xp, w=w: F.linear(xp, w))
            r["transposed_ms"] = bench_ms(lambda x=x, w=w: torch.mm(w, x.t()))
            y = torch.empty(M, N, dtype=w.dtype, device=dev)
            best = None
            for cfg in TRITON_MM:
                try:
                    ms = bench_ms(lambda x=x, w=w, cfg=cfg, y=y: triton_linear(x, w, cfg, y))
                except Exception as e:  # a shape that does not fit
                    r.setdefault("triton_errors", []).append(f"{cfg}: {type(e).__name__}")
                    continue
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            if best is not None:
                ref = F.linear(x, w).float()
                triton_linear(x, w, best[1], y)
                r["triton_ms"], r["triton_cfg"] = best[0], list(best[1])
                r["triton_rel_err"] = float((y.float() - ref).norm() / ref.norm())
            cands = {k: v for k, v in r.items() if k.endswith("_ms") and k != "floor_ms"}
            r["best"] = min(cands, key=cands.get)
            rows_out.append(r)
            log(
                f"{name:8s} {site:28s} M={M:4d} N={N:6d} K={K:6d} floor {floor:7.4f}  linear {r['linear_ms']:7.4f} "
                f"({r['linear_ms'] / floor:4.2f}x)  pad {r.get('padded128_ms', float('nan')):7.4f}  "
                f"T {r['transposed_ms']:7.4f}  triton {r.get('triton_ms', float('nan')):7.4f}"
            )
    d.close()
    torch.cuda.empty_cache()
    return rows_out


# ------------------------------------------------------------------------------------ anatomy


def anatomy_part(name: str, dev: torch.device, sizes: list[int]) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    d = random_drafter(PRESETS[name], dev, 24 << 30, torch.bfloat16, attention="paged")
    d.prepare(64, 4096)
    fast = d.fast
    assert fast is not None
    rng = np.random.default_rng(1)
    S = Sessions(d, rng, 0)
    # taps in registered host memory, as the server's receive arena and shm rings hold them (before
    # 2026-12-08 the rows were staged from ordinary memory: ``torch.cat`` on the intra-op threads)
    registered = S.register(d)
    keys = S.open(max(sizes), CTX)
    host_ingest: list[float] = []  # ms of host time in each step's ingest call (it returns before its GPU work)
    ingest = fast.ingest

    def timed_ingest(*a: Any, **k: Any) -> None:
        t = time.perf_counter()
        ingest(*a, **k)
        host_ingest.append((time.perf_counter() - t) * 1e3)

    fast.ingest = timed_ingest  # type: ignore[method-assign]
    res: dict[str, Any] = {}
    for n in sizes:
        ks = keys[:n]
        S.rewind(ks, CTX)
        for _ in range(5):
            S.step(ks)
        torch.cuda.synchronize()
        # wall time of the whole step, and its host parts
        walls, ing = [], []
        for _ in range(20):
            S.rewind(ks, CTX)
            t0 = time.perf_counter()
            S.step(ks)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
            ing.append(host_ingest[-1])
        # the draft graph alone on the GPU (inputs staged by the last step)
        g = fast._draft_graphs.get(n)
        graph_ms = None
        if g is not None and g.graph is not None:
            graph_ms = bench_ms(g.graph.replay)
        # kernels by op and shape: an eager run of the same body (graphs set aside)
        saved, fast._draft_graphs = fast._draft_graphs, {}
        try:
            S.rewind(ks, CTX)
            S.step(ks)
            torch.cuda.synchronize()
            S.rewind(ks, CTX)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                S.step(ks)
                torch.cuda.synchronize()
        finally:
            fast._draft_graphs = saved
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_total = sum(e.device_time_total for e in kernels) / 1e3
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name[:80], []).append(e.device_time_total / 1e3)
        top_kernels = sorted(((k, sum(v), len(v)) for k, v in by_name.items()), key=lambda t: -t[1])[:25]
        ops = prof.key_averages(group_by_input_shape=True)
        op_rows = []
        for ev in ops:
            cuda_ms = ev.self_device_time_total / 1e3
            if cuda_ms <= 0:
                continue
            op_rows.append({"op": ev.key, "shapes": str(ev.input_shapes)[:160], "count": ev.count, "gpu_ms": cuda_ms})
        op_rows.sort(key=lambda r: -r["gpu_ms"])
        res[str(n)] = {
            "taps_in": "registered host memory" if registered else "ordinary host memory (staged copy)",
            "wall_ms": statistics.median(walls),
            "host_ingest_ms": statistics.median(ing),
            "graph_gpu_ms": graph_ms,
            "eager_kernels": len(kernels),
            "eager_gpu_ms": gpu_total,
            "top_kernels": [{"name": k, "ms": v, "count": c} for k, v, c in top_kernels],
            "ops": op_rows[:40],
        }
        log(f"\n{name} B={n}: wall {statistics.median(walls):.3f} ms, host ingest {statistics.median(ing):.3f} ms, "
            f"draft graph GPU {graph_ms} ms, eager kernels {len(kernels)} busy {gpu_total:.3f} ms")  # fmt: skip
        for r in op_rows[:22]:
            log(f"   {r['gpu_ms']:7.3f} ms  x{r['count']:3d}  {r['op'][:34]:34s} {r['shapes'][:110]}")
    S.close(keys)
    if S.registered is not None:
        d.unregister_host(memoryview(S.registered))
    d.close()
    torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------------ MLA shapes

MLA_SHAPES = [
    pa.KernelConfig(block_m=64, block_n=64, num_warps=8, num_stages=2),  # today's
    pa.KernelConfig(block_m=64, block_n=64, num_warps=16, num_stages=2),
    pa.KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=3),
    pa.KernelConfig(block_m=64, block_n=64, num_warps=8, num_stages=1),
]


def mla_time(b: dict[str, Any], cfg: pa.KernelConfig, chunk: int) -> tuple[float, torch.Tensor]:
    """One layer's MLA (both stages, plan prebuilt) replayed from a CUDA graph, as the step runs it."""
    q, cache, table, first, lo, pos = b["args"]
    rows = q.shape[1]
    plan = pa.plan_work(lo, pos, rows=rows, chunk=chunk, page_size=mla_sweep.P)
    ws = pa.Workspace.allocate(plan.capacity, rows * mla_sweep.H, mla_sweep.LAT, q.device)
    out = torch.empty(q.shape[0], rows, mla_sweep.H, mla_sweep.LAT, dtype=q.dtype, device=q.device)
    width = torch.full((q.shape[0],), rows, dtype=torch.int32, device=q.device)

    def run() -> None:
        pa.mla_paged_attention(
            q, cache, table, first, lo, pos, scale=0.07, causal=False, kv_lora=mla_sweep.LAT,
            plan=plan, workspace=ws, out=out, config=cfg, q_rope=b["q_rope"], width=width,
        )  # fmt: skip

    ms = float(triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median"))
    return ms, out.clone()


def mla_part(floors: dict[str, float], dev: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mla_sweep.ROWS = 7  # the step's block (the sweep used 8)
    for case in ("1x1K", "8x1K", "64x1K", "32K+63x1K"):
        b = mla_sweep.batch(mla_sweep.CASES[case], dev)
        floor = max(b["bytes"] / floors["copy_bytes_per_s"], b["flops"] / floors["bf16_flops_per_s"]) * 1e3
        chunk = mla_sweep.rule_chunk(sum(b["ctx"]), 40)
        rows = []
        ref = None
        for cfg in MLA_SHAPES:
            try:
                ms, o = mla_time(b, cfg, chunk)
                if ref is None:
                    ref = o.float()
                err = float((o.float() - ref).norm() / ref.norm())
                rows.append(
                    {"config": repr(cfg), "ms": ms, "tflops": b["flops"] / ms / 1e9, "rel_err_vs_one_pass": err}
                )
            except Exception as e:
                rows.append({"config": repr(cfg), "error": f"{type(e).__name__}: {e}"[:160]})
        out[case] = {"floor_ms": floor, "chunk": chunk, "rows": rows}
        log(f"\nMLA {case}: floor {floor:.4f} ms, chunk {chunk}")
        for r in rows:
            ms, tf = r.get("ms", float("nan")), r.get("tflops", 0)
            cfg_s = r["config"][12:].replace("combine_block_p=8, combine_num_warps=4, ", "")
            err = r.get("rel_err_vs_one_pass", -1.0)
            log(f"   {ms:8.4f} ms {tf:6.1f} TF/s err {err:.1e}  {cfg_s} {r.get('error', '')}")
        del b
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="gemms,anatomy,mla")
    ap.add_argument("--presets", default="k3,qwen3-8b")
    ap.add_argument("--sizes", default="1,8,64")
    args = ap.parse_args()
    dev = torch.device("cuda")
    parts = set(args.parts.split(","))
    report: dict[str, Any] = {
        "command": "python3 -m draft_tools.bench.step_anatomy " + " ".join(sys.argv[1:]),
        "machine": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    floors = measure_floors(dev)
    report["floors"] = floors
    bw, fl = floors["copy_bytes_per_s"] / 1e12, floors["bf16_flops_per_s"] / 1e12
    log(f"floors: copy {bw:.2f} TB/s, bf16 {fl:.0f} TFLOP/s")

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    for part, fn in (
        ("mla", lambda: mla_part(floors, dev)),
        ("gemms", lambda: {p: gemm_part(p, floors, dev) for p in args.presets.split(",")}),
        (
            "anatomy",
            lambda: {p: anatomy_part(p, dev, [int(s) for s in args.sizes.split(",")]) for p in args.presets.split(",")},
        ),
    ):
        if part not in parts:
            continue
        t0 = time.perf_counter()
        try:
            report[part] = fn()
        except Exception:
            report[part + "_error"] = traceback.format_exc()
            log(report[part + "_error"])
        report[part + "_s"] = time.perf_counter() - t0
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
