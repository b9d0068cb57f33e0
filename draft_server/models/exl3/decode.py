"""Bit-exact EXL3 decode in pure torch (CPU or any device): codebooks, trellis tiles, Hadamard.

Owns the math of one EXL3 linear as exllamav3 stores it (read from exllamav3's CUDA sources,
``exllamav3_ext/quant/{codebook.cuh, exl3_dq.cuh, reconstruct.cu, pack.cu}`` and
``modules/quant/exl3.py``; no code copied):

- ``codebook_lut``: the 65,536 fp16 values of a codebook ("3inst", "mcg", "mul1") indexed by the
  16-bit trellis state, each with the single fp16 rounding the kernels do.
- ``unpack_states``: trellis ``[k/16, n/16, 16K]`` int16 -> 16-bit states ``[k/16, n/16, 256]``
  (position order). A tile is a circular MSB-first bitstream of 256*K bits held in little-endian
  uint32 words; state p is the 16-bit window that ends at bit (p+1)*K.
- ``decode_inner``: states -> the fp16 ``Wq`` ``[k, n]`` (``LinearEXL3.get_inner_weight_tensor``),
  placing position p of a tile at the tensor-core fragment coordinates (``tile_perm``).
- ``weight_fp16_like_exllamav3``: ``get_weight_tensor``'s sequence of fp16 roundings (the oracle
  shape of golden fixtures); ``dense_weight``: ``diag(suh) H Wq H diag(svh)`` evaluated in float64
  (what the CPU runtime uses). Orientation is exllamav3's ``(in, out)``: ``y = x @ W``.
"""

from __future__ import annotations

import math
from functools import cache

import torch

CODEBOOKS = ("3inst", "mcg", "mul1")
MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
_3INST_MULT, _3INST_ADD = 89226354, 64248484
_MASK, _XOR = 0x8FFF8FFF, 0x3B603B60
_MUL1_INV, _MUL1_BIAS = 0x1EEE, 0xC931  # fp16 bit patterns: 1/147.7 and (-1024 - 510) / 147.7
HAD = 128  # Hadamard block (exllamav3 had_k = had_n = 128)


def _half_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 tensor of 16-bit patterns -> float16 values."""
    return bits.to(torch.int32).to(torch.int16).view(torch.float16)


@cache
def codebook_lut(codebook: str) -> torch.Tensor:
    """fp16 value of every 16-bit state for ``codebook`` (CPU tensor [65536])."""
    s = torch.arange(65536, dtype=torch.int64)
    if codebook == "mul1":
        x = (s * MUL1_MULT) & 0xFFFFFFFF
        byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
        h = _half_from_bits(0x6400 + byte_sum).float()  # 1024 + byte sum, exact
        inv = _half_from_bits(torch.tensor(_MUL1_INV)).float()
        bias = _half_from_bits(torch.tensor(_MUL1_BIAS)).float()
        # __hfma: one rounding. h * inv + bias is exact in float32 (22-bit product, < 2^23 after the
        # add, both multiples of 2^-18), so rounding that to fp16 is the fused result.
        return (h * inv + bias).to(torch.float16)
    if codebook == "3inst":
        x = (s * _3INST_MULT + _3INST_ADD) & 0xFFFFFFFF
    elif codebook == "mcg":
        x = (s * MCG_MULT) & 0xFFFFFFFF
    else:
        raise ValueError(f"unknown EXL3 codebook '{codebook}' (one of {', '.join(CODEBOOKS)})")
    x = (x & _MASK) ^ _XOR  # lop3 0x6a: (a & b) ^ c
    lo, hi = _half_from_bits(x & 0xFFFF).float(), _half_from_bits(x >> 16).float()
    return (lo + hi).to(torch.float16)  # __hadd: the fp32 sum of two such halves is exact, one rounding


@cache
def tile_perm() -> torch.Tensor:
    """Row-major index (r * 16 + c) in a 16x16 tile of each trellis position p (0..255).

    Position p = 8 * l + j lands at row 2 (l % 4) + (j & 1) + 8 ((j >> 1) & 1), column l // 4 + 8 (j >> 2):
    the mma fragment order that ``reconstruct_kernel`` shuffles back (= exllamav3 ``tensor_core_perm``).
    """
    p = torch.arange(256)
    lane, j = p // 8, p % 8
    row = 2 * (lane % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    col = lane // 4 + 8 * (j >> 2)
    return row * 16 + col


def trellis_bits(trellis: torch.Tensor) -> int:
    """K (bits per weight) from a trellis' last dim (16 * K). Fractional K is refused."""
    last = int(trellis.shape[-1])
    if last % 16 or not 1 <= last // 16 <= 8:
        frac = (
            f" ({last / 16:g} bpw: exllamav3 1.6's fractional mul1 rates are not supported)" if last % 16 == 8 else ""
        )
        raise ValueError(f"trellis last dim {last} is not 16 * K for an integer K in 1..8{frac}")
    return last // 16


