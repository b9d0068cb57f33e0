"""DSpark draft-block attention over the paged KV cache: Triton kernels and their torch oracle.

Owns the attention of a batch's draft blocks against the paged cache, for both cache layouts:

* MLA (Kimi-K3 DSpark), absorbed form: the cache row is the latent ``[kv_lora | rope]`` (576 = 512 + 64
  on K3); keys are the whole row, values its first ``kv_lora`` dims; q is ``[N, Bq, H, kv_lora + rope]``
  (the nope part already multiplied by W_UK) and the output ``[N, Bq, H, kv_lora]``.
* GQA (Qwen3 DSpark): cache ``[pages, P, 2, kv_heads, head_dim]`` (0 = K, 1 = V), q and out
  ``[N, Bq, H, head_dim]``, query head h reads kv head ``h // (H // kv_heads)``.

Visibility: row b of session n (absolute position ``pos[n] + b``) sees the cached positions t with
``lo[n] <= t < pos[n] + (b + 1 if causal else width[n])`` (``width``: the block rows in use, at most
Bq; vLLM runs a block of the k drafts it asks for, and the block is not causal). The caller has
already written the block's own keys/values at ``[pos[n], pos[n] + Bq)``. Nothing else is read:
every load outside a session's ``[lo, pos + Bq)`` is masked (``other=0``) and every invisible score
is set to -inf, so NaN/Inf in other slots, other sessions' pages, stale pages or padding block-table
entries never reach an output.
(The block's own rows must be finite even where causality hides them from a row: a tile of values is
shared by all rows, and 0 * Inf would be NaN. They are the caller's freshly written keys, so they are.)
Position t of session n lives in physical page ``block_table[n, t // P - first_page[n]]`` at offset
``t % P``. A session with ``lo > pos`` (or ``lo < 0``) is padding: it gets no work and a zero output.

Split-K (flash-decoding) so that a batch costs the sum of its contexts, not N x the longest one:
``plan_work`` cuts each session's ``[lo, pos + Bq)`` into chunks of ``chunk`` tokens (page-aligned:
chunk c covers ``[lo//P*P + c*chunk, ... + chunk)``) and lists them in a work table padded to a fixed
``capacity`` with dummy items (session -1). Stage 1 runs one program per (pair block, work item),
where a pair is a (head, row) of the session, ``BLOCK_M`` pairs forming the M dim of ``tl.dot`` so
every K/V tile is read once per pair block and feeds the tensor cores. A session with a single chunk
is finished in stage 1 (written straight into ``out``); otherwise stage 1 writes the chunk's
normalised float32 output and its log2-sum-exp to the workspace and stage 2 merges a session's
chunks in order. All varying data comes from tensors (lo, pos, block_table, the work table), grids
depend only on shapes and ``capacity``, and with ``plan``/``workspace``/``out`` given nothing is
allocated, so a whole draft step can be captured in a CUDA graph per (N bucket, capacity bucket).
If a plan's work does not fit its capacity the sessions that did not fit get NaN outputs (loud,
never silently wrong); ``plan.total`` holds the real count, and ``max_work_items`` sizes it.

Each session's result depends only on its own inputs (its chunks, in a fixed order), so it is the
same, bitwise, whatever else is in the batch and whatever the capacity.

``reference_paged_attention`` is the eager torch oracle (gather + masked softmax, float64 by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Launch shape of the two stages (the knobs to sweep on the GPU).

    block_m: (head, row) pairs per stage-1 program, the M of ``tl.dot`` (power of two, >= 16).
    block_n: cache tokens per tile (power of two, >= 16 on GPU; may span several pages).
    num_warps / num_stages: stage-1 launch options (num_stages = software-pipelining depth).
    combine_block_p / combine_num_warps: pairs per stage-2 program and its warps.
    """

    block_m: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    combine_block_p: int = 8
    combine_num_warps: int = 4


# Defaults measured on one H200 (triton 3.6, torch 2.11, bf16, P=16, Bq=7, causal), timing stage 1 +
# stage 2 with the plan prebuilt, on 1x32K + 63x1K, 64x1K, 1x32K and 8x4K contexts.
# K3 (H=64 -> 448 pairs = 7 blocks of 64, latent 512 + 64) is compute-bound: 36 tile shapes swept;
# (64, 64, 8 warps, 2 stages) was fastest everywhere (~135-157 TFLOP/s; 255 registers, 34 spilled);
# (64, 32, 8, 2) is ~20% slower, block_m 128 or block_n 128 do not fit in shared memory. Swept again
# with the value dims split over 2 or 4 programs (scores recomputed, fewer registers): slower at
# every batch (bench/results/mla_sweep_h200.json), so that variant is gone. 16 warps, or 1, 3, 4
# stages: slower at 64 x 1K (step_anatomy_h200.json). A two-pass form (scores + softmax writing the
# probabilities, then the value product over 2-8 programs, so no 512-wide accumulator beside the
# scores) was built, tested against this kernel and timed per bucket on the H200: slower at every
# bucket but 8 sessions (64 x 1K: 0.67-0.76 ms against 0.50; draft_step_h200_v5.json
# ``mla_tuning_ms``), so it is gone too.
MLA_CONFIG = KernelConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
# float32 inputs (tests, debugging) need twice the shared memory: 64-token tiles do not fit at K3 dims.
MLA_CONFIG_FP32 = KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
# One session's batch (split-K chunks of 128): 32-token tiles, 3 stages. At 1 x 1K, stage 1 + 2:
# 0.0315 ms per layer against 0.0423 for MLA_CONFIG at its 64-token chunks (mla_sweep_h200_v3.json);
# from 2 sessions MLA_CONFIG is faster. Half-precision only (float32 needs twice the shared memory).
MLA_CONFIG_ONE = KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=3)
# Qwen3-8B (8 kv heads x group 4 x Bq 7 = 28 pairs per kv head, head_dim 128) is memory-bound:
# 27 shapes swept; (32, 64, 2 warps, 3-4 stages) was fastest (1.7-2.4 TB/s of HBM reads).
GQA_CONFIG = KernelConfig(block_m=32, block_n=64, num_warps=2, num_stages=3)
# Split-K chunk (tokens, a multiple of the page size). Longer chunks mean fewer partials to write
# and merge (K3: Bq*H*512 floats = 0.9 MB per MLA chunk) but fewer programs for short batches.
# Measured (MLA, us at chunk 512/1024/2048): 1x32K+63x1K 724/666/610, 1x32K 299/236/210,
# 8x4K 237/217/211; GQA (256/512/1024): 241/192/167, 130/80/74, 72/74/71. The defaults keep
# small batches parallel (one 8K session is 56 MLA programs at 1024, 28 at 2048).
MLA_CHUNK = 1024
GQA_CHUNK = 512


