"""Fused elementwise kernels of the draft step (Triton): RMSNorm, RoPE and its cos/sin, the MLA cached
token (RMSNorm + RoPE in one pass), SiLU-and-multiply, and the greedy Markov step's argmax.

Each replaces a chain of small PyTorch kernels with one launch and one pass over memory, and
does the arithmetic of the eager op in ``layers/ops.py``: float32, rounded to the input dtype
where the eager op rounds (RMSNorm rounds the normalised row before the weight multiply; SiLU
rounds before the product); only the order of a row's sum may differ (last bit). Inputs are
views with at most three leading dims, a contiguous last dim and any other strides (a head slice
of a fused QKV projection, the rope part of a latent), and weights or cos/sin broadcast over
them, so no copy is needed to call them.
``layers/ops.py`` dispatches here for CUDA tensors; the tests run them under Triton's
interpreter against the eager ops.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def _lead3(t: torch.Tensor) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Sizes and strides of t's (at most 3) leading dims, padded to 3."""
    lead, strides = list(t.shape[:-1]), list(t.stride()[:-1])
    if len(lead) > 3:
        raise ValueError("at most 3 leading dims")
    while len(lead) < 3:
        lead.append(1)
        strides.append(0)
    return (lead[0], lead[1], lead[2]), (strides[0], strides[1], strides[2])


