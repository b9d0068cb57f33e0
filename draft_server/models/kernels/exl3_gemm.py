"""EXL3 trellis decode inside a Triton GEMM: ``C = A @ Wq`` reading only the packed trellis.

Owns ``exl3_matmul``, ``exl3_decode`` (Wq or Wq.T into a buffer, for a cuBLAS GEMM after it),
``hadamard_128`` (the 128-block rotations around both, with the sign/scale vectors, the input's
conversion and padding, and the residual add) and ``hadamard_swiglu`` (two outputs' rotations and the
SwiGLU activation in one pass).
``exl3_matmul``: A [M, k] fp16 (the Hadamard-rotated input, ``had_r_128(x, suh)``) times the
inner weight Wq [k, n] that the trellis [k/16, n/16, 16K] int16 encodes, into float32 C [M, n],
with Wq decoded tile by tile in registers and never written to memory. This is the ``recon`` path
(exllamav3's ``reconstruct`` into an fp16 scratch, then a cuBLAS GEMM) without its round trip of
2 bytes per weight through HBM: the bytes read are the trellis' K bits per weight and A.

Decode (the same math as ``exl3.decode``, which is bit-exact with exllamav3; see there):
the element at row r, column c of a 16x16 tile is trellis position p = 8 lane + j with
lane = 4 (c & 7) + ((r >> 1) & 3) and j = (r & 1) + 2 (r >> 3) + 4 (c >> 3) (the inverse of
``tile_perm``); its 16-bit state is the window of the tile's circular MSB-first bitstream
(little-endian uint32 words) that ends at bit (p + 1) K; the codebook turns the state into fp16
arithmetically (3inst and mcg: a multiply(-add), mask, xor and the sum of the two fp16 halves,
rounded once; mul1: 1024 + the byte sum of a product, times 1/147.7 plus a bias, rounded once).

Lanes (K in 1, 2, 4: ``LANE_BITS``): the eight states of a lane (j = 0..7) all lie in the two words
before and at the one holding its last state's last bit, so ``_lane_block`` loads those two words once
per lane as a 64-bit window and makes each state with one shift (``exl3_matmul`` loads each state's own
pair of words, two gathered loads per weight). It decodes in lane order: block rows kappa = 16 t +
4 ((r >> 1) & 3) + 2 (r >> 3) + (r & 1) and columns nu = 16 t + 2 (c & 7) + (c >> 3), so that a lane's
eight weights are one [4, 2] corner of a [BLOCK_K/4, 4, BLOCK_N/2, 2] tensor, and ``exl3_decode``
stores each weight at its (r, c). (The same decode inside the GEMM, A's columns gathered in kappa
order, was 1.1x slower than the per-element decode at 7 rows and 8x at 448 on an H100: the layout
conversions; removed.)

Each program owns a BLOCK_M x BLOCK_N block of C and walks its share of k, so with M <= BLOCK_M
every weight is decoded exactly once per call; when those blocks are too few to fill the GPU, k
is split among several programs whose float32 partials are summed in a fixed order. Runs under
Triton's interpreter on CPU (the tests check it against ``exl3.decode.decode_inner``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from draft_server.models.exl3.decode import hadamard

CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}
FLOATS = (torch.float16, torch.bfloat16, torch.float32)  # what the rotations read and write
MASK = 0x8FFF8FFF - (1 << 32)  # 3inst / mcg's mask, as the int32 kernel argument ``_codebook`` takes


@triton.jit
def _codebook(s, mask, CB: tl.constexpr):
    """16-bit states (uint32, high bits zero) -> fp16 weights, by codebook (module docstring). ``mask`` is
    0x8FFF8FFF passed in at run time: as a literal, ptxas rebuilt it in a register before every use."""
    if CB == 2:  # mul1
        x = s * 0x83DCD12D
        bsum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        h = (1024 + bsum).to(tl.float32)
        w = (h * 0.00676727294921875 - 10.3828125).to(tl.float16)  # fp16 0x1EEE, 0xC931: exact in fp32
    else:
        if CB == 1:  # mcg
            x = s * 0xCBAC1FED
        else:  # 3inst
            x = s * 89226354 + 64248484
        x = (x & mask) ^ 0x3B603B60
        lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        w = lo + hi  # one fp16 add: rounded once, as exllamav3's
    return w


@triton.jit
def _where(rows, cols, row_words, BITS: tl.constexpr):
    """Per (weight row in a k block, column): the tile's int32 offset from the block's first tile row, the
    in-tile indices of the two words holding the state (the one with its last bit, and the one before,
    circular), and the right shift of that 64-bit pair that leaves the state in its low 16 bits."""
    r = rows[:, None] % 16
    c = cols[None, :] % 16
    lane = 4 * (c & 7) + ((r >> 1) & 3)
    j = (r & 1) + 2 * (r >> 3) + 4 * (c >> 3)
    end = (8 * lane + j + 1) * BITS  # the state's window ends at this bit of the tile
    i1 = (end - 1) // 32
    i0 = tl.where(i1 == 0, 8 * BITS - 1, i1 - 1)
    shift = ((i1 + 1) * 32 - end).to(tl.uint64)  # 0..31
    tile = (rows[:, None] // 16) * row_words + (cols[None, :] // 16) * (8 * BITS)
    return tile, i0, i1, shift


@triton.jit
def _weights(t_ptr, tile, i0, i1, shift, mask, CB: tl.constexpr):
    w0 = tl.load(t_ptr + tile + i0).to(tl.uint32).to(tl.uint64)
    w1 = tl.load(t_ptr + tile + i1).to(tl.uint32).to(tl.uint64)
    return _codebook((((w0 << 32) | w1) >> shift).to(tl.uint32) & 0xFFFF, mask, CB)


@triton.jit
def _exl3_matmul_kernel(
    A, T, C, M, N, k_per_split, s_am, s_cm, s_cs, row_words, MASK,
    BITS: tl.constexpr, CB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    ps = tl.program_id(2)  # split of k: this program sums rows [ps * k_per_split, (ps + 1) * k_per_split)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    mask = MASK.to(tl.uint32)
    tile, i0, i1, shift = _where(kk, rn, row_words, BITS)  # hoisted out of the loop
    k_start = ps * k_per_split
    a_ptrs = A + rm[:, None].to(tl.int64) * s_am + (k_start + kk)[None, :]
    t_ptr = T + (k_start // 16).to(tl.int64) * row_words
    a_mask = rm[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        acc = tl.dot(a, _weights(t_ptr, tile, i0, i1, shift, mask, CB), acc)
        a_ptrs += BLOCK_K
        t_ptr += (BLOCK_K // 16) * row_words
    out = C + ps.to(tl.int64) * s_cs + rm[:, None].to(tl.int64) * s_cm + rn[None, :]
    tl.store(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _lane_block(T, t_row, pn, row_words, mask, BITS: tl.constexpr, CB: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):  # fmt: skip
    """One BLOCK_K x BLOCK_N block of Wq in lane order (module docstring, "Lanes"), decoded from tile row
    ``t_row`` on: per lane the two words holding all eight of its states are loaded once, as one 64-bit
    window, and each state is one shift of it. Returns fp16 [BLOCK_K, BLOCK_N], rows kappa, columns nu."""
    d0 = tl.arange(0, BLOCK_K // 4)  # 4 tile row + (r >> 1) & 3
    d2 = tl.arange(0, BLOCK_N // 2)  # 8 tile column + (c & 7)
    lane = 4 * (d2[None, :] & 7) + (d0[:, None] & 3)
    i1 = ((8 * lane + 8) * BITS - 1) // 32  # the word holding the lane's last state's last bit
    i0 = tl.where(i1 == 0, 8 * BITS - 1, i1 - 1)  # the word before it (circular)
    tile = (t_row + d0[:, None] // 4).to(tl.int64) * row_words + (pn * (BLOCK_N // 16) + d2[None, :] // 8) * (8 * BITS)
    w0 = tl.load(T + tile + i0).to(tl.uint32).to(tl.uint64)
    w1 = tl.load(T + tile + i1).to(tl.uint32).to(tl.uint64)
    v = (w0 << 32) | w1  # [BLOCK_K / 4, BLOCK_N / 2]: every state of the lane lies in these 64 bits
    jr = tl.arange(0, 4)  # j & 3 = (r & 1) + 2 (r >> 3)
    jc = tl.arange(0, 2)  # j >> 2 = c >> 3
    j = jr[None, None, :, None] + 4 * jc[None, None, None, :]
    end = (8 * lane[:, :, None, None] + j + 1) * BITS
    shift = (32 * (i1[:, :, None, None] + 1) - end).to(tl.uint64)  # 0..63 - 16 for K in 1, 2, 4
    s = ((v[:, :, None, None] >> shift) & 0xFFFF).to(tl.uint32)
    w = _codebook(s, mask, CB)  # [d0, d2, jr, jc]
    return tl.reshape(tl.permute(w, (0, 2, 1, 3)), (BLOCK_K, BLOCK_N))


@triton.jit
def _exl3_decode_kernel(T, W, ldw, row_words, MASK, BITS: tl.constexpr, CB: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, TRANS: tl.constexpr):  # fmt: skip
    """Wq's block (program_id(0) along k, (1) along n) into W: [k, n] fp16, or [n, k] with TRANS."""
    pk = tl.program_id(0)
    pn = tl.program_id(1)
    kap = tl.arange(0, BLOCK_K)  # kappa -> the weight row r in its tile, and nu -> the column c
    k_of = (kap // 16) * 16 + 8 * ((kap >> 1) & 1) + 2 * ((kap >> 2) & 3) + (kap & 1)
    nu = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_of = (nu // 16) * 16 + 8 * (nu & 1) + ((nu >> 1) & 7)
    w = _lane_block(T, pk * (BLOCK_K // 16), pn, row_words, MASK.to(tl.uint32), BITS, CB, BLOCK_N, BLOCK_K)
    k = (pk * BLOCK_K + k_of).to(tl.int64)
    if TRANS:
        tl.store(W + n_of[None, :].to(tl.int64) * ldw + k[:, None], w)
    else:
        tl.store(W + k[:, None] * ldw + n_of[None, :], w)


class KernelConfig(NamedTuple):
    """One launch shape: output block, k step, warps, pipeline stages, and how many programs per SM
    the k split aims for when the output blocks alone are too few. The defaults are the one shape
    within 1.04-1.3x of the best of 108 for every K3 linear at 7, 56, 112 and 448 rows on the H200
    (``bench/results/exl3_kernel_h200.json``); software-pipelining the gathered trellis loads (2 or
    3 stages; Triton's default before) made the kernel 10-20x slower."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 1
    per_sm: int = 8


LANE_BITS = (1, 2, 4)  # K whose lanes' eight states lie in two words: ``exl3_decode``


def exl3_matmul(
    a: torch.Tensor,
    trellis: torch.Tensor,
    codebook: str,
    block_m: int | None = None,
    split_k: int | None = None,
    config: KernelConfig | None = None,
    partials: bool = False,
) -> torch.Tensor:
    """``a [M, k] fp16 @ Wq [k, n]`` in float32, Wq decoded from ``trellis [k/16, n/16, 16K]`` int16 in place.
    ``partials``: the k split's float32 partials [split_k, M, n] unsummed (``hadamard_128`` and
    ``hadamard_swiglu`` sum them as they read them: no reduction kernel of its own).

    ``block_m``: rows per program (default: M up to 128, a power of two >= 16), so that up to that
    many rows decode every weight once. ``split_k``: programs per output block along k (default:
    enough to give every SM ``config.per_sm`` programs), whose float32 partials are summed in a
    fixed order (deterministic). ``config``: the launch shape (default: ``KernelConfig()``)."""
    if a.dtype != torch.float16 or a.dim() != 2 or a.stride(1) != 1:
        raise ValueError(f"a must be a 2-d fp16 matrix with contiguous rows, got {tuple(a.shape)} {a.dtype}")
    if trellis.dtype != torch.int16 or trellis.dim() != 3 or not trellis.is_contiguous():
        raise ValueError(f"trellis must be a contiguous 3-d int16 tensor, got {tuple(trellis.shape)}")
    tk, tn, last = trellis.shape
    if last % 16 or not 1 <= last // 16 <= 8:
        raise ValueError(f"trellis last dim {last}: expected 16 * K for an integer K in 1..8")
    if a.shape[1] != tk * 16:
        raise ValueError(f"a has {a.shape[1]} columns, the trellis encodes {tk * 16} rows")
    if codebook not in CODEBOOK_IDS:
        raise ValueError(f"unknown EXL3 codebook '{codebook}'")
    bits = last // 16
    m, n, kd = a.shape[0], tn * 16, tk * 16
    if m == 0:
        return torch.empty((0, n), dtype=torch.float32, device=a.device)
    cfg = config or KernelConfig()
    bm = block_m or max(16, min(128, triton.next_power_of_2(m)))
    bn, bk = cfg.block_n, cfg.block_k
    blocks = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if split_k is None:
        split_k = _split_for(blocks, kd // bk, cfg.per_sm, a.device)
    if kd % bk or (kd // bk) % split_k:
        raise ValueError(f"split_k {split_k} does not divide the {kd // bk} k blocks of {bk} rows")
    c = torch.empty((split_k, m, n), dtype=torch.float32, device=a.device)
    _exl3_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split_k)](
        a, trellis.view(torch.int32), c, m, n, kd // split_k, a.stride(0), c.stride(1), c.stride(0), tn * 8 * bits,
        MASK, BITS=bits, CB=CODEBOOK_IDS[codebook], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c if partials else c[0] if split_k == 1 else c.sum(0)


def exl3_decode(
    trellis: torch.Tensor, codebook: str, out: torch.Tensor | None = None, trans: bool = False, block: int = 64
) -> torch.Tensor:
    """Wq [k, n] fp16 (``trans``: Wq.T [n, k], ``nn.Linear``'s orientation) decoded from ``trellis
    [k/16, n/16, 16K]`` (K in ``LANE_BITS``) into ``out`` (a view of a scratch buffer) or a new tensor."""
    if trellis.dtype != torch.int16 or trellis.dim() != 3 or not trellis.is_contiguous():
        raise ValueError(f"trellis must be a contiguous 3-d int16 tensor, got {tuple(trellis.shape)}")
    tk, tn, last = trellis.shape
    bits = last // 16
    if last % 16 or bits not in LANE_BITS:
        raise ValueError(f"trellis last dim {last}: the decode kernel takes K in {LANE_BITS}")
    if codebook not in CODEBOOK_IDS:
        raise ValueError(f"unknown EXL3 codebook '{codebook}'")
    kd, n = tk * 16, tn * 16
    shape = (n, kd) if trans else (kd, n)
    if out is None:
        out = torch.empty(shape, dtype=torch.float16, device=trellis.device)
    elif out.shape != shape or out.dtype != torch.float16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp16 {shape}, got {tuple(out.shape)} {out.dtype}")
    bk = bn = block
    if kd % bk or n % bn:
        raise ValueError(f"block {block} does not divide the weight {kd} x {n}")
    _exl3_decode_kernel[(kd // bk, n // bn)](
        trellis.view(torch.int32), out, shape[1], tn * 8 * bits, MASK,
        BITS=bits, CB=CODEBOOK_IDS[codebook], BLOCK_N=bn, BLOCK_K=bk, TRANS=trans, num_warps=4,
    )  # fmt: skip
    return out


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_for(blocks: int, k_blocks: int, per_sm: int, device: torch.device) -> int:
    """The largest power-of-two split of k (up to 16) that divides its blocks and keeps at most
    ``per_sm`` programs per SM; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    split = 1
    while split < 16 and blocks * (2 * split) <= per_sm * sms and k_blocks % (2 * split) == 0:
        split *= 2
    return split


@triton.jit
def _rotate(x_rows, cols, mask, h, PRE, POST, K_IN, K, S, s_s, HAS_PRE: tl.constexpr, HAS_POST: tl.constexpr):
    """One BLOCK_R x 128 block: H128(x * pre) * post in float32 through two fp16 products with the +-1 matrix
    h (x's fp16 head and its remainder), so an fp32 input keeps about 22 bits. x is the sum of S partials
    ``s_s`` apart (a k-split GEMM's; in order, in float32); its columns from K_IN to K read as zeros
    (exllamav3's padding)."""
    x = tl.load(x_rows + cols[None, :], mask=mask & (cols[None, :] < K_IN), other=0.0).to(tl.float32)
    for s in range(1, S):
        x += tl.load(x_rows + s * s_s + cols[None, :], mask=mask & (cols[None, :] < K_IN), other=0.0).to(tl.float32)
    if HAS_PRE:
        x = x * tl.load(PRE + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
    head = x.to(tl.float16)
    rest = (x - head.to(tl.float32)).to(tl.float16)
    y = (tl.dot(head, h) + tl.dot(rest, h)) * 0.08838834764831845  # 1 / sqrt(128)
    if HAS_POST:
        y = y * tl.load(POST + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def _hadamard_kernel(X, Y, H, PRE, POST, ADD, R, K_IN, K, S, s_s, s_x, s_y, s_a,
                     HAS_PRE: tl.constexpr, HAS_POST: tl.constexpr, HAS_ADD: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCKS: tl.constexpr):  # fmt: skip
    """BLOCK_R rows x BLOCKS 128-column blocks of y = H128(x * pre) * post (+ add), rounded once into Y."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    i = tl.arange(0, 128)
    h = tl.load(H + i[:, None] * 128 + i[None, :])
    x_rows = X + rows[:, None].to(tl.int64) * s_x
    y_rows = Y + rows[:, None].to(tl.int64) * s_y
    for b in range(BLOCKS):
        cols = (tl.program_id(1) * BLOCKS + b) * 128 + i
        mask = (rows[:, None] < R) & (cols[None, :] < K)
        y = _rotate(x_rows, cols, mask, h, PRE, POST, K_IN, K, S, s_s, HAS_PRE, HAS_POST)
        if HAS_ADD:
            y += tl.load(ADD + rows[:, None].to(tl.int64) * s_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _hadamard_swiglu_kernel(G, U, Y, H, PG, PU, R, K, S_G, s_gs, S_U, s_us, s_g, s_u, s_y, BLOCK_R: tl.constexpr,
                            BLOCKS: tl.constexpr):  # fmt: skip
    """silu(H128(g) * pg) * (H128(u) * pu), each rotated product rounded to Y's dtype first (as
    ``kernels.fused.silu_mul_parts`` rounds its inputs), the activation too, the product once."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    i = tl.arange(0, 128)
    h = tl.load(H + i[:, None] * 128 + i[None, :])
    g_rows = G + rows[:, None].to(tl.int64) * s_g
    u_rows = U + rows[:, None].to(tl.int64) * s_u
    y_rows = Y + rows[:, None].to(tl.int64) * s_y
    for b in range(BLOCKS):
        cols = (tl.program_id(1) * BLOCKS + b) * 128 + i
        mask = (rows[:, None] < R) & (cols[None, :] < K)
        g = _rotate(g_rows, cols, mask, h, PG, PG, K, K, S_G, s_gs, False, True).to(Y.dtype.element_ty).to(tl.float32)
        u = _rotate(u_rows, cols, mask, h, PU, PU, K, K, S_U, s_us, False, True).to(Y.dtype.element_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        tl.store(y_rows + cols[None, :], (act * u).to(Y.dtype.element_ty), mask=mask)


@functools.cache
def _signs_128(device: torch.device) -> torch.Tensor:
    """``exl3.decode.hadamard``'s matrix unnormalised (+-1, exact in fp16)."""
    return torch.sign(hadamard(torch.float64)).to(torch.float16).to(device)


def hadamard_128(
    x: torch.Tensor,
    pre: torch.Tensor | None = None,
    post: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = H128(x * pre) * post (+ add)`` over each row's 128-column blocks (H orthonormal, exllamav3's
    ``had_r_128`` with scale 1), computed in float32 and rounded once. x fp16, bf16 or fp32 [R, w] with
    contiguous rows, or [S, R, w]: the sum of S partials (``exl3_matmul(partials=True)``); ``out`` [R, k]
    with k the 128-multiple >= w (x zero-extended, as exllamav3 pads), of ``dtype`` (default x's) or
    ``out``'s; ``out`` may be a 2-d x; ``add`` [R, k] (a residual). So ``hadamard_128(x_bf16, suh,
    dtype=torch.float16)`` is the rotated fp16 input of an EXL3 GEMM in one pass, the conversion and
    padding included, and ``hadamard_128(c, post=svh, add=h, dtype=h.dtype)`` its output rotated and
    added to the residual stream in one."""
    x3 = _splits(x, "x")
    n_s, r, w = x3.shape
    k = -(-w // 128) * 128
    if out is None:
        out = torch.empty((r, k), dtype=dtype or x.dtype, device=x.device)
    if out.shape != (r, k) or out.stride(1) != 1 or out.dtype not in FLOATS or (dtype and out.dtype != dtype):
        raise ValueError(f"out must be a {dtype or 'float'} ({r}, {k}) with contiguous rows, got {tuple(out.shape)}")
    for v in (pre, post):
        if v is not None and v.shape != (k,):
            raise ValueError(f"scale vectors must have {k} values, got {tuple(v.shape)}")
    if add is not None and (add.shape != (r, k) or add.stride(1) != 1):
        raise ValueError(f"add must be ({r}, {k}) with contiguous rows, got {tuple(add.shape)}")
    if r == 0 or k == 0:
        return out
    block_r, blocks = _hadamard_grid(r, k)
    _hadamard_kernel[(triton.cdiv(r, block_r), triton.cdiv(k // 128, blocks))](
        x3, out, _signs_128(x.device), pre if pre is not None else out, post if post is not None else out,
        add if add is not None else out, r, w, k, n_s, x3.stride(0), x3.stride(1), out.stride(0),
        add.stride(0) if add is not None else 0, HAS_PRE=pre is not None, HAS_POST=post is not None,
        HAS_ADD=add is not None, BLOCK_R=block_r, BLOCKS=blocks, num_warps=4,
    )  # fmt: skip
    return out


def _splits(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [R, w] or [S, R, w] (partials to sum) as [S, R, w], checked: float, contiguous rows."""
    x3 = x if x.dim() == 3 else x.unsqueeze(0) if x.dim() == 2 else None
    if x3 is None or (x3.stride(2) != 1 and x3.shape[2] > 1) or x.dtype not in FLOATS:
        raise ValueError(f"{name} must be a fp16, bf16 or fp32 [R, w] or [S, R, w] with contiguous rows, got"
                         f" {tuple(x.shape)} {x.dtype}")  # fmt: skip
    return x3


def _hadamard_grid(r: int, k: int) -> tuple[int, int]:
    """Rows a program (16-64) and 128-column blocks a program (several where there are plenty)."""
    return max(16, min(64, triton.next_power_of_2(r))), 4 if k >= 4 * 128 * 32 else 1


def hadamard_swiglu(
    g: torch.Tensor, u: torch.Tensor, post_g: torch.Tensor, post_u: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """silu(H128(g) * post_g) * (H128(u) * post_u) in ``dtype``: two EXL3 products' output rotations and the
    SwiGLU activation in one pass (each rotated product and the activation rounded to ``dtype`` first, as
    ``hadamard_128`` then ``kernels.fused.silu_mul_parts`` round them). g, u [R, k] (k a 128-multiple), or
    [S, R, k] partials to sum (``exl3_matmul(partials=True)``), each its own S."""
    g3, u3 = _splits(g, "gate"), _splits(u, "up")
    if g3.shape[1:] != u3.shape[1:] or g3.shape[2] % 128:
        raise ValueError(f"gate and up must be [R, 128 m] alike, got {tuple(g.shape)}, {tuple(u.shape)}")
    r, k = g3.shape[1:]
    if post_g.shape != (k,) or post_u.shape != (k,):
        raise ValueError(f"scale vectors must have {k} values")
    out = torch.empty((r, k), dtype=dtype, device=g.device)
    if r:
        block_r, blocks = _hadamard_grid(r, k)
        _hadamard_swiglu_kernel[(triton.cdiv(r, block_r), triton.cdiv(k // 128, blocks))](
            g3, u3, out, _signs_128(g.device), post_g, post_u, r, k, g3.shape[0], g3.stride(0), u3.shape[0],
            u3.stride(0), g3.stride(1), u3.stride(1), out.stride(0), BLOCK_R=block_r, BLOCKS=blocks, num_warps=4,
        )  # fmt: skip
    return out