# ---------------------------------------------------------------------------------------------
# Work plan and workspace
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class WorkPlan:
    """The split-K work table of one batch (shared by every layer of a draft step).

    work: int32 [capacity, 2], (session, chunk) per item; dummy items are (-1, 0).
    nchunks: int32 [N], chunks of each session (0 for padding sessions).
    offsets: int32 [N], index of each session's first item in ``work``.
    total: int32 [1], real items (> capacity means the plan overflowed: those sessions get NaN).
    """

    work: torch.Tensor
    nchunks: torch.Tensor
    offsets: torch.Tensor
    total: torch.Tensor
    rows: int
    chunk: int
    page_size: int

    @property
    def capacity(self) -> int:
        return int(self.work.shape[0])

    @property
    def num_sessions(self) -> int:
        return int(self.nchunks.shape[0])

    @classmethod
    def empty(
        cls, num_sessions: int, capacity: int, *, rows: int, chunk: int, page_size: int, device: torch.device | str
    ) -> WorkPlan:
        """Preallocated buffers for ``plan_work(..., out=plan)`` (e.g. one per CUDA-graph bucket)."""
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        i32 = torch.int32
        return cls(
            work=torch.empty((capacity, 2), dtype=i32, device=device),
            nchunks=torch.empty((num_sessions,), dtype=i32, device=device),
            offsets=torch.empty((num_sessions,), dtype=i32, device=device),
            total=torch.empty((1,), dtype=i32, device=device),
            rows=rows,
            chunk=chunk,
            page_size=page_size,
        )