@triton.jit
def _rms_kernel(
    X, W, Y, H1, H2, sx0, sx1, sx2, sw0, sw1, sw2, sy0, sy1, sy2, D, eps, BLOCK_D: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    i2 = r % H2
    i1 = (r // H2) % H1
    i0 = r // (H1 * H2)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    x = tl.load(X + i0 * sx0 + i1 * sx1 + i2 * sx2 + d, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(W + i0 * sw0 + i1 * sw1 + i2 * sw2 + d, mask=mask, other=0.0).to(tl.float32)
    # rounded as x's dtype rounds (torch's op), then stored in y's: the same bits as converting after
    out = (y.to(X.dtype.element_ty).to(tl.float32) * w).to(X.dtype.element_ty)
    tl.store(Y + i0 * sy0 + i1 * sy1 + i2 * sy2 + d, out.to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] (at most 3 leading dims, any strides but the last);
    w broadcasts to x ([D], or e.g. one row per layer). ``out_dtype``: the result, rounded as x's
    dtype rounds, stored in that dtype (``rms_norm(x, w, eps).to(out_dtype)`` in one kernel)."""
    D = x.shape[-1]
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("the last dims must be contiguous")
    (m, h1, h2), (s0, s1, s2) = _lead3(x)
    _, (w0, w1, w2) = _lead3(w.expand(x.shape))
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    _, (t0, t1, t2) = _lead3(y)
    rows = m * h1 * h2
    if rows:
        block = triton.next_power_of_2(D)
        _rms_kernel[(rows,)](
            x, w, y, h1, h2, s0, s1, s2, w0, w1, w2, t0, t1, t2, D, eps,
            BLOCK_D=block, num_warps=8 if block >= 4096 else 4 if block >= 1024 else 1,
        )  # fmt: skip
    return y


@triton.jit
def _rope_pairs(i, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The two offsets each rotation mixes: (2i, 2i + 1) interleaved, else (i, i + HALF)."""
    if INTERLEAVED:
        return 2 * i, 2 * i + 1
    return i, i + HALF


@triton.jit
def _rotate_store(yp, a, b, x1, x2, CP, SP, mask):
    """Store the rotation of the pairs (x1, x2) by cos/sin at CP/SP (float32 math, the output's dtype)."""
    c = tl.load(CP, mask=mask, other=0.0)
    s = tl.load(SP, mask=mask, other=0.0)
    tl.store(yp + a, (x1 * c - x2 * s).to(yp.dtype.element_ty), mask=mask)
    tl.store(yp + b, (x2 * c + x1 * s).to(yp.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    X, C, S, Y, H1, H2, sx0, sx1, sx2, sc0, sc1, sc2, sy0, sy1, sy2, HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    i2 = r % H2
    i1 = (r // H2) % H1
    i0 = r // (H1 * H2)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    a, b = _rope_pairs(i, HALF, INTERLEAVED)
    xp = X + i0 * sx0 + i1 * sx1 + i2 * sx2
    x1 = tl.load(xp + a, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + b, mask=mask, other=0.0).to(tl.float32)
    cp = i0 * sc0 + i1 * sc1 + i2 * sc2 + i
    _rotate_store(Y + i0 * sy0 + i1 * sy1 + i2 * sy2, a, b, x1, x2, C + cp, S + cp, mask)


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate x [..., R] (at most 3 leading dims) by float32 cos/sin [..., R/2] broadcast to x's lead dims,
    into ``out`` when given (x's shape and dtype, any strides but a contiguous last dim: e.g. the rope
    part of a query buffer), else into a new tensor."""
    R = x.shape[-1]
    half = R // 2
    if x.stride(-1) != 1 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError("x needs a contiguous last dim, cos/sin float32")
    cb = cos.expand(*x.shape[:-1], half)
    sb = sin.expand(*x.shape[:-1], half)
    if cb.stride() != sb.stride() or cb.stride(-1) != 1:
        raise ValueError("cos and sin must share one layout with a contiguous last dim")
    (m, h1, h2), (s0, s1, s2) = _lead3(x)
    _, (c0, c1, c2) = _lead3(cb)
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1):
        raise ValueError(f"out {list(out.shape)} {out.dtype} does not take x {list(x.shape)} {x.dtype}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    _, (t0, t1, t2) = _lead3(y)
    rows = m * h1 * h2
    if rows:
        _rope_kernel[(rows,)](
            x, cb, sb, y, h1, h2, s0, s1, s2, c0, c1, c2, t0, t1, t2,
            HALF=half, INTERLEAVED=interleaved, BLOCK=triton.next_power_of_2(half), num_warps=1,
        )  # fmt: skip
    return y


@triton.jit
def _silu_mul_kernel(G, U, Y, F, s_g, s_u, s_y, R: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    f = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = f < F
    # gate and up rounded to the op's dtype R first (a no-op when they already are): what the eager
    # op computes on the rounded products; the result rounded to R, then stored in Y's dtype
    g = tl.load(G + m * s_g + f, mask=mask, other=0.0).to(R).to(tl.float32)
    u = tl.load(U + m * s_u + f, mask=mask, other=0.0).to(R).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(R).to(tl.float32)
    tl.store(Y + m * s_y + f, (act * u).to(R).to(Y.dtype.element_ty), mask=mask)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [..., 2F] (gate | up) -> silu(gate) * up [..., F]."""
    F = gu.shape[-1] // 2
    return silu_mul_parts(gu[..., :F], gu[..., F:], gu.dtype)


def silu_mul_parts(
    g: torch.Tensor, u: torch.Tensor, dtype: torch.dtype, store: torch.dtype | None = None
) -> torch.Tensor:
    """silu(gate) * up from separate gate and up [..., F] (any float dtype, rows may be strided: an EXL3
    model's two float32 products) -> [..., F] in ``dtype``, gate and up rounded to it first; ``store``:
    that result stored in this dtype instead (``silu_mul_parts(g, u, dtype).to(store)`` in one kernel)."""
    if g.shape != u.shape:
        raise ValueError(f"gate {list(g.shape)} and up {list(u.shape)} differ")
    F = g.shape[-1]
    g2, u2 = (t.reshape(-1, F) if t.dim() != 2 else t for t in (g, u))
    g2, u2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (g2, u2))
    if dtype not in _TL:  # e.g. float64: the eager op
        y = torch.nn.functional.silu(g.to(dtype)) * u.to(dtype)
        return y if store is None else y.to(store)
    y = torch.empty((g2.shape[0], F), dtype=store or dtype, device=g.device)
    if g2.shape[0]:
        block = 1024
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(F, block))](
            g2, u2, y, F, g2.stride(0), u2.stride(0), y.stride(0), R=_TL[dtype], BLOCK=block
        )
    return y.view(*g.shape[:-1], F)


@triton.jit
def _rms_rope_row(xp, wp, cp, sp, yp, D, eps, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """RoPE of one RMSNormed row at xp into yp: ``_rms_kernel``'s arithmetic and rounding, then
    ``_rope_kernel``'s on the rounded normed values (weights at wp, cos/sin at cp/sp)."""
    d = tl.arange(0, BLOCK_D)
    x = tl.load(xp + d, mask=d < D, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    i = tl.arange(0, BLOCK_H)
    mask = i < HALF
    a, b = _rope_pairs(i, HALF, INTERLEAVED)
    xa = tl.load(xp + a, mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(xp + b, mask=mask, other=0.0).to(tl.float32)
    wa = tl.load(wp + a, mask=mask, other=0.0).to(tl.float32)
    wb = tl.load(wp + b, mask=mask, other=0.0).to(tl.float32)
    x1 = ((xa * rstd).to(yp.dtype.element_ty).to(tl.float32) * wa).to(yp.dtype.element_ty).to(tl.float32)
    x2 = ((xb * rstd).to(yp.dtype.element_ty).to(tl.float32) * wb).to(yp.dtype.element_ty).to(tl.float32)
    _rotate_store(yp, a, b, x1, x2, cp + i, sp + i, mask)


@triton.jit
def _rms_rope_kernel(
    X, W, C, S, Y, H1, H2, sx0, sx1, sx2, sw0, sw1, sw2, sc0, sc1, sc2, sy0, sy1, sy2, D, eps,
    HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """RoPE of an RMSNormed row (a GQA head's q or k); one read of the row, one write."""
    r = tl.program_id(0)
    i2 = r % H2
    i1 = (r // H2) % H1
    i0 = r // (H1 * H2)
    cp = i0 * sc0 + i1 * sc1 + i2 * sc2
    _rms_rope_row(
        X + i0 * sx0 + i1 * sx1 + i2 * sx2, W + i0 * sw0 + i1 * sw1 + i2 * sw2, C + cp, S + cp,
        Y + i0 * sy0 + i1 * sy1 + i2 * sy2, D, eps, HALF, INTERLEAVED, BLOCK_D, BLOCK_H,
    )  # fmt: skip


@triton.jit
def _gqa_kv_kernel(
    K, V, W, C, S, OUT, SLOTS, L, NKV, sk0, sk1, sk2, sv0, sv1, sv2, sw, sc, so_slot, so_layer, so_kv,
    so_head, D, eps, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """One cached GQA token head at its slot: K = RoPE(RMSNorm(k) * w) (``_rms_rope_row``), V copied."""
    p = tl.program_id(0)
    h = p % NKV
    layer = (p // NKV) % L
    r = p // (NKV * L)
    base = OUT + tl.load(SLOTS + r).to(tl.int64) * so_slot + layer.to(tl.int64) * so_layer + h * so_head
    _rms_rope_row(
        K + r.to(tl.int64) * sk0 + layer * sk1 + h * sk2, W + layer * sw, C + r * sc, S + r * sc, base, D, eps,
        HALF, INTERLEAVED, BLOCK_D, BLOCK_H,
    )  # fmt: skip
    d = tl.arange(0, BLOCK_D)
    v = tl.load(V + r.to(tl.int64) * sv0 + layer * sv1 + h * sv2 + d, mask=d < D, other=0.0)
    tl.store(base + so_kv + d, v.to(OUT.dtype.element_ty), mask=d < D)


def gqa_kv(
    k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
    interleaved: bool, into: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """Cached GQA tokens straight into their slots in one launch: k, v [R, L, nkv, hd] (any strides but
    the last: slices of a K/V projection), w [L, hd] or [hd] (k_norm), float32 cos/sin [R, hd/2]
    (contiguous rows); ``into`` = (cache [L, slots, 2, nkv, hd], slots [R] int32/int64). Row r's K
    (``rms_rope``'s arithmetic) and V of layer l land in cache[l, slots[r]]; returns the cache."""
    R, L, nkv, D = k.shape
    half = D // 2
    out, slots = into
    w2 = w.view(1, D).expand(L, D) if w.dim() == 1 else w
    if v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1 or w2.shape != (L, D) or w2.stride(-1) != 1:
        raise ValueError("k and v [rows, layers, heads, dim] and w [layers, dim] need contiguous last dims")
    if out.shape[0] != L or out.shape[2:] != (2, nkv, D) or out.stride(-1) != 1 or out.dtype != k.dtype:
        raise ValueError(f"a cache of {L} layers of (2, {nkv}, {D}) {k.dtype} takes these rows, not {list(out.shape)}")
    if slots.shape != (R,) or slots.stride(0) != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError("slots must be a contiguous int32/int64 [rows]")
    if cos.shape != (R, half) or sin.shape != cos.shape or cos.stride() != (half, 1) or sin.stride() != (half, 1):
        raise ValueError("cos/sin must be contiguous float32 [rows, dim/2]")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError("cos/sin must be float32")
    if R * L * nkv:
        _gqa_kv_kernel[(R * L * nkv,)](
            k, v, w2, cos, sin, out, slots, L, nkv, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), w2.stride(0), half, out.stride(1), out.stride(0), out.stride(2), out.stride(3), D, eps,
            HALF=half, INTERLEAVED=interleaved, BLOCK_D=triton.next_power_of_2(D), BLOCK_H=triton.next_power_of_2(half),
            num_warps=1 if D <= 256 else 4,
        )  # fmt: skip
    return out


def rms_rope(
    x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, interleaved: bool
) -> torch.Tensor:
    """``rope(rms_norm(x, w, eps), cos, sin, interleaved)`` in one launch: x [..., D] (at most 3 leading
    dims, any strides but the last), w broadcast to x ([D] or per layer), float32 cos/sin [..., D/2]
    broadcast to x's leading dims. The two kernels' arithmetic in a row (compiled, the last bit of a
    float32 value may differ: the code generator contracts and orders sums per kernel)."""
    D = x.shape[-1]
    half = D // 2
    if x.stride(-1) != 1 or w.stride(-1) != 1 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError("x and w need contiguous last dims, cos/sin float32")
    cb, sb = cos.expand(*x.shape[:-1], half), sin.expand(*x.shape[:-1], half)
    if cb.stride() != sb.stride() or cb.stride(-1) != 1:
        raise ValueError("cos and sin must share one layout with a contiguous last dim")
    (m, h1, h2), (s0, s1, s2) = _lead3(x)
    _, (w0, w1, w2) = _lead3(w.expand(x.shape))
    _, (c0, c1, c2) = _lead3(cb)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _, (t0, t1, t2) = _lead3(y)
    rows = m * h1 * h2
    if rows:
        _rms_rope_kernel[(rows,)](
            x, w, cb, sb, y, h1, h2, s0, s1, s2, w0, w1, w2, c0, c1, c2, t0, t1, t2, D, eps,
            HALF=half, INTERLEAVED=interleaved, BLOCK_D=triton.next_power_of_2(D),
            BLOCK_H=triton.next_power_of_2(half), num_warps=1 if D <= 256 else 4,
        )  # fmt: skip
    return y


@triton.jit
def _cos_sin_kernel(P, INV, MUL, OUT, n, HALF: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """cos and sin of positions x inverse frequencies, formed and rounded as ``ops.Rope.cos_sin``
    does it: the angle, cos/sin and the scale in float64 registers, then float32 (OUT: [2, n, HALF])."""
    r = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    i = tl.arange(0, BLOCK_H)
    rmask, imask = r < n, i < HALF
    p = tl.load(P + r, mask=rmask, other=0).to(tl.float64)
    inv = tl.load(INV + i, mask=imask, other=0.0)
    mul = tl.load(MUL)
    ang = p[:, None] * inv[None, :]
    at = r[:, None].to(tl.int64) * HALF + i[None, :]
    mask = rmask[:, None] & imask[None, :]
    tl.store(OUT + at, (tl.cos(ang) * mul).to(tl.float32), mask=mask)
    tl.store(OUT + n * HALF + at, (tl.sin(ang) * mul).to(tl.float32), mask=mask)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, mul: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin [*positions.shape, half] of integer positions (contiguous) in one launch, with
    ``inv_freq`` [half] and ``mul`` [1] float64: what ``ops.Rope.cos_sin`` computes with eight."""
    if positions.dtype.is_floating_point or not positions.is_contiguous():
        raise ValueError("positions must be a contiguous integer tensor")
    if inv_freq.dtype != torch.float64 or mul.dtype != torch.float64:
        raise ValueError("inv_freq and mul must be float64")
    half = inv_freq.shape[0]
    n = positions.numel()
    out = torch.empty((2, n, half), dtype=torch.float32, device=positions.device)
    if n:
        # float64 cos/sin are slow per thread: spread them over programs (16 positions a program took
        # 5.5 us on the H200 for a step's 8, one warp computing them all)
        block_p = 1 if n <= 128 else 4
        _cos_sin_kernel[(triton.cdiv(n, block_p),)](
            positions, inv_freq, mul, out, n, HALF=half, BLOCK_P=block_p, BLOCK_H=triton.next_power_of_2(half),
            num_warps=1,
        )  # fmt: skip
    shape = (*positions.shape, half)
    return out[0].view(shape), out[1].view(shape)


@triton.jit
def _mla_latent_kernel(
    KV, W, C, S, OUT, SLOTS, H1, skv0, skv1, sw, sc, so0, so1, eps, LAT: tl.constexpr, HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr, SCATTER: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """One cached MLA token from a raw kv_a row [LAT + 2 * HALF]: RMSNorm of the latent (``_rms_kernel``'s
    arithmetic), RoPE of the key part (``_rope_kernel``'s), both into OUT's row (l, r) = (i1, i0), or
    with SCATTER into row (l, SLOTS[r]) (a cache slot)."""
    row = tl.program_id(0)
    i1 = row % H1
    i0 = row // H1
    src = KV + i0.to(tl.int64) * skv0 + i1 * skv1
    at = tl.load(SLOTS + i0).to(tl.int64) if SCATTER else i0.to(tl.int64)
    dst = OUT + at * so0 + i1.to(tl.int64) * so1
    d = tl.arange(0, BLOCK_L)
    dmask = d < LAT
    x = tl.load(src + d, mask=dmask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / LAT + eps)
    w = tl.load(W + i1 * sw + d, mask=dmask, other=0.0).to(tl.float32)
    tl.store(dst + d, (y.to(OUT.dtype.element_ty).to(tl.float32) * w).to(OUT.dtype.element_ty), mask=dmask)
    i = tl.arange(0, BLOCK_H)
    mask = i < HALF
    a, b = _rope_pairs(i, HALF, INTERLEAVED)
    a, b = a + LAT, b + LAT
    x1 = tl.load(src + a, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + b, mask=mask, other=0.0).to(tl.float32)
    _rotate_store(dst, a, b, x1, x2, C + i0 * sc + i, S + i0 * sc + i, mask)


def mla_latent(
    kv: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, interleaved: bool,
    layers_first: bool = False, into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Cached MLA tokens ``[RMSNorm(latent) * w ; RoPE(key)]`` from raw kv_a rows in one launch.

    kv [R, L, LAT + rope] (any strides but the last): R rows (positions) of L layers; w [L, LAT]
    (or [LAT] for L = 1); cos/sin float32 [R, rope/2] (contiguous rows). Returns [R, L, LAT + rope],
    or [L, R, LAT + rope] with ``layers_first``; with ``into`` = (cache [L, slots, LAT + rope], slots
    [R] int32/int64) row r of layer l lands in cache[l, slots[r]] (distinct slots) and the cache is
    returned. The same arithmetic as ``rms_norm`` then ``rope`` then a concatenation."""
    R, L, width = kv.shape
    half = cos.shape[-1]
    lat = width - 2 * half
    w2 = w.view(1, lat).expand(L, lat) if w.dim() == 1 else w
    if kv.stride(-1) != 1 or w2.stride(-1) != 1 or w2.shape != (L, lat):
        raise ValueError("kv and w need contiguous last dims, w [L, latent] or [latent]")
    if cos.shape != (R, half) or sin.shape != cos.shape or cos.stride() != (half, 1) or sin.stride() != (half, 1):
        raise ValueError("cos/sin must be contiguous float32 [rows, rope/2]")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError("cos/sin must be float32")
    if into is not None:
        out, slots = into
        if out.dim() != 3 or out.shape[0] != L or out.shape[2] != width or out.stride(-1) != 1 or out.dtype != kv.dtype:
            raise ValueError(
                f"a cache of {L} layers of {width} {kv.dtype} values takes these rows, not {list(out.shape)}"
            )
        if slots.shape != (R,) or slots.stride(0) != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError("slots must be a contiguous int32/int64 [rows]")
        so0, so1 = out.stride(1), out.stride(0)
    else:
        out = torch.empty((L, R, width) if layers_first else (R, L, width), dtype=kv.dtype, device=kv.device)
        slots = out  # unread
        so0, so1 = (out.stride(1), out.stride(0)) if layers_first else (out.stride(0), out.stride(1))
    if R * L:
        _mla_latent_kernel[(R * L,)](
            kv, w2, cos, sin, out, slots, L, kv.stride(0), kv.stride(1), w2.stride(0), half, so0, so1, eps,
            LAT=lat, HALF=half, INTERLEAVED=interleaved, SCATTER=into is not None, BLOCK_L=triton.next_power_of_2(lat),
            BLOCK_H=triton.next_power_of_2(half), num_warps=1,  # as ``rms_norm`` launches a row of 512
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# Greedy Markov step: argmax over (base logits + Markov bias), one pass over both
# ---------------------------------------------------------------------------------------------
ARGMAX_BLOCK = 4096


@triton.jit
def _argmax_partial_kernel(
    BASE, BIAS, PMAX, PIDX, V, s_base, s_bias, n_blocks, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Block b of row n: the largest float32 value of base (+ bias) and its first index."""
    n = tl.program_id(0)
    b = tl.program_id(1)
    v = b * BLOCK + tl.arange(0, BLOCK)
    mask = v < V
    x = tl.load(BASE + n.to(tl.int64) * s_base + v, mask=mask, other=float("-inf")).to(tl.float32)
    if HAS_BIAS:
        x = x + tl.load(BIAS + n.to(tl.int64) * s_bias + v, mask=mask, other=0.0).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN ranks highest, as in torch.argmax
    x = tl.where(mask, x, float("-inf"))
    m = tl.max(x, 0)
    i = tl.min(tl.where(x == m, v, V), 0)  # the first index holding the max
    tl.store(PMAX + n * n_blocks + b, m)
    tl.store(PIDX + n * n_blocks + b, i)


@triton.jit
def _argmax_final_kernel(PMAX, PIDX, OUT, D2T, n_blocks, HAS_D2T: tl.constexpr, BLOCK_B: tl.constexpr):
    """Row n's first index of its largest block maximum; with D2T the target id: index + D2T[index]."""
    n = tl.program_id(0)
    b = tl.arange(0, BLOCK_B)
    mask = b < n_blocks
    m = tl.load(PMAX + n * n_blocks + b, mask=mask, other=float("-inf"))
    i = tl.load(PIDX + n * n_blocks + b, mask=mask, other=0)
    best = tl.max(m, 0)
    big = tl.full([BLOCK_B], 2147483647, tl.int32)
    idx = tl.min(tl.where(mask & (m == best), i, big), 0).to(tl.int64)
    if HAS_D2T:
        idx = idx + tl.load(D2T + idx).to(tl.int64)
    tl.store(OUT + n, idx)


def markov_argmax(base: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """argmax over the last dim of ``base.float() + bias.float()`` [N, V] (int64 [N]), without
    materialising the float32 sum: one read of each input. Ties go to the first index, like
    ``torch.argmax``; a row holding NaN returns the first NaN's index (torch's rule too, but for
    rows holding both NaN and +Inf, where this returns whichever comes first)."""
    N, V = base.shape
    if base.stride(1) != 1 or (bias is not None and (bias.shape != base.shape or bias.stride(1) != 1)):
        raise ValueError("base and bias must be [N, V] with a contiguous last dim")
    n_blocks = triton.cdiv(V, ARGMAX_BLOCK)
    pmax, pidx, out = _argmax_buffers(N, n_blocks, base.device)
    if N == 0:
        return out
    b = base if bias is None else bias
    _argmax_partial_kernel[(N, n_blocks)](
        base, b, pmax, pidx, V, base.stride(0), b.stride(0), n_blocks,
        HAS_BIAS=bias is not None, BLOCK=ARGMAX_BLOCK, num_warps=8,
    )  # fmt: skip
    return _argmax_finish(pmax, pidx, out)


def _argmax_buffers(N: int, n_blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-block maxima and indices [N, n_blocks], and the answer [N]."""
    pmax = torch.empty((N, n_blocks), dtype=torch.float32, device=device)
    pidx = torch.empty((N, n_blocks), dtype=torch.int32, device=device)
    return pmax, pidx, torch.empty((N,), dtype=torch.int64, device=device)


def _argmax_finish(
    pmax: torch.Tensor, pidx: torch.Tensor, out: torch.Tensor, d2t: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's first index of its largest block maximum (``_argmax_final_kernel``), mapped through
    ``d2t`` (target id = index + d2t[index]) when given."""
    n_blocks = pmax.shape[1]
    _argmax_final_kernel[(out.shape[0],)](
        pmax, pidx, out, out if d2t is None else d2t, n_blocks, HAS_D2T=d2t is not None,
        BLOCK_B=max(16, triton.next_power_of_2(n_blocks)),
    )  # fmt: skip
    return out


MARKOV_BLOCK_V = 128
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the bias as F.linear writes it: as is, bf16, fp16


@dataclass(frozen=True)
class MarkovLaunch:
    """How ``markov_argmax_lowrank`` tiles its pass: sessions per program (``block_n``), vocab rows per
    tile (``block_v``), tiles per program (``iters``: one Markov row gather per program, the tiles'
    W2 loads pipelined over ``stages``), and warps."""

    block_n: int
    block_v: int = MARKOV_BLOCK_V
    iters: int = 1
    warps: int = 4
    stages: int = 1

    def __str__(self) -> str:
        return f"n{self.block_n}_v{self.block_v}_i{self.iters}_w{self.warps}_s{self.stages}"


def markov_launch(N: int) -> MarkovLaunch:
    """The launch shape for N sessions: one vocab tile per program, the sessions' rows rounded up to a
    power of two from 16 to 64. A program's work grows with its session rows, used or not: on an H200,
    32 sessions run the 7-pass chain in 0.24 ms with 32 rows against 0.30 with 64 (K3;
    ``bench/results/markov_sweep_h200.json``, from ``draft_tools.bench.markov_sweep``), and at 64
    sessions no other shape of its grid is more than 2% faster than 64 rows, one tile."""
    return MarkovLaunch(block_n=min(64, max(16, triton.next_power_of_2(N))))


@triton.jit
def _markov_partial_kernel(
    BASE, PREV, W1, W2, PMAX, PIDX, N, V, s_base, s_prev, s_e, s_w, n_parts, ROUND: tl.constexpr,
    R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, ITERS: tl.constexpr,
    STAGES: tl.constexpr, UPCAST: tl.constexpr, REVERSE: tl.constexpr,
):  # fmt: skip
    """Part p, sessions n0..n0+BLOCK_N: e = W1[PREV[n]] (the Markov embedding of the session's previous
    token) once, then for each of the part's ITERS vocab tiles bias = e @ W2[tile]^T (rounded to the
    model dtype, as ``F.linear`` writes it), x = base + bias in float32; each row's max over the part's
    tiles and its first index. REVERSE: program i takes part n_parts - 1 - i and walks its tiles from
    the last (the parts, and what each stores, are the same)."""
    p = n_parts - 1 - tl.program_id(0) if REVERSE else tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    nmask, rmask = n < N, r < R
    prev = tl.load(PREV + n * s_prev, mask=nmask, other=0).to(tl.int64)
    e = tl.load(W1 + prev[:, None] * s_e + r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0)
    if UPCAST:  # Triton's interpreter multiplies half-precision dots wrongly: float32 operands there
        e = e.to(tl.float32)
    best = tl.full([BLOCK_N], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK_N], 2147483647, tl.int32)
    for t in tl.range(0, ITERS, num_stages=STAGES):
        b = p * ITERS + (ITERS - 1 - t if REVERSE else t)
        v = b * BLOCK_V + tl.arange(0, BLOCK_V)
        vmask = v < V  # a tile past the last (a short last part) lies past V: all masked
        w = tl.load(W2 + v[:, None].to(tl.int64) * s_w + r[None, :], mask=vmask[:, None] & rmask[None, :], other=0.0)
        if UPCAST:
            w = w.to(tl.float32)
        bias = tl.dot(e, tl.trans(w), input_precision="ieee")  # exact float32 products; half inputs ignore it
        if ROUND == 1:  # to bfloat16, nearest-even, by hand: the interpreter's cast truncates
            bits = bias.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            bias = tl.where(bias != bias, bias, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
        elif ROUND == 2:
            bias = bias.to(tl.float16).to(tl.float32)
        mask = nmask[:, None] & vmask[None, :]
        x = tl.load(BASE + n[:, None].to(tl.int64) * s_base + v[None, :], mask=mask, other=float("-inf"))
        x = x.to(tl.float32) + bias
        x = tl.where(x != x, float("inf"), x)  # NaN ranks highest, as in torch.argmax
        x = tl.where(mask, x, float("-inf"))
        m = tl.max(x, 1)
        i = tl.min(tl.where(x == m[:, None], v[None, :], 2147483647), 1)  # the tile's first index of its max
        take = (m > best) | ((m == best) & (i < best_i))  # ties: the lower index, whichever way the tiles go
        best = tl.where(take, m, best)
        best_i = tl.where(take, i, best_i)
    tl.store(PMAX + n * n_parts + p, best, mask=nmask)
    tl.store(PIDX + n * n_parts + p, best_i, mask=nmask)


def markov_argmax_lowrank(
    base: torch.Tensor,
    prev: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    reverse: bool = False,
    d2t: torch.Tensor | None = None,
    launch: MarkovLaunch | None = None,
) -> torch.Tensor:
    """One greedy Markov step: the target id of ``markov_argmax(base, F.linear(W1[prev], w2))`` (prev
    [N], any stride: a column of the block's ids), without
    the embedding, the bias or the draft id ever in memory. The low-rank Markov bias (e = W1[prev]
    [N, R] times W2 [V, R]) is formed tile by tile beside the base logits [N, V], rounded to W1's dtype
    as ``F.linear`` would write it, and only each part's max and index are stored (a part: ``launch``'s
    ``iters`` vocab tiles; ``markov_launch(N)`` unless given); the final pass maps the draft id through
    ``d2t`` (target id = id + d2t[id]). One read of W2 and of base per step, two launches, instead of an
    embedding, a GEMM, its split-K reduction, an argmax and a gather.

    ``reverse``: launch the vocab parts last first (and walk each part's tiles last first). The chain
    alternates, so each step starts on the part of W2 (84 MB at K3 size, past the L2) that the step
    before read last and the L2 still holds. The result is the same either way: every part stores its
    own max and first index."""
    N, V = base.shape
    R = w1.shape[1]
    if base.stride(1) != 1 or w1.stride(1) != 1 or w2.stride(1) != 1 or w2.shape != (V, R) or prev.shape != (N,):
        raise ValueError("base [N, V], prev [N], w1 [vocab, R] and w2 [V, R] need contiguous last dims")
    if w1.dtype != w2.dtype:
        raise ValueError("w1 and w2 must share a dtype")
    cfg = launch or markov_launch(N)
    n_tiles = triton.cdiv(V, cfg.block_v)
    n_parts = triton.cdiv(n_tiles, cfg.iters)
    pmax, pidx, out = _argmax_buffers(N, n_parts, base.device)
    if N == 0:
        return out
    _markov_partial_kernel[(n_parts, triton.cdiv(N, cfg.block_n))](
        base, prev, w1, w2, pmax, pidx, N, V, base.stride(0), prev.stride(0), w1.stride(0), w2.stride(0), n_parts,
        ROUND=_ROUND[w1.dtype], R=R, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v,
        BLOCK_R=max(16, triton.next_power_of_2(R)), ITERS=cfg.iters, STAGES=cfg.stages,
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1", REVERSE=reverse, num_warps=cfg.warps,
    )  # fmt: skip
    return _argmax_finish(pmax, pidx, out, d2t)
