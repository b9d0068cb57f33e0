"""Programmatic dependent launch (PDL) on Hopper: what it saves in chains of the step's small kernels (issue 10).

A K3 step at one session is about 120 kernels, most of them short: the weight GEMMs stream 30-400 MB
each and the norms, RoPE and argmax kernels run a few microseconds. Between two kernels the GPU
drains the first (its last wave leaves SMs idle) and then starts the second. With PDL a kernel
launched with ``launch_pdl=True`` may start while its predecessor finishes; it must call
``gdc_wait()`` before it touches memory the predecessor writes or reads. This probe measures, as CUDA
graph replays on this GPU, three chains in three modes each before any product code uses PDL:

- ``tiny``: 100 launches of an elementwise kernel on 7 x 7168 bf16 values (a norm's size);
- ``gemms``: the K3 layer's five weight GEMMs at 7 rows (one session's block) over five layers'
  distinct weights (4 GB, past the L2), a tiny kernel between each two, as the step runs them;
- modes: ``off`` (plain launches), ``wait`` (each kernel lets its dependents launch at once and waits
  for its predecessor before any load), ``prefetch`` (a GEMM also loads its first weight tile before
  the wait: weights are never written during a step).

Every mode's outputs are compared with ``off``'s (the same kernels and summation order: bitwise). One
line per chain and mode, JSON with the machine:

    python3 -m draft_tools.bench.pdl_probe --out bench/results/pdl_probe_h200.json
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from draft_tools.bench.l2_prefetch_probe import replay_ms
from draft_tools.common import write_report

MODES = {"off": 0, "wait": 1, "prefetch": 2}
ROWS = 7
# K3's layer GEMMs at one session: (name, out, in, residual)
K3_LAYER = (("qkv_a", 2112, 7168, False), ("q_b", 12288, 1536, False), ("o_proj", 7168, 8192, True),
            ("gate_up", 28672, 7168, False), ("down", 7168, 14336, True))  # fmt: skip


@triton.jit
def _tiny_kernel(X, Y, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(X + i, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + i, (x * 0.999 + 0.001).to(Y.dtype.element_ty), mask=m)


@triton.jit
def _gemm_kernel(
    X, W, H, Y, PART, CNT, M, N, K, K_SLICE, SPLIT, sx, sw, sh, sy,
    HAS_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """``kernels/skinny.py``'s kernel with the PDL modes (see the module docstring)."""
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = ps * K_SLICE
    start = k_lo
    if PDL >= 1:
        gdc_launch_dependents()
    if PDL == 2:
        rk = k_lo + tl.arange(0, BLOCK_K)
        w0 = tl.load(W + rn[:, None] * sw + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
        gdc_wait()
        x0 = tl.load(X + rm[:, None] * sx + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
        acc = tl.dot(x0, tl.trans(w0), acc)
        start = k_lo + BLOCK_K
    elif PDL == 1:
        gdc_wait()
    for k in range(start, k_lo + K_SLICE, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(X + rm[:, None] * sx + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + rn[:, None] * sw + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    mask = m_ok[:, None] & n_ok[None, :]
    part = PART + (ps * BLOCK_M + rm[:, None]) * N + rn[None, :]
    tl.store(part, acc, mask=mask)
    arrived = tl.atomic_add(CNT + pn, 1)
    if arrived == SPLIT - 1:
        tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(SPLIT):
            p = PART + (s * BLOCK_M + rm[:, None]) * N + rn[None, :]
            tot += tl.load(p, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_H:
            tot += tl.load(H + rm[:, None] * sh + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + rm[:, None] * sy + rn[None, :], tot.to(Y.dtype.element_ty), mask=mask)
        tl.store(CNT + pn, 0)


class Gemm:
    def __init__(self, out: int, inp: int, dev: torch.device, block_n: int = 64, block_k: int = 128, split: int = 4):
        self.out, self.inp, self.bn, self.bk, self.split = out, inp, block_n, block_k, split
        self.tiles = triton.cdiv(out, block_n)
        self.part = torch.empty(split * 16 * out, dtype=torch.float32, device=dev)
        self.cnt = torch.zeros(self.tiles, dtype=torch.int32, device=dev)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, h: torch.Tensor | None, mode: int) -> torch.Tensor:
        y = torch.empty((x.shape[0], self.out), dtype=x.dtype, device=x.device)
        hh = y if h is None else h
        _gemm_kernel[(self.tiles, self.split)](
            x, w, hh, y, self.part, self.cnt, x.shape[0], self.out, self.inp, self.inp // self.split, self.split,
            x.stride(0), w.stride(0), hh.stride(0), y.stride(0),
            HAS_H=h is not None, BLOCK_M=16, BLOCK_N=self.bn, BLOCK_K=self.bk, PDL=mode,
            num_warps=4, num_stages=4, launch_pdl=mode > 0,
        )  # fmt: skip
        return y


def tiny(x: torch.Tensor, mode: int) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    _tiny_kernel[(triton.cdiv(n, 1024),)](x, y, n, PDL=mode > 0, BLOCK=1024, num_warps=4, launch_pdl=mode > 0)
    return y


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    report: dict[str, Any] = {
        "benchmark": "pdl_probe",
        "command": "python3 -m draft_tools.bench.pdl_probe " + " ".join(argv or []),
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "chains": {},
    }
    x0 = torch.randn(ROWS, 7168, dtype=torch.bfloat16, device=dev)

    def tiny_chain(mode: int) -> torch.Tensor:
        x = x0
        for _ in range(100):
            x = tiny(x, mode)
        return x

    def weight(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, dtype=torch.bfloat16, device=dev) / i**0.5

    layers = [[(weight(o, i), Gemm(o, i, dev), res) for _, o, i, res in K3_LAYER] for _ in range(args.layers)]
    xs = {i: torch.randn(ROWS, i, dtype=torch.bfloat16, device=dev) for _, _, i, _ in K3_LAYER}
    hid = torch.randn(ROWS, 7168, dtype=torch.bfloat16, device=dev)
    weight_bytes = sum(w.numel() * 2 for layer in layers for w, _, _ in layer)

    def gemm_chain(mode: int) -> torch.Tensor:
        acc = hid
        for layer in layers:
            for w, g, res in layer:
                x = tiny(xs[w.shape[1]], mode)  # a norm's place: between every two GEMMs
                y = g(x, w, acc if res else None, mode)
                if res:
                    acc = y
        return acc

    chains = (
        ("tiny", tiny_chain, {"kernels": 100}),
        ("gemms", gemm_chain, {"kernels": 2 * 5 * args.layers, "weight_bytes": weight_bytes}),
    )
    for name, chain, extra in chains:
        rows: dict[str, Any] = {**extra}
        ref = None
        for mode_name, mode in MODES.items():
            if name == "tiny" and mode == 2:
                continue
            ms, out = replay_ms(lambda mode=mode, chain=chain: chain(mode), args.runs)
            if ref is None:
                ref = out
            rows[mode_name] = {"ms": ms, "equal_to_off": bool(torch.equal(out, ref))}
            line = f"{name:6s} {mode_name:9s} {ms * 1e3:9.1f} us  equal={rows[mode_name]['equal_to_off']}"
            if "weight_bytes" in extra:
                line += f"  {weight_bytes / (ms / 1e3) / 1e12:.2f} TB/s"
            print(line, flush=True)
        report["chains"][name] = rows
    if args.out:
        write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