@dataclass(slots=True)
class Workspace:
    """Stage-1 partials: float32 ``partial_out [capacity, pairs, v_dim]`` and ``partial_lse [capacity, pairs]``.

    pairs = Bq * H (pair p = h * Bq + b). A workspace at least as large in every dim can be shared by
    every layer and by both layouts (the kernels read its strides).
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor

    @classmethod
    def allocate(cls, capacity: int, pairs: int, v_dim: int, device: torch.device | str) -> Workspace:
        return cls(
            partial_out=torch.empty((capacity, pairs, v_dim), dtype=torch.float32, device=device),
            partial_lse=torch.empty((capacity, pairs), dtype=torch.float32, device=device),
        )

    def check(self, capacity: int, pairs: int, v_dim: int) -> None:
        po, pl = self.partial_out, self.partial_lse
        if po.dtype != torch.float32 or pl.dtype != torch.float32:
            raise ValueError("workspace buffers must be float32")
        if po.dim() != 3 or po.shape[0] < capacity or po.shape[1] < pairs or po.shape[2] < v_dim:
            raise ValueError(f"partial_out {tuple(po.shape)} too small for ({capacity}, {pairs}, {v_dim})")
        if pl.dim() != 2 or pl.shape[0] < capacity or pl.shape[1] < pairs:
            raise ValueError(f"partial_lse {tuple(pl.shape)} too small for ({capacity}, {pairs})")
        if po.stride(2) != 1 or pl.stride(1) != 1:
            raise ValueError("workspace buffers need a contiguous last dim")


def max_work_items(context_lens: list[int] | torch.Tensor, *, rows: int, chunk: int, page_size: int) -> int:
    """Upper bound on ``plan.total`` for sessions whose ``pos - lo`` are at most ``context_lens`` (host ints).

    Use it to pick a capacity bucket without reading the device: each session needs at most
    ``ceil((ctx + rows + page_size - 1) / chunk)`` chunks.
    """
    lens = context_lens.tolist() if isinstance(context_lens, torch.Tensor) else list(context_lens)
    return sum(-(-(int(c) + rows + page_size - 1) // chunk) for c in lens)


@triton.jit
def _plan_kernel(
    LO,
    POS,
    WORK,
    NCH,
    OFF,
    TOTAL,
    n_seqs,
    capacity,
    ROWS: tl.constexpr,
    PAGE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Program s < N writes session s's items; program N writes the total and the dummy tail."""
    sid = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    smask = s < n_seqs
    lo = tl.load(LO + s, mask=smask, other=1)
    pos = tl.load(POS + s, mask=smask, other=0)
    active = smask & (lo >= 0) & (lo <= pos)
    base = (lo // PAGE) * PAGE
    nch = tl.where(active, (pos + ROWS - base + CHUNK - 1) // CHUNK, 0)
    j = tl.arange(0, BLOCK_J)
    if sid < n_seqs:
        off = tl.sum(tl.where(s < sid, nch, 0), 0)
        mine = tl.sum(tl.where(s == sid, nch, 0), 0)
        tl.store(NCH + sid, mine)
        tl.store(OFF + sid, off)
        for j0 in range(0, mine, BLOCK_J):
            w = off + j0 + j
            wmask = (j0 + j < mine) & (w < capacity)
            tl.store(WORK + 2 * w, sid + j * 0, mask=wmask)
            tl.store(WORK + 2 * w + 1, j0 + j, mask=wmask)
    else:
        total = tl.sum(nch, 0)
        tl.store(TOTAL, total)
        for w0 in range(total, capacity, BLOCK_J):
            w = w0 + j
            wmask = w < capacity
            tl.store(WORK + 2 * w, j * 0 - 1, mask=wmask)
            tl.store(WORK + 2 * w + 1, j * 0, mask=wmask)


def _as_i32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int32 and x.is_contiguous() else x.to(torch.int32).contiguous()


def plan_work(
    lo: torch.Tensor,
    pos: torch.Tensor,
    *,
    rows: int,
    chunk: int,
    page_size: int,
    capacity: int | None = None,
    out: WorkPlan | None = None,
) -> WorkPlan:
    """Build the split-K work table on the device (one tiny kernel of N + 1 programs, no host sync when sized).

    lo, pos: int32 [N] (other int dtypes are converted, which allocates). rows = Bq. chunk must be a
    multiple of page_size. capacity: the padded table length (static grid); None sizes it exactly,
    which reads the device once (eager use only). ``out``: a ``WorkPlan.empty`` to fill in place
    (its capacity wins; must match rows/chunk/page_size).
    """
    if chunk <= 0 or page_size <= 0 or chunk % page_size:
        raise ValueError(f"chunk ({chunk}) must be a positive multiple of page_size ({page_size})")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size ({page_size}) must be a power of two")
    lo, pos = _as_i32(lo), _as_i32(pos)
    n = int(lo.shape[0])
    if pos.shape != lo.shape or lo.dim() != 1:
        raise ValueError("lo and pos must be [N] tensors")
    if out is None:
        if capacity is None:
            base = torch.div(lo, page_size, rounding_mode="floor") * page_size
            need = torch.where(
                (lo >= 0) & (lo <= pos), torch.div(pos + rows - base + chunk - 1, chunk, rounding_mode="floor"), 0
            )
            capacity = max(1, int(need.sum().item()))
        out = WorkPlan.empty(n, capacity, rows=rows, chunk=chunk, page_size=page_size, device=lo.device)
    elif (out.rows, out.chunk, out.page_size, out.num_sessions) != (rows, chunk, page_size, n):
        raise ValueError("plan buffers were made for another rows/chunk/page_size/N")
    grid = (n + 1,)
    _plan_kernel[grid](
        lo,
        pos,
        out.work,
        out.nchunks,
        out.offsets,
        out.total,
        n,
        out.capacity,
        ROWS=rows,
        PAGE=page_size,
        CHUNK=chunk,
        BLOCK_S=max(16, triton.next_power_of_2(max(n, 1))),
        BLOCK_J=128,
        num_warps=4,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _stage_kernel(
    SCALARS, PAGES, IDS, POSITIONS, SLOTS, n_max, mask_id, trash_slot,
    ROWS: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program i: row inputs of session i (ids, positions, slots), or of a padding session when
    i >= the real count (ids 0, positions 0, slots in the trash page)."""
    i = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    jm = j < ROWS
    real = (j * 0 + i) < tl.load(SCALARS + 6 * n_max)  # a block, as the interpreter's masks must be
    anchor = tl.load(SCALARS + i)
    t0 = tl.load(SCALARS + n_max + i)
    pos = tl.load(SCALARS + 3 * n_max + i)
    used = -tl.load(SCALARS + 4 * n_max + i)
    rel = pos + j
    page = tl.load(PAGES + used + rel // PAGE, mask=jm & real, other=0)
    slot = tl.where(real, page * PAGE + rel % PAGE, trash_slot)
    ids = tl.where(real, tl.where(j == 0, anchor, mask_id), 0)
    tl.store(IDS + i * ROWS + j, ids, mask=jm)
    tl.store(POSITIONS + i * ROWS + j, tl.where(real, t0 + j, 0), mask=jm)
    tl.store(SLOTS + i * ROWS + j, slot, mask=jm)


def stage_rows(
    scalars: torch.Tensor,
    pages: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    *,
    mask_id: int,
    trash_slot: int,
    page_size: int,
) -> None:
    """A draft batch's row inputs from its per-session scalars, on the device (one launch of
    ``ids.shape[0]`` programs; nothing read back, so it can be captured).

    ``scalars``: int32 ``[6 * n_max + 1]``: anchor, first absolute position, lo, pos (from the first
    page's offset 0), first (minus the session's offset in ``pages``), width, each ``[n_max]``, then
    the count of real sessions. ``pages``: the batch's ragged page list. Writes ``ids`` (anchor then
    ``mask_id``), ``positions`` (absolute) and ``slots`` (where the block's rows go in the cache),
    each int32 ``[N, rows]``; sessions past the count are padding (0, 0, ``trash_slot``)."""
    n, rows = ids.shape
    n_max = (scalars.shape[0] - 1) // 6
    _stage_kernel[(n,)](
        scalars, pages, ids, positions, slots, n_max, mask_id, trash_slot,
        ROWS=rows, PAGE=page_size, BLOCK=triton.next_power_of_2(rows), num_warps=1,
    )  # fmt: skip


@triton.jit
def _ingest_rows_kernel(
    SPEC, OUT, r_max, trash_slot, PAGE: tl.constexpr, BLOCK: tl.constexpr, SEARCH: tl.constexpr
):  # fmt: skip
    """Program b: rows b*BLOCK.. of an ingest bucket. A row below the real count r finds its item by a
    binary search over the items' first rows, then its position and cache slot through the item's pages;
    a row past r is padding (slot in the trash page, position 0)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(SPEC + i * 0)  # items, as a block (the interpreter's masks must be)
    r = tl.load(SPEC + 1 + i * 0)
    real = i < r
    lo = i * 0
    hi = n
    for _ in tl.static_range(SEARCH):  # row0[lo] <= i < row0[hi] (row0[n] = r); ends with hi = lo + 1
        active = hi - lo > 1
        mid = (lo + hi) // 2
        v = tl.load(SPEC + 2 + mid, mask=active & real, other=0)
        up = active & (v <= i)
        lo = tl.where(up, mid, lo)
        hi = tl.where(active & ~up, mid, hi)
    row0 = tl.load(SPEC + 2 + lo, mask=real, other=0)
    t = tl.load(SPEC + 2 + n + lo, mask=real, other=0) + (i - row0)
    rel = t - tl.load(SPEC + 2 + 2 * n + lo, mask=real, other=0)
    page = tl.load(SPEC + 2 + 3 * n + rel // PAGE, mask=real, other=0)
    tl.store(OUT + i, tl.where(real, page * PAGE + rel % PAGE, trash_slot), mask=i < r_max)
    tl.store(OUT + r_max + i, tl.where(real, t, 0), mask=i < r_max)


def ingest_rows(spec: torch.Tensor, out: torch.Tensor, rows: int, *, trash_slot: int, page_size: int) -> None:
    """An ingest's cache slots and positions from its per-item description, on the device (nothing read
    back, so it can be captured with the ingest's graph).

    ``spec``: int32, ``[n, r, row0[n], first[n], base[n], pages...]``: n items of r rows in all, item j
    the rows ``row0[j]..row0[j+1]`` (row0[0] = 0, ascending; the last ends at r) at absolute positions
    ``first[j]`` onward, position t in page ``pages[(t - base[j]) // P]`` at offset ``(t - base[j]) % P``
    (base: the position at offset 0 of the item's first page, less P times its offset in ``pages``).
    ``out``: int32 ``[2 * r_max]``, slots then positions; rows ``0..rows`` are written, those past r as
    padding (the trash slot, position 0)."""
    r_max = out.shape[0] // 2
    block = 128
    _ingest_rows_kernel[(triton.cdiv(rows, block),)](
        spec, out, r_max, trash_slot, PAGE=page_size, BLOCK=block, SEARCH=max(1, r_max.bit_length()), num_warps=4,
    )  # fmt: skip


@triton.jit
def _softmax_step(s, vis, m_i, l_i):
    """One online-softmax step in the log2 domain; rows with nothing visible yet stay at m=-inf, l=0."""
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def _stage1_epilogue(
    acc,
    m_i,
    l_i,
    single,
    out_rows,
    po_rows,
    pl_ptrs,
    d,
    pmask,
    dmask,
):
    """Single-chunk session: the final output straight into ``out``; else the chunk's partial + lse."""
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]
    mask = pmask[:, None] & dmask[None, :]
    if single:
        tl.store(out_rows[:, None] + d[None, :], o.to(out_rows.dtype.element_ty), mask=mask)
    else:
        tl.store(po_rows[:, None] + d[None, :], o, mask=mask)
        tl.store(pl_ptrs, tl.where(has, m_i + tl.log2(l_safe), float("-inf")), mask=pmask)


@triton.jit
def _chunk_span(LO, POS, FIRST, NCH, n, c, PAGE: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr):
    """Work item (session n, chunk c): its anchor position, first logical page, chunk count, and the
    chunk's tokens [c0, c1) of which [start, c1) are the session's."""
    lo = tl.load(LO + n)
    pos = tl.load(POS + n)
    first = tl.load(FIRST + n)
    nch = tl.load(NCH + n)
    c0 = (lo // PAGE) * PAGE + c * CHUNK
    c1 = tl.minimum(c0 + CHUNK, pos + ROWS)
    start = tl.maximum(c0, lo)
    return pos, first, nch, c0, c1, start


@triton.jit
def _tile_rows(KV, bt_row, t0, start, c1, first, max_pages, stride_kvp, stride_kvt, PAGE: tl.constexpr,
               BLOCK_N: tl.constexpr):  # fmt: skip
    """Tokens t0 .. t0 + BLOCK_N: their positions, which are the session's, and their cache rows."""
    t = t0 + tl.arange(0, BLOCK_N)
    lp = t // PAGE - first
    tmask = (t >= start) & (t < c1) & (lp >= 0) & (lp < max_pages)
    page = tl.load(bt_row + lp, mask=tmask, other=0)
    return t, tmask, KV + page.to(tl.int64) * stride_kvp + (t % PAGE) * stride_kvt


@triton.jit
def _mla_queries(
    Q, QR, WID, n, pos, pid_m, stride_qn, stride_qb, stride_qh, stride_rn, stride_rb, stride_rh,
    ROWS: tl.constexpr, HEADS: tl.constexpr, KV_LORA: tl.constexpr, ROPE: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_DR: tl.constexpr,
):  # fmt: skip
    """A program's (head, row) pairs (pair = h * ROWS + b), where each row's visibility ends, and their
    latent and rope queries."""
    p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pmask = p < ROWS * HEADS
    h = p // ROWS
    b = p % ROWS
    if CAUSAL:
        row_end = pos + b + 1
    else:  # the whole block sees its first WID rows (vLLM's block is the k it was asked for)
        row_end = pos + tl.load(WID + n) + b * 0
    dl = tl.arange(0, BLOCK_DL)
    dr = tl.arange(0, BLOCK_DR)
    n64 = n.to(tl.int64)
    q_rows = Q + n64 * stride_qn + b * stride_qb + h * stride_qh
    qr_rows = QR + n64 * stride_rn + b * stride_rb + h * stride_rh
    q_nope = tl.load(q_rows[:, None] + dl[None, :], mask=pmask[:, None] & (dl < KV_LORA)[None, :], other=0.0)
    q_rope = tl.load(qr_rows[:, None] + dr[None, :], mask=pmask[:, None] & (dr < ROPE)[None, :], other=0.0)
    return p, pmask, h, b, row_end, q_nope, q_rope


@triton.jit
def _mla_tile(
    kv_rows, t, tmask, row_end, q_nope, q_rope, m_i, l_i, qk_scale, KV_LORA: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_DL: tl.constexpr, BLOCK_DR: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """One tile's latent rows (the values too: their first kv_lora dims), its 576-dim scores as a
    512 + 64 pair of dots, and the online-softmax step over them."""
    dl = tl.arange(0, BLOCK_DL)
    dr = tl.arange(0, BLOCK_DR)
    kv = tl.load(kv_rows[:, None] + dl[None, :], mask=tmask[:, None] & (dl < KV_LORA)[None, :], other=0.0)
    kr = tl.load(kv_rows[:, None] + KV_LORA + dr[None, :], mask=tmask[:, None] & (dr < ROPE)[None, :], other=0.0)
    s = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PREC)
    s = tl.dot(q_rope, tl.trans(kr), s, input_precision=DOT_PREC)
    vis = tmask[None, :] & (t[None, :] < row_end[:, None])
    pr, alpha, m_i, l_i = _softmax_step(s * qk_scale, vis, m_i, l_i)
    return kv, pr, alpha, m_i, l_i


@triton.jit
def _mla_stage1_kernel(
    Q,
    QR,
    KV,
    BT,
    FIRST,
    LO,
    POS,
    WID,
    WORK,
    NCH,
    PO,
    PL,
    OUT,
    stride_qn,
    stride_qb,
    stride_qh,
    stride_kvp,
    stride_kvt,
    stride_btn,
    max_pages,
    stride_pow,
    stride_pop,
    stride_plw,
    stride_on,
    stride_ob,
    stride_oh,
    qk_scale,
    stride_rn,
    stride_rb,
    stride_rh,
    ROWS: tl.constexpr,
    HEADS: tl.constexpr,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    PAGE: tl.constexpr,
    CHUNK: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DL: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_w = tl.program_id(1)
    n = tl.load(WORK + 2 * pid_w)
    c = tl.load(WORK + 2 * pid_w + 1)
    if n >= 0:
        n64 = n.to(tl.int64)
        pos, first, nch, c0, c1, start = _chunk_span(LO, POS, FIRST, NCH, n, c, PAGE, CHUNK, ROWS)

        p, pmask, h, b, row_end, q_nope, q_rope = _mla_queries(
            Q, QR, WID, n, pos, pid_m, stride_qn, stride_qb, stride_qh, stride_rn, stride_rb, stride_rh,
            ROWS, HEADS, KV_LORA, ROPE, CAUSAL, BLOCK_M, BLOCK_DL, BLOCK_DR,
        )  # fmt: skip

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DL], tl.float32)
        bt_row = BT + n64 * stride_btn
        for t0 in range(c0, c1, BLOCK_N):
            t, tmask, kv_rows = _tile_rows(
                KV, bt_row, t0, start, c1, first, max_pages, stride_kvp, stride_kvt, PAGE, BLOCK_N
            )
            kv, pr, alpha, m_i, l_i = _mla_tile(
                kv_rows, t, tmask, row_end, q_nope, q_rope, m_i, l_i, qk_scale, KV_LORA, ROPE, BLOCK_DL, BLOCK_DR,
                DOT_PREC,
            )  # fmt: skip
            acc = acc * alpha[:, None]
            acc = tl.dot(pr.to(kv.dtype), kv, acc, input_precision=DOT_PREC)

        _stage1_epilogue(
            acc,
            m_i,
            l_i,
            nch == 1,
            OUT + n64 * stride_on + b * stride_ob + h * stride_oh,
            PO + pid_w.to(tl.int64) * stride_pow + p * stride_pop,
            PL + pid_w.to(tl.int64) * stride_plw + p,
            tl.arange(0, BLOCK_DL),
            pmask,
            tl.arange(0, BLOCK_DL) < KV_LORA,
        )


@triton.jit
def _gqa_stage1_kernel(
    Q,
    KV,
    BT,
    FIRST,
    LO,
    POS,
    WID,
    WORK,
    NCH,
    PO,
    PL,
    OUT,
    stride_qn,
    stride_qb,
    stride_qh,
    stride_kvp,
    stride_kvt,
    stride_kvs,
    stride_kvh,
    stride_btn,
    max_pages,
    stride_pow,
    stride_pop,
    stride_plw,
    stride_on,
    stride_ob,
    stride_oh,
    qk_scale,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    CHUNK: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    M_BLOCKS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_w = tl.program_id(1)
    kvh = pid // M_BLOCKS
    mb = pid % M_BLOCKS
    n = tl.load(WORK + 2 * pid_w)
    c = tl.load(WORK + 2 * pid_w + 1)
    if n >= 0:
        n64 = n.to(tl.int64)
        pos, first, nch, c0, c1, start = _chunk_span(LO, POS, FIRST, NCH, n, c, PAGE, CHUNK, ROWS)

        pl_ = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # pair within the kv head = g * ROWS + b
        pmask = pl_ < GROUP * ROWS
        g = pl_ // ROWS
        b = pl_ % ROWS
        h = kvh * GROUP + g
        p = h * ROWS + b
        if CAUSAL:
            row_end = pos + b + 1
        else:  # the whole block sees its first WID rows (vLLM's block is the k it was asked for)
            row_end = pos + tl.load(WID + n) + b * 0
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM

        q_rows = Q + n64 * stride_qn + b * stride_qb + h * stride_qh
        q = tl.load(q_rows[:, None] + d[None, :], mask=pmask[:, None] & dmask[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = BT + n64 * stride_btn
        for t0 in range(c0, c1, BLOCK_N):
            t, tmask, kv_rows = _tile_rows(
                KV, bt_row, t0, start, c1, first, max_pages, stride_kvp, stride_kvt, PAGE, BLOCK_N
            )
            k_rows = kv_rows + kvh * stride_kvh
            ldmask = tmask[:, None] & dmask[None, :]
            k = tl.load(k_rows[:, None] + d[None, :], mask=ldmask, other=0.0)
            v = tl.load(k_rows[:, None] + stride_kvs + d[None, :], mask=ldmask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
            vis = tmask[None, :] & (t[None, :] < row_end[:, None])
            pr, alpha, m_i, l_i = _softmax_step(s * qk_scale, vis, m_i, l_i)
            acc = acc * alpha[:, None]
            acc = tl.dot(pr.to(v.dtype), v, acc, input_precision=DOT_PREC)

        _stage1_epilogue(
            acc,
            m_i,
            l_i,
            nch == 1,
            OUT + n64 * stride_on + b * stride_ob + h * stride_oh,
            PO + pid_w.to(tl.int64) * stride_pow + p * stride_pop,
            PL + pid_w.to(tl.int64) * stride_plw + p,
            d,
            pmask,
            dmask,
        )


@triton.jit
def _combine_kernel(
    PO,
    PL,
    OUT,
    NCH,
    OFF,
    capacity,
    stride_pow,
    stride_pop,
    stride_plw,
    stride_on,
    stride_ob,
    stride_oh,
    ROWS: tl.constexpr,
    PAIRS: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Stage 2: merge a session's chunk partials (log-sum-exp) into ``out``.

    Single-chunk sessions were written by stage 1 and are skipped; padding sessions get zeros;
    sessions whose items did not fit the plan's capacity get NaN.
    """
    n = tl.program_id(0)
    pb = tl.program_id(1)
    nch = tl.load(NCH + n)
    off = tl.load(OFF + n)
    fits = off + nch <= capacity
    if (nch != 1) | (off + nch > capacity):
        p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        pmask = p < PAIRS
        h = p // ROWS
        b = p % ROWS
        d = tl.arange(0, BLOCK_DV)
        dmask = d < V_DIM
        mask = pmask[:, None] & dmask[None, :]
        m = tl.full([BLOCK_P], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_P], tl.float32)
        acc = tl.zeros([BLOCK_P, BLOCK_DV], tl.float32)
        n_eff = tl.where(fits, nch, 0)
        for j in range(0, n_eff):
            w = (off + j).to(tl.int64)
            lse = tl.load(PL + w * stride_plw + p, mask=pmask, other=float("-inf"))
            o = tl.load(PO + w * stride_pow + p[:, None] * stride_pop + d[None, :], mask=mask, other=0.0)
            m_new = tl.maximum(m, lse)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_use)
            wt = tl.exp2(lse - m_use)
            acc = acc * alpha[:, None] + wt[:, None] * o
            l_sum = l_sum * alpha + wt
            m = m_new
        res = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
        res = tl.where(fits, res, float("nan"))
        out_rows = OUT + n.to(tl.int64) * stride_on + b * stride_ob + h * stride_oh
        tl.store(out_rows[:, None] + d[None, :], res.to(OUT.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------------------------
def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs (tests, debugging): true fp32 products; bf16/fp16 ignore it.
    return "ieee" if dtype == torch.float32 else "tf32"


def _prepare(
    q: torch.Tensor,
    block_table: torch.Tensor,
    first_page: torch.Tensor,
    lo: torch.Tensor,
    pos: torch.Tensor,
    width: torch.Tensor | None,
    *,
    page_size: int,
    chunk: int,
    plan: WorkPlan | None,
    workspace: Workspace | None,
    out: torch.Tensor | None,
    v_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, WorkPlan, Workspace, torch.Tensor]:
    if q.dim() != 4 or q.stride(3) != 1:
        raise ValueError("q must be [N, Bq, H, D] with a contiguous last dim")
    n, rows, heads, _ = q.shape
    if block_table.dim() != 2 or block_table.shape[0] != n or block_table.stride(1) != 1:
        raise ValueError("block_table must be [N, max_pages] with a contiguous last dim")
    if block_table.dtype != torch.int32:
        block_table = block_table.to(torch.int32)
    first_page, lo, pos = _as_i32(first_page), _as_i32(lo), _as_i32(pos)
    width = torch.full((n,), rows, dtype=torch.int32, device=q.device) if width is None else _as_i32(width)
    for name, x in (("first_page", first_page), ("lo", lo), ("pos", pos), ("width", width)):
        if x.shape != (n,):
            raise ValueError(f"{name} must be [N]")
    if plan is None:
        plan = plan_work(lo, pos, rows=rows, chunk=chunk, page_size=page_size)
    elif (plan.rows, plan.page_size, plan.num_sessions) != (rows, page_size, n):
        raise ValueError("plan was built for another Bq / page size / N")
    pairs = rows * heads
    if workspace is None:
        workspace = Workspace.allocate(plan.capacity, pairs, v_dim, q.device)
    workspace.check(plan.capacity, pairs, v_dim)
    if out is None:
        out = torch.empty((n, rows, heads, v_dim), dtype=q.dtype, device=q.device)
    elif out.shape != (n, rows, heads, v_dim) or out.stride(3) != 1:
        raise ValueError(f"out must be [{n}, {rows}, {heads}, {v_dim}] with a contiguous last dim")
    return block_table, first_page, lo, pos, width, plan, workspace, out


def _combine(
    plan: WorkPlan, ws: Workspace, out: torch.Tensor, *, rows: int, heads: int, v_dim: int, config: KernelConfig
) -> None:
    n = out.shape[0]
    pairs = rows * heads
    grid = (n, triton.cdiv(pairs, config.combine_block_p))
    _combine_kernel[grid](
        ws.partial_out,
        ws.partial_lse,
        out,
        plan.nchunks,
        plan.offsets,
        plan.capacity,
        ws.partial_out.stride(0),
        ws.partial_out.stride(1),
        ws.partial_lse.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        ROWS=rows,
        PAIRS=pairs,
        V_DIM=v_dim,
        BLOCK_P=config.combine_block_p,
        BLOCK_DV=triton.next_power_of_2(v_dim),
        num_warps=config.combine_num_warps,
    )


def _stage1(
    kernel: object,
    grid: tuple[int, int],
    q: torch.Tensor,
    cache: torch.Tensor,
    cache_strides: tuple[int, ...],
    block_table: torch.Tensor,
    first_page: torch.Tensor,
    lo: torch.Tensor,
    pos: torch.Tensor,
    width: torch.Tensor,
    plan: WorkPlan,
    ws: Workspace,
    out: torch.Tensor,
    scale: float,
    config: KernelConfig,
    q_rope: torch.Tensor | None = None,
    **layout: int,
) -> None:
    """Launch a stage-1 kernel: the arguments both layouts share, in their kernels' order
    (MLA's separate rope query, when given, right after q, and its strides after the scale)."""
    lead = () if q_rope is None else (q_rope,)
    tail = () if q_rope is None else (q_rope.stride(0), q_rope.stride(1), q_rope.stride(2))
    kernel[grid](  # type: ignore[index]
        q, *lead, cache, block_table, first_page, lo, pos, width, plan.work, plan.nchunks, ws.partial_out,
        ws.partial_lse, out, q.stride(0), q.stride(1), q.stride(2), *cache_strides, block_table.stride(0),
        block_table.shape[1],
        ws.partial_out.stride(0), ws.partial_out.stride(1), ws.partial_lse.stride(0),
        out.stride(0), out.stride(1), out.stride(2), scale * _LOG2E, *tail,
        ROWS=q.shape[1], PAGE=int(cache.shape[1]), CHUNK=plan.chunk, CAUSAL=layout.pop("CAUSAL"),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, DOT_PREC=_dot_precision(q.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages, **layout,
    )  # fmt: skip


def mla_paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    first_page: torch.Tensor,
    lo: torch.Tensor,
    pos: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    kv_lora: int,
    chunk: int = MLA_CHUNK,
    plan: WorkPlan | None = None,
    workspace: Workspace | None = None,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    q_rope: torch.Tensor | None = None,
    width: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA (absorbed) draft-block attention over one layer's paged latent cache.

    q: [N, Bq, H, kv_lora + rope] (nope part already times W_UK, rope part roped), or, with
    ``q_rope`` [N, Bq, H, rope] given, q is the latent part [N, Bq, H, kv_lora] alone (each read
    through its own strides: no concatenation, no contiguous copy).
    cache: [num_pages, P, >= kv_lora + rope] (one layer's slice; last dim contiguous).
    block_table: int32 [N, max_pages]; first_page, lo, pos: int32 [N] (see the module docstring).
    Returns out [N, Bq, H, kv_lora] in q's dtype (``out`` if given). ``plan`` (from ``plan_work``
    with the same Bq, P, N; its chunk wins over ``chunk``), ``workspace`` and ``out`` make the call
    allocation-free and graph-capturable; without them they are made here (and ``plan_work`` syncs).
    config: launch shape; None picks ``MLA_CONFIG`` (``MLA_CONFIG_FP32`` for float32 inputs).
    width: int32 [N], the block rows every row sees when not causal (a block of k <= Bq rows);
    None: all Bq.
    """
    _, rows, heads, dq = q.shape
    if q_rope is not None:
        if q_rope.shape[:3] != q.shape[:3] or q_rope.stride(3) != 1 or dq != kv_lora or q_rope.dtype != q.dtype:
            raise ValueError(f"q_rope must be [N, Bq, H, rope] beside q [N, Bq, H, {kv_lora}], same dtype")
        dq += q_rope.shape[3]
    rope = dq - kv_lora
    if kv_lora <= 0 or rope < 0:
        raise ValueError(f"kv_lora ({kv_lora}) must be in (0, q.shape[-1]={dq}]")
    if cache.dim() != 3 or cache.shape[2] < dq or cache.stride(2) != 1:
        raise ValueError("cache must be [num_pages, P, >= kv_lora + rope] with a contiguous last dim")
    if cache.dtype != q.dtype:
        raise ValueError(f"cache dtype {cache.dtype} != q dtype {q.dtype}")
    page_size = int(cache.shape[1])
    if config is None:
        config = MLA_CONFIG_FP32 if q.element_size() > 2 else MLA_CONFIG
    block_table, first_page, lo, pos, width, plan, ws, out = _prepare(
        q,
        block_table,
        first_page,
        lo,
        pos,
        width,
        page_size=page_size,
        chunk=chunk,
        plan=plan,
        workspace=workspace,
        out=out,
        v_dim=kv_lora,
    )
    grid = (triton.cdiv(rows * heads, config.block_m), plan.capacity)
    if q_rope is None:
        q_rope = q[..., kv_lora:]
    _stage1(
        _mla_stage1_kernel, grid, q, cache, (cache.stride(0), cache.stride(1)), block_table, first_page, lo, pos,
        width, plan, ws, out, scale, config, q_rope=q_rope, CAUSAL=causal,
        HEADS=heads, KV_LORA=kv_lora, ROPE=rope,
        BLOCK_DL=max(16, triton.next_power_of_2(kv_lora)), BLOCK_DR=max(16, triton.next_power_of_2(max(rope, 1))),
    )  # fmt: skip
    _combine(plan, ws, out, rows=rows, heads=heads, v_dim=kv_lora, config=config)
    return out


def gqa_paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    first_page: torch.Tensor,
    lo: torch.Tensor,
    pos: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    chunk: int = GQA_CHUNK,
    plan: WorkPlan | None = None,
    workspace: Workspace | None = None,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    width: torch.Tensor | None = None,
) -> torch.Tensor:
    """GQA draft-block attention over one layer's paged K/V cache.

    q: [N, Bq, H, head_dim]; cache: [num_pages, P, 2, kv_heads, head_dim] (0 = K, 1 = V; last dim
    contiguous); H must be a multiple of kv_heads. Other arguments and the return as for
    ``mla_paged_attention``; out is [N, Bq, H, head_dim]. config: None picks ``GQA_CONFIG``.
    """
    _, rows, heads, head_dim = q.shape
    if cache.dim() != 5 or cache.shape[2] != 2 or cache.shape[4] != head_dim or cache.stride(4) != 1:
        raise ValueError("cache must be [num_pages, P, 2, kv_heads, head_dim] with a contiguous last dim")
    if cache.dtype != q.dtype:
        raise ValueError(f"cache dtype {cache.dtype} != q dtype {q.dtype}")
    kv_heads = int(cache.shape[3])
    if heads % kv_heads:
        raise ValueError(f"H ({heads}) must be a multiple of kv_heads ({kv_heads})")
    group = heads // kv_heads
    page_size = int(cache.shape[1])
    if config is None:
        config = GQA_CONFIG
    block_table, first_page, lo, pos, width, plan, ws, out = _prepare(
        q,
        block_table,
        first_page,
        lo,
        pos,
        width,
        page_size=page_size,
        chunk=chunk,
        plan=plan,
        workspace=workspace,
        out=out,
        v_dim=head_dim,
    )
    m_blocks = triton.cdiv(group * rows, config.block_m)
    grid = (kv_heads * m_blocks, plan.capacity)
    _stage1(
        _gqa_stage1_kernel, grid, q, cache, tuple(cache.stride(i) for i in range(4)), block_table, first_page, lo,
        pos, width, plan, ws, out, scale, config, CAUSAL=causal,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), M_BLOCKS=m_blocks,
    )  # fmt: skip
    _combine(plan, ws, out, rows=rows, heads=heads, v_dim=head_dim, config=config)
    return out


# ---------------------------------------------------------------------------------------------
# Oracle
# ---------------------------------------------------------------------------------------------
def reference_paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    first_page: torch.Tensor,
    lo: torch.Tensor,
    pos: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    layout: Literal["mla", "gqa"],
    kv_lora: int | None = None,
    dtype: torch.dtype = torch.float64,
    width: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager oracle: per session, gather the visible rows ``[lo, pos + Bq)`` and do a masked softmax.

    Same arguments and output as the kernels (``layout`` picks the cache layout; ``kv_lora`` is
    required for MLA); computes in ``dtype`` and returns q's dtype. Reads only visible slots.
    """
    n, rows, heads, dq = q.shape
    page_size = int(cache.shape[1])
    if layout == "mla":
        if kv_lora is None:
            raise ValueError("kv_lora is required for the MLA layout")
        v_dim = kv_lora
    elif layout == "gqa":
        v_dim = dq
    else:
        raise ValueError(f"unknown layout {layout!r}")
    out = torch.zeros((n, rows, heads, v_dim), dtype=q.dtype, device=q.device)
    bt, fp = block_table.cpu().long(), first_page.cpu().long()
    los, poss = lo.cpu().long(), pos.cpu().long()
    for i in range(n):
        lo_i, pos_i = int(los[i]), int(poss[i])
        if lo_i < 0 or lo_i > pos_i:
            continue
        t = torch.arange(lo_i, pos_i + rows)
        pages = bt[i, t // page_size - int(fp[i])]
        kv = cache[pages.to(cache.device), (t % page_size).to(cache.device)].to(dtype)
        qi = q[i].to(dtype)
        if layout == "mla":
            s = torch.einsum("bhd,td->bht", qi, kv[:, :dq])
            v = kv[:, :v_dim]
        else:
            group = heads // int(cache.shape[3])
            k = kv[:, 0].repeat_interleave(group, dim=1)
            v = kv[:, 1].repeat_interleave(group, dim=1)
            s = torch.einsum("bhd,thd->bht", qi, k)
        s = s * scale
        w_i = rows if width is None else int(width[i])
        end = pos_i + (torch.arange(rows) + 1 if causal else torch.full((rows,), w_i))
        vis = (t[None, :] < end[:, None]).to(s.device)
        s = s.masked_fill(~vis[:, None, :], -math.inf)
        w = torch.softmax(s, dim=-1)
        o = torch.einsum("bht,td->bhd", w, v) if layout == "mla" else torch.einsum("bht,thd->bhd", w, v)
        out[i] = o.to(q.dtype)
    return out
