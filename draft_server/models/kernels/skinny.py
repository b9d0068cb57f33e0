"""Skinny weight GEMMs of the draft step (Triton): y = x @ w.T (+ h) for a few rows (M <= 64).

At decode batch sizes (7-56 rows) a weight GEMM is a stream over the weight, and cuBLAS's
kernels for such shapes leave HBM bandwidth unused on an H200 (K3's down projection at 7 rows:
3.5 TB/s, o_proj 3.0, against 4.5 for the lm_head). Here the output columns are cut into
``block_n`` tiles and the reduction into ``split`` slices, so even a 7168-wide output puts
several programs on every SM, each streaming its [block_n, K / split] slice of w once. The
partials of a tile are summed in a fixed order (slice 0, 1, ...) by whichever program finishes
the tile last (a per-tile arrival counter that program resets): deterministic, one launch, no
atomics on the data. ``gemm`` offers this as one more strategy per shape and keeps it only where
it is timed faster; the tests run it under Triton's interpreter against ``torch.mm``.

Two prologues fold the op before a GEMM into it, where the tuner took this kernel for the shape
(``layers.ops``): ``swiglu`` (the down projection reads silu(gate) * up, formed as the tiles
load, bit for bit what ``fused.silu_mul`` writes) and ``norm`` (a layer's RMSNorm: the tiles times
the norm weight, each row's 1 / rms applied to its sum). At one K3 session each removes a kernel
of about 2 us and the gap after it, 20 in a step.
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


NO_PROLOGUE, SWIGLU, RMS = 0, 1, 2  # what the kernel does to x's tiles as it loads them


@triton.jit
def _epilogue(acc, H, Y, rm, rn, mask, sh, sy, HAS_H: tl.constexpr):
    if HAS_H:
        acc += tl.load(H + rm[:, None] * sh + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + rm[:, None] * sy + rn[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _skinny_kernel(
    X, W, H, Y, PART, CNT, NW, M, N, K, K_SLICE, SPLIT, sx, sw, sh, sy, x_up, eps,
    HAS_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRO: tl.constexpr,
):  # fmt: skip
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)  # RMS: the sum of x's squares over this slice of K
    k_lo = ps * K_SLICE
    for k in range(k_lo, k_lo + K_SLICE, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        xm = m_ok[:, None] & k_ok[None, :]
        x = tl.load(X + rm[:, None] * sx + rk[None, :], mask=xm, other=0.0)
        if PRO == 1:  # SWIGLU: x holds the gate, the up product lies x_up further on: silu_mul's arithmetic
            u = tl.load(X + x_up + rm[:, None] * sx + rk[None, :], mask=xm, other=0.0).to(tl.float32)
            g = x.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(X.dtype.element_ty).to(tl.float32)
            x = (act * u).to(X.dtype.element_ty)
        if PRO == 2:  # RMS: x times the norm's weight now, the row's 1/rms on the sum (the epilogue)
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
            nw = tl.load(NW + rk, mask=k_ok, other=0.0).to(tl.float32)
            x = (xf * nw[None, :]).to(X.dtype.element_ty)
        w = tl.load(W + rn[:, None] * sw + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # Triton's interpreter multiplies half-precision dots wrongly: float32 operands there
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        if PRO == 2:
            acc = acc * tl.rsqrt(ss / K + eps)[:, None]
        _epilogue(acc, H, Y, rm, rn, mask, sh, sy, HAS_H)
    else:
        part = PART + (ps * BLOCK_M + rm[:, None]) * N + rn[None, :]  # PART: [SPLIT, BLOCK_M, N] fp32
        tl.store(part, acc, mask=mask)
        if PRO == 2:  # then [tiles, SPLIT, BLOCK_M] fp32: each tile's slices' sums of squares
            tl.store(PART + SPLIT * BLOCK_M * N + (pn * SPLIT + ps) * BLOCK_M + rm, ss)
        arrived = tl.atomic_add(CNT + pn, 1)  # acq_rel: every slice's partial is visible to the last
        if arrived == SPLIT - 1:
            tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for s in range(SPLIT):
                p = PART + (s * BLOCK_M + rm[:, None]) * N + rn[None, :]
                tot += tl.load(p, mask=mask, other=0.0, cache_modifier=".cg")
                if PRO == 2:
                    sq += tl.load(PART + SPLIT * BLOCK_M * N + (pn * SPLIT + s) * BLOCK_M + rm, cache_modifier=".cg")
            if PRO == 2:
                tot = tot * tl.rsqrt(sq / K + eps)[:, None]
            _epilogue(tot, H, Y, rm, rn, mask, sh, sy, HAS_H)
            tl.store(CNT + pn, 0)  # ready for the next call


def block_m(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


class SkinnyGemm:
    """One GEMM shape (rows, out, in) with its launch shape and its own partials and counters
    (kept for the life of the CUDA graphs that replay it; calls on one stream may share it)."""

    MAX_ROWS = 64

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
        # split partials, then each tile's slices' sums of squares (the RMS prologue)
        n_part = cfg.split * self.bm * (out + self.tiles) if cfg.split > 1 else 1
        self.part = torch.empty(n_part, dtype=torch.float32, device=device)
        self.cnt = torch.zeros(self.tiles, dtype=torch.int32, device=device)

    @staticmethod
    def fits(rows: int, inp: int, cfg: SkinnyConfig) -> bool:
        return rows <= SkinnyGemm.MAX_ROWS and inp % (cfg.split * cfg.block_k) == 0

    def __call__(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        h: torch.Tensor | None = None,
        norm: tuple[torch.Tensor, float] | None = None,
        swiglu: bool = False,
    ) -> torch.Tensor:
        """y = x @ w.T (+ h). ``norm`` (weight [K], eps): of ``rms_norm(x)`` instead, x's tiles times
        the weight as they load and each row's 1 / rms applied to its sum (the norm's scale after the
        product, not before: the same product to within rounding, one kernel instead of two).
        ``swiglu``: x is [M, 2K], gate then up, and the product is of ``silu(gate) * up``, formed as
        its tiles load with ``fused.silu_mul``'s arithmetic and rounding (the same values exactly)."""
        M, K = x.shape
        N = w.shape[0]
        if swiglu:
            K //= 2
        if (M, N, K) != (self.rows, self.out, self.inp):
            raise ValueError(f"skinny GEMM made for {(self.rows, self.out, self.inp)}, called with {(M, N, K)}")
        if x.stride(1) != 1 or w.stride(1) != 1 or (h is not None and h.stride(1) != 1):
            raise ValueError("skinny GEMM operands need a contiguous last dim")
        if norm is not None and (swiglu or norm[0].shape != (K,) or norm[0].stride(0) != 1):
            raise ValueError("the norm's weight must be one contiguous [in] vector (and no swiglu with it)")
        c = self.cfg
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
        hh = y if h is None else h
        pro = SWIGLU if swiglu else RMS if norm is not None else NO_PROLOGUE
        nw, eps = norm if norm is not None else (y, 0.0)
        _skinny_kernel[(self.tiles, c.split)](
            x, w, hh, y, self.part, self.cnt, nw, M, N, K, K // c.split, c.split,
            x.stride(0), w.stride(0), hh.stride(0), y.stride(0), K, float(eps),
            HAS_H=h is not None, BLOCK_M=self.bm, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
            UPCAST=os.environ.get("TRITON_INTERPRET") == "1", PRO=pro, num_warps=c.warps, num_stages=self.stages,
        )  # fmt: skip
        return y
