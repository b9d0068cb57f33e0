"""The EXL3 decode-GEMM on one GPU: our Triton kernel's launch shapes against exllamav3 and BF16.

Owns one measurement (issue 13's large-batch path): for Kimi-K3's drafter linears at 4 bits, per
row count, the time of

- ``bf16``: ``torch.mm`` of BF16 weights (what the EXL3 drafter must come close to);
- ``fused``: exllamav3's ``exl3_gemm`` (Hadamards inside);
- ``recon``: exllamav3's ``reconstruct`` into a scratch, then a cuBLAS fp16 GEMM, Hadamards around;
- ``inline``: ``kernels.exl3_gemm.exl3_matmul`` with its default launch shape, Hadamards around;
- ``kernel/<config>``: the bare Triton kernel at every launch shape of the sweep, each checked
  against ``A @ decode_inner(trellis)`` before it is timed;
- ``decode`` / ``decode_mm``: ``exl3_decode`` of Wq.T into a scratch alone / followed by the fp16
  ``F.linear`` on it (``mm_fp16``: that GEMM alone), the packed-only large-batch alternative;
- ``had_in`` / ``had_out``: our ``hadamard_128`` on the fp16 input / fp32 output; ``inline_ours`` /
  ``decode_ours``: the backend's ``inline`` / ``decode`` paths whole (both rotations included);

beside the floor (trellis + activation bytes over the copy bandwidth measured in the same run).
Random trellises decode to valid weights, so no quantizer runs. Prints a table; JSON to ``--out``.

    bash draft_tools/exl3_gpu.sh kernel        # device tool: carry .whl and .exl3_prebuilt
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from draft_server.models import gemm
from draft_server.models.exl3.cuda import Exl3Backend, load_ext
from draft_server.models.exl3.decode import decode_inner
from draft_server.models.exl3.linear import Exl3Linear, pad128
from draft_server.models.kernels.exl3_gemm import KernelConfig, exl3_decode, exl3_matmul, hadamard_128

# Kimi-K3 drafter linears (in x out): q_a, kv_a, q_b, o, gate_up, down, context projection
SHAPES = ((7168, 1536), (7168, 576), (1536, 12288), (8192, 7168), (7168, 14336), (14336, 7168))
ROWS = (7, 448, 56, 112, 14)


def bench(fn: Callable[[], object]) -> float:
    """Median ms of ``fn`` as replays of its CUDA graph (as the step runs it: no Python launch in the
    time, which made small Triton calls read 6-7 us whatever their size), L2 flushed before each."""
    return gemm.graph_ms(fn, flush_l2=True, runs=11)


def floors(dev: torch.device) -> dict[str, float]:
    x = torch.empty(1 << 28, dtype=torch.float32, device=dev)  # 1 GiB
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    mm = bench(lambda: a @ a)
    return {"copy_gb_s": 2 * x.numel() * 4 / ms / 1e6, "bf16_tflops": 2 * 8192**3 / mm / 1e9}


def configs() -> list[KernelConfig]:
    grid = itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (1, 2), (2, 8))
    return [KernelConfig(bn, bk, w, s, p) for bn, bk, w, s, p in grid]


def measure(
    be: Exl3Backend | None,
    i: int,
    o: int,
    rows: int,
    args: argparse.Namespace,
    fl: dict[str, float],
    g: torch.Generator,
    sweep: list[KernelConfig],
    t0: float,
) -> dict[str, Any]:
    """One linear (in i x out o, random trellis and signs) at ``rows`` rows: every path, then the sweep's
    launch shapes until the deadline."""
    dev = torch.device("cuda")
    ours = Exl3Backend(fused_max_rows=0, large="inline")  # our kernels only: needs no exllamav3
    k, n = pad128(i), pad128(o)
    trellis = torch.randint(-(1 << 15), 1 << 15, (k // 16, n // 16, 16 * args.bits), dtype=torch.int16,
                            device=dev, generator=g)  # fmt: skip
    signs = [torch.where(torch.rand(d, device=dev, generator=g) < 0.5, -1.0, 1.0).half() for d in (k, n)]
    lin = Exl3Linear("w", i, o, trellis, signs[0], signs[1], args.codebook)
    wq = decode_inner(trellis, args.codebook)
    x = torch.randn(rows, i, dtype=torch.bfloat16, device=dev, generator=g)
    a = torch.randn(rows, k, dtype=torch.float16, device=dev, generator=g)
    want = a.float() @ wq.float()
    tol = 1e-4 * want.abs().max().item()
    wb = torch.randn(i, o, dtype=torch.bfloat16, device=dev, generator=g)

    def kernel(cfg: KernelConfig | None = None) -> torch.Tensor:
        return exl3_matmul(a, trellis, args.codebook, config=cfg)

    scratch = torch.empty((n, k), dtype=torch.float16, device=dev)

    def decode_mm() -> torch.Tensor:
        return torch.nn.functional.linear(a, exl3_decode(trellis, args.codebook, out=scratch, trans=True))

    c32 = torch.randn(rows, n, dtype=torch.float32, device=dev, generator=g)
    assert (kernel() - want).abs().max().item() <= tol
    assert (decode_mm().float() - want).abs().max().item() <= 1e-2 * want.abs().max().item()  # fp16 out
    wt = torch.randn(o, i, dtype=torch.bfloat16, device=dev, generator=g)
    row: dict[str, Any] = {
        "floor_ms": (trellis.numel() * 2 + a.numel() * 2 + rows * n * 4) / fl["copy_gb_s"] / 1e6,
        "bf16": bench(lambda: x @ wb),
        "bf16_linear": bench(lambda: torch.nn.functional.linear(x, wt)),
        "kernel_default": bench(kernel),
        "decode": bench(lambda: exl3_decode(trellis, args.codebook, out=scratch, trans=True)),
        "mm_fp16": bench(lambda: torch.nn.functional.linear(a, scratch)),
        "decode_mm": bench(decode_mm),
        "had_in": bench(lambda: hadamard_128(a, lin.suh)),
        "had_out": bench(lambda: hadamard_128(c32, post=lin.svh, out=c32)),
        "inline_ours": bench(lambda: ours._exl3(lin, x, None, "inline")),
        "decode_ours": bench(lambda: ours._exl3(lin, x, None, "decode")),
        "default_config": KernelConfig()._asdict(),
        "kernel": {},
    }
    if be is not None:
        for path in ("fused", "recon", "inline"):
            row[path] = bench(lambda path=path: be._exl3(lin, x, None, path))
    for cfg in sweep:
        if time.monotonic() - t0 > args.deadline_s:
            break
        name = "bn{}_bk{}_w{}_s{}_p{}".format(*cfg)
        try:
            err = (kernel(cfg) - want).abs().max().item()
            ok = err <= tol
            row["kernel"][name] = (
                {"ms": bench(lambda cfg=cfg: kernel(cfg))} if ok else {"error": f"max error {err:.3g}"}
            )
        except Exception as e:  # a launch shape that does not compile or fit (shared memory)
            row["kernel"][name] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160]}"}
    timed = {n_: v["ms"] for n_, v in row["kernel"].items() if "ms" in v}
    if timed:
        row["kernel_best"] = best = min(timed, key=lambda n_: timed[n_])
        row["kernel_best_ms"] = timed[best]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--codebook", default="3inst")
    ap.add_argument("--deadline-s", type=float, default=420.0, help="stop sweeping launch shapes after this")
    ap.add_argument("--no-exllamav3", action="store_true", help="our kernels and BF16 only (no extension build)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    dev = torch.device("cuda")
    be = None if args.no_exllamav3 else Exl3Backend(fused_max_rows=1 << 30, ext=load_ext())
    fl = floors(dev)
    print(f"copy {fl['copy_gb_s']:.0f} GB/s, bf16 {fl['bf16_tflops']:.0f} TFLOP/s", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "machine": platform.node(),
        "command": "python -m draft_tools.bench.exl3_kernel " + " ".join(argv if argv is not None else sys.argv[1:]),
        "bits": args.bits,
        "codebook": args.codebook,
        "floors": fl,
        "rows": {},
    }
    sweep = configs()
    for rows in ROWS:
        for i, o in SHAPES:
            row = measure(be, i, o, rows, args, fl, g, [] if time.monotonic() - t0 > args.deadline_s else sweep, t0)
            out["rows"][f"{i}x{o}_r{rows}"] = row
            ext_cols = "".join(f"  {p} {row[p]:6.3f}" for p in ("fused", "recon", "inline") if p in row)
            print(
                f"{i:>5}x{o:<5} r{rows:<4} floor {row['floor_ms']:6.3f}  bf16 {row['bf16_linear']:6.3f}{ext_cols}"
                f"  kernel {row['kernel_default']:6.3f}"
                f"  dec {row['decode']:6.3f} +mm {row['decode_mm']:6.3f} (mm {row['mm_fp16']:6.3f})"
                f"  had {row['had_in']:5.3f}/{row['had_out']:5.3f}  inl+h {row['inline_ours']:6.3f}"
                f"  dec+h {row['decode_ours']:6.3f}"
                f"  best {row.get('kernel_best_ms', float('nan')):6.3f}"
                f" {row.get('kernel_best', '-')}  ({len(row['kernel'])} shapes, {time.monotonic() - t0:.0f} s)",
                flush=True,
            )
            with open(args.out, "w") as f:  # after every row: a timeout keeps what was measured
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
