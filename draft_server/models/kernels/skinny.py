"""Skinny weight GEMMs of the draft step (Triton): y = x @ w.T (+ h) for a few rows (M <= 128).

At decode batch sizes (7-56 rows) a weight GEMM is a stream over the weight, and cuBLAS's
kernels for such shapes leave HBM bandwidth unused on an H200 (K3's down projection at 7 rows:
3.5 TB/s, o_proj 3.0, against 4.5 for the lm_head). Here the output columns are cut into
``block_n`` tiles and the reduction into ``split`` slices, so even a 7168-wide output puts
several programs on every SM, each streaming its [block_n, K / split] slice of w once. The
partials of a tile are summed in a fixed order (slice 0, 1, ...) by whichever program finishes
the tile last (a per-tile arrival counter that program resets): deterministic, one launch, no
atomics on the data. ``gemm`` offers this as one more strategy per shape and keeps it only where
it is timed faster; the tests run it under Triton's interpreter against ``torch.mm``.

No prologue folds the op before a GEMM (a layer's RMSNorm, the MLP's SwiGLU) into the loads:
tried and measured (``bench/results/fused_step_prologues_h100.json``), it took one K3 session's
step from 3.04 to 4.53 ms, the loop's extra work per tile costing far more than the kernels saved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SMEM_BYTES = 200 * 1024  # what the pipelined tiles may take of an H100/H200 SM's 228 KB


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 64
    block_k: int = 128
    split: int = 4
    warps: int = 4
    stages: int = 4


@triton.jit
def _epilogue(acc, H, Y, rm, rn, mask, sh, sy, HAS_H: tl.constexpr):
    if HAS_H:
        acc += tl.load(H + rm[:, None] * sh + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + rm[:, None] * sy + rn[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _skinny_kernel(
    X, W, H, Y, PART, CNT, M, N, K, K_SLICE, SPLIT, sx, sw, sh, sy,
    HAS_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = ps * K_SLICE
    for k in range(k_lo, k_lo + K_SLICE, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(X + rm[:, None] * sx + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + rn[:, None] * sw + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # Triton's interpreter multiplies half-precision dots wrongly: float32 operands there
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        _epilogue(acc, H, Y, rm, rn, mask, sh, sy, HAS_H)
    else:
        part = PART + (ps * BLOCK_M + rm[:, None]) * N + rn[None, :]  # PART: [SPLIT, BLOCK_M, N] fp32
        tl.store(part, acc, mask=mask)
        arrived = tl.atomic_add(CNT + pn, 1)  # acq_rel: every slice's partial is visible to the last
        if arrived == SPLIT - 1:
            tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT):
                p = PART + (s * BLOCK_M + rm[:, None]) * N + rn[None, :]
                tot += tl.load(p, mask=mask, other=0.0, cache_modifier=".cg")
            _epilogue(tot, H, Y, rm, rn, mask, sh, sy, HAS_H)
            tl.store(CNT + pn, 0)  # ready for the next call


def block_m(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


class SkinnyGemm:
    """One GEMM shape (rows, out, in) with its launch shape and its own partials and counters
    (kept for the life of the CUDA graphs that replay it; calls on one stream may share it)."""

    MAX_ROWS = 128  # one row tile (``block_m``); the tuner offers it up to ``gemm.SKINNY_ROWS``

    def __init__(self, rows: int, out: int, inp: int, cfg: SkinnyConfig, device: torch.device) -> None:
        if rows > self.MAX_ROWS:
            raise ValueError(f"skinny GEMM takes at most {self.MAX_ROWS} rows, not {rows}")
        if inp % (cfg.split * cfg.block_k):
            raise ValueError(f"in={inp} is not a multiple of split x block_k = {cfg.split * cfg.block_k}")
        self.rows, self.out, self.inp, self.cfg = rows, out, inp, cfg
        self.bm = block_m(rows)
        # software-pipeline stages as the shared memory allows (x and w tiles per stage, 2 bytes each)
        self.stages = max(1, min(cfg.stages, SMEM_BYTES // ((self.bm + cfg.block_n) * cfg.block_k * 2)))
        self.tiles = triton.cdiv(out, cfg.block_n)
        n_part = cfg.split * self.bm * out if cfg.split > 1 else 1  # the split partials
        self.part = torch.empty(n_part, dtype=torch.float32, device=device)
        self.cnt = torch.zeros(self.tiles, dtype=torch.int32, device=device)

    @staticmethod
    def fits(rows: int, inp: int, cfg: SkinnyConfig) -> bool:
        return rows <= SkinnyGemm.MAX_ROWS and inp % (cfg.split * cfg.block_k) == 0

    def __call__(self, x: torch.Tensor, w: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ w.T (+ h)."""
        M, K = x.shape
        N = w.shape[0]
        if (M, N, K) != (self.rows, self.out, self.inp):
            raise ValueError(f"skinny GEMM made for {(self.rows, self.out, self.inp)}, called with {(M, N, K)}")
        if x.stride(1) != 1 or w.stride(1) != 1 or (h is not None and h.stride(1) != 1):
            raise ValueError("skinny GEMM operands need a contiguous last dim")
        c = self.cfg
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
        hh = y if h is None else h
        _skinny_kernel[(self.tiles, c.split)](
            x, w, hh, y, self.part, self.cnt, M, N, K, K // c.split, c.split,
            x.stride(0), w.stride(0), hh.stride(0), y.stride(0),
            HAS_H=h is not None, BLOCK_M=self.bm, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
            UPCAST=os.environ.get("TRITON_INTERPRET") == "1", num_warps=c.warps, num_stages=self.stages,
        )  # fmt: skip
        return y