def unpack_states(trellis: torch.Tensor) -> torch.Tensor:
    """trellis [tk, tn, 16K] int16 -> int64 states [tk, tn, 256], one 16-bit window per position."""
    if trellis.dtype != torch.int16 or trellis.dim() != 3:
        raise ValueError(f"trellis must be a 3-d int16 tensor, got {tuple(trellis.shape)} {trellis.dtype}")
    K = trellis_bits(trellis)
    words = 8 * K  # uint32 words per tile
    u16 = trellis.to(torch.int64) & 0xFFFF
    w = u16[..., 0::2] | (u16[..., 1::2] << 16)  # little-endian uint32 words [tk, tn, 8K]
    # the window of position p ends at bit (p+1)K (made on the trellis' device: the decode runs on CUDA too)
    end = (torch.arange(256, dtype=torch.int64, device=trellis.device) + 1) * K
    i1 = (end - 1) // 32  # word holding the window's last bit (bit 0 = MSB of word 0)
    i0 = (i1 - 1) % words  # the word before it (circular)
    shift = (i1 + 1) * 32 - end  # 0..31: right shift aligning the window's end to bit 0
    a, b = w[..., i0] & 0xFFFF, w[..., i1]  # only a's low 16 bits can reach the window
    return ((a << (32 - shift)) | (b >> shift)) & 0xFFFF


def decode_inner(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """trellis [k/16, n/16, 16K] -> fp16 Wq [k, n] (before Hadamards and sign/scale vectors)."""
    states = unpack_states(trellis)
    tk, tn = states.shape[:2]
    vals = codebook_lut(codebook).to(states.device)[states]  # [tk, tn, 256] position order
    tiles = torch.empty_like(vals)
    tiles[..., tile_perm().to(states.device)] = vals  # row-major within the tile
    return tiles.view(tk, tn, 16, 16).permute(0, 2, 1, 3).reshape(tk * 16, tn * 16)


@cache
def hadamard(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The 128x128 Sylvester Hadamard matrix / sqrt(128) (exllamav3 ``get_hadamard(128)``); symmetric, orthogonal."""
    i = torch.arange(HAD)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    for k in range(7):
        parity ^= (bits >> k) & 1
    return ((1 - 2 * parity).to(torch.float64) / math.sqrt(HAD)).to(dtype)


def had_left(x: torch.Tensor) -> torch.Tensor:
    """Block-diagonal H @ x over the rows of x [k, n] (k a multiple of 128), in x's dtype."""
    k, n = x.shape
    return (hadamard(x.dtype).to(x.device) @ x.view(k // HAD, HAD, n)).view(k, n)


def had_right(x: torch.Tensor) -> torch.Tensor:
    """Block-diagonal x @ H over the columns of x [k, n] (n a multiple of 128), in x's dtype."""
    k, n = x.shape
    return (x.view(k, n // HAD, HAD) @ hadamard(x.dtype).to(x.device)).view(k, n)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Legacy ``su``/``sv`` int16 sign words -> fp16 +-1 (bit b of word i is element 16 i + b; set = -1)."""
    bits = (packed.to(torch.int64)[:, None] >> torch.arange(16, device=packed.device)) & 1
    return (1 - 2 * bits).flatten().to(torch.float16)


def weight_fp16_like_exllamav3(wq: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """``LinearEXL3.get_weight_tensor`` step by step: fp32 Hadamards rounded to fp16, fp16 scale products.

    Matches a GPU fixture to within the summation order of the two fp32 matmuls (an fp16 ulp at most
    in practice); ``wq`` must be the bit-exact inner weight.
    """
    w = had_left(wq.float()).half()
    w = w * suh.half()[:, None]
    w = had_right(w.float()).half()
    return w * svh.half()[None, :]


def dense_weight(wq: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """diag(suh) H Wq H diag(svh) in float64, ``(in, out)``: the linear's exact dense weight."""
    w = had_left(wq.double()) * suh.double()[:, None]
    return had_right(w) * svh.double()[None, :]
