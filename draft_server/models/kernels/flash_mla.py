"""FlashMLA's Hopper decode kernel for the K3 (MLA) draft block: build, load, call into fixed buffers.

Owns the optional CUDA path of MLA attention on sm_90: ``flash_mla.cu`` (our binding, which allocates
nothing) compiled at run time with torch's extension builder against a FlashMLA source tree
(deepseek-ai/FlashMLA: ``csrc/``, with CUTLASS at ``csrc/cutlass`` or ``$DRAFT_FLASHMLA_CUTLASS``),
found at ``$DRAFT_FLASHMLA_SRC``. Only the three translation units of dense decode are built (the
split schedule, the SM90 split-KV kernel, the combine), for ``sm_90a``; the build is cached in
``$TORCH_EXTENSIONS_DIR``. A build made earlier for the same torch (a top-level ``draft_flash_mla``
extension module on ``sys.path``, e.g. the device scripts' carried one) is imported instead, no
source tree needed. ``load()`` returns None (with the reason in ``why_not()``) wherever neither can
be: no CUDA, not a Hopper GPU, no source tree, a failed build; callers keep the Triton kernel.

The kernel's contract (checked by the binding): bf16, one KV head, q ``[b, s_q, h_q, 576]``
contiguous, the cache as ``[pages, 64, 1, 576]`` (64-token pages), ``block_table [b, max_pages]``
int32 and ``seqlens [b]`` int32: session i attends to its first ``seqlens[i]`` tokens through its
row of the table; with ``causal`` row j of the block sees all but the last ``s_q - 1 - j``.
Out-of-range values of a session's last page are zeroed in shared memory before the value product,
so stale NaN/Inf there never reach an output.

``FlashMLA`` is what the fast step holds (``step.FastStep``): the fixed buffers of its largest batch,
sliced per bucket, and the per-step preparation inside the captured body: ``prepare`` turns the
step's ragged page list (``attention.PagedBatch``: pages, first, lo, pos, width) into FlashMLA's
``[b, max_pages]`` table and ``seqlens`` (a Triton kernel, so the interpreter runs it on the CPU too)
and plans the splits, once per step; ``attend`` is one layer. FlashMLA reads a sequence from its
table's first token, so a context must start on a page boundary: the cache lays every span out from
its start (``kv_cache``), so one restarted mid-sequence does too. A draft asked from a later start
than its span's would not: the step routes such a batch to the eager body, where the attention
(``PagedBatch.mixed``) also runs the Triton kernel and takes its rows for those sessions.
``ReferenceKernel`` is the torch oracle of the binding's contract (any dims, any float dtype) for
tests on the CPU.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import triton
import triton.language as tl

from draft_server.models.kernels.prebuilt import find_extension

log = logging.getLogger(__name__)

PAGE = 64
HEAD_DIM_K = 576
HEAD_DIM_V = 512
_SOURCES = (
    "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "smxx/decode/combine/combine.cu",
    "sm90/decode/dense/instantiations/bf16.cu",
)
_why_not = "not loaded yet"
EXT = "draft_flash_mla"  # the extension's module name, built or prebuilt


def why_not() -> str:
    """Why ``load()`` returned None ("" once loaded)."""
    return _why_not


def _prebuilt() -> ModuleType | None:
    """A ``draft_flash_mla`` extension module already on ``sys.path`` (an earlier build, carried), or None;
    one that does not import (built against another torch) is logged and left for a fresh build."""
    try:
        return find_extension(EXT)
    except ImportError as e:
        log.warning("prebuilt %s does not import (%s): building it", EXT, e)
        return None


def source_tree() -> Path | None:
    """FlashMLA's ``csrc`` directory (``$DRAFT_FLASHMLA_SRC``, the repository root or its csrc)."""
    root = os.environ.get("DRAFT_FLASHMLA_SRC")
    if not root:
        return None
    p = Path(root)
    return p / "csrc" if (p / "csrc").is_dir() else p


@functools.cache
def load() -> ModuleType | None:
    """The built extension, or None (see ``why_not``)."""
    global _why_not
    if not torch.cuda.is_available():
        _why_not = "no CUDA device"
        return None
    if torch.cuda.get_device_capability() != (9, 0):
        major, minor = torch.cuda.get_device_capability()
        _why_not = f"FlashMLA's dense decode kernel is sm_90a only (this GPU is sm_{major}{minor})"
        return None
    mod = _prebuilt()
    if mod is not None:
        _why_not = ""
        return mod
    csrc = source_tree()
    if csrc is None or not (csrc / _SOURCES[2]).is_file():
        _why_not = "no FlashMLA source tree (set DRAFT_FLASHMLA_SRC to a deepseek-ai/FlashMLA checkout)"
        return None
    cutlass = Path(os.environ.get("DRAFT_FLASHMLA_CUTLASS", csrc / "cutlass"))
    if not (cutlass / "include" / "cute" / "tensor.hpp").is_file():
        _why_not = f"no CUTLASS headers at {cutlass}/include (FlashMLA's csrc/cutlass, or DRAFT_FLASHMLA_CUTLASS)"
        return None
    from torch.utils import cpp_extension

    here = Path(__file__).with_name("flash_mla.cu")
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"  # wgmma: sm_90a only (a plain sm_90 pass rejects it)
    try:
        mod = cpp_extension.load(
            name=EXT,
            sources=[str(here), *(str(csrc / s) for s in _SOURCES)],
            extra_include_paths=[
                str(csrc),
                str(csrc / "sm90"),
                str(csrc / "kerutils" / "include"),
                str(cutlass / "include"),
                str(cutlass / "tools" / "util" / "include"),
            ],
            extra_cflags=["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"],
            extra_cuda_cflags=[
                "-O3",
                "-std=c++20",
                "-DNDEBUG",
                "-D_USE_MATH_DEFINES",
                "-Wno-deprecated-declarations",
                "-U__CUDA_NO_HALF_OPERATORS__",
                "-U__CUDA_NO_HALF_CONVERSIONS__",
                "-U__CUDA_NO_HALF2_OPERATORS__",
                "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                "--expt-relaxed-constexpr",
                "--expt-extended-lambda",
                "--use_fast_math",
                "-lineinfo",
                "-DFLASH_MLA_DISABLE_FP16",
            ],
        )
    except Exception as e:  # a compiler or toolkit problem: say it once, keep the Triton kernel
        last = str(e).strip().splitlines()[-1:] or [""]
        _why_not = f"FlashMLA build failed: {type(e).__name__}: {last[0]}"
        log.warning("%s (the Triton kernels serve MLA); the build said:\n%s", _why_not, e)
        return None
    finally:
        if arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    _why_not = ""
    return mod


@dataclass(slots=True)
class FlashMLABuffers:
    """Everything one bucket's calls write (fixed addresses: a CUDA graph replays them)."""

    sched: torch.Tensor  # int32 [parts, meta ints]
    num_splits: torch.Tensor  # int32 [b + 1]
    lse: torch.Tensor  # f32 [b, s_q * h_q]
    lse_accum: torch.Tensor  # f32 [b + parts, s_q * h_q]
    o_accum: torch.Tensor  # f32 [b + parts, s_q * h_q, 512]

    @classmethod
    def allocate(
        cls, mod: ModuleType, b: int, s_q: int, h_q: int, device: torch.device, dv: int = HEAD_DIM_V
    ) -> FlashMLABuffers:
        parts = int(mod.num_sm_parts(s_q, h_q))
        rows = s_q * h_q
        f32 = {"dtype": torch.float32, "device": device}
        return cls(
            sched=torch.zeros(parts, int(mod.sched_meta_ints()), dtype=torch.int32, device=device),
            num_splits=torch.zeros(b + 1, dtype=torch.int32, device=device),
            lse=torch.empty(b, rows, **f32),
            lse_accum=torch.empty(b + parts, rows, **f32),
            o_accum=torch.empty(b + parts, rows, dv, **f32),
        )


def flash_mla_decode(
    mod: ModuleType,
    q: torch.Tensor,
    kcache: torch.Tensor,
    seqlens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    causal: bool,
    out: torch.Tensor,
    buf: FlashMLABuffers,
) -> torch.Tensor:
    """``out [b, s_q, h_q, 512]`` = the block's attention (module docstring); plans the splits on the
    device from ``seqlens`` first, so a captured call is right for any lengths of the same shapes."""
    mod.plan(seqlens, q.shape[1], buf.sched, buf.num_splits)
    mod.attend(q, kcache, seqlens, block_table, scale, causal, buf.sched, buf.num_splits, out, buf.lse,
               buf.lse_accum, buf.o_accum)  # fmt: skip
    return out


def kernel_for(
    mla: bool, dtype: torch.dtype, device: torch.device, dims: tuple[int, int], page: int
) -> ModuleType | None:
    """The FlashMLA extension if it can serve a model's attention: MLA, bf16, on CUDA, with K3's
    (576, 512) key/value dims, 64-token pages and the kernel loadable; else None (the Triton kernel
    serves it)."""
    if not mla or dtype != torch.bfloat16 or torch.device(device).type != "cuda" or page != PAGE:
        return None
    return load() if dims == (HEAD_DIM_K, HEAD_DIM_V) else None


# ---------------------------------------------------------------------------------------------
# The step's table and lengths, on the device
# ---------------------------------------------------------------------------------------------
@triton.jit
def _table_kernel(
    FLAT, FIRST, LO, POS, WID, TABLE, SEQ, stride_t, cols, trash,
    PAGE: tl.constexpr, ROWS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Session i's row of FlashMLA's table (its pages from the one holding ``lo``; logical page lp is
    at ``FLAT[lp - first]``) and its length from that page's first token; a padding session
    (``lo > pos``) reads ROWS tokens of the trash page."""
    i = tl.program_id(0)
    jb = tl.program_id(1)
    lo = tl.load(LO + i)
    pos = tl.load(POS + i)
    first = tl.load(FIRST + i)
    if CAUSAL:
        end = pos + ROWS
    else:
        end = pos + tl.load(WID + i)
    pad = (lo > pos) | (lo < 0)
    lp0 = tl.where(pad, 0, lo // PAGE)
    n_pages = tl.where(pad, 1, tl.cdiv(end, PAGE) - lp0)
    j = jb * BLOCK + tl.arange(0, BLOCK)
    live = (j < n_pages) & (j < cols)
    n_read = tl.where(pad, 0, n_pages)
    page = tl.load(FLAT + lp0 + j - first, mask=(j < n_read) & (j < cols), other=0)
    page = tl.where(pad, trash, page)
    tl.store(TABLE + i.to(tl.int64) * stride_t + j, page, mask=live)
    if jb == 0:
        tl.store(SEQ + i, tl.where(pad, ROWS, end - lp0 * PAGE))


_TABLE_BLOCK = 256


@dataclass(slots=True)
class FlashMLA:
    """FlashMLA in the fast step: fixed buffers for ``n_max`` sessions of ``rows`` block rows and
    ``heads`` heads, sliced per bucket (graphs replay one at a time); see the module docstring."""

    kernel: ModuleType  # the extension (or ``ReferenceKernel``)
    rows: int
    heads: int
    page: int
    causal: bool
    scale: float
    trash_page: int
    table: torch.Tensor  # int32 [n_max, cols]
    seqlens: torch.Tensor  # int32 [n_max]
    q: torch.Tensor  # [n_max, rows, heads, dk]
    out: torch.Tensor  # [n_max, rows, heads, dv]
    buf: FlashMLABuffers

    @classmethod
    def allocate(
        cls, kernel: ModuleType, *, n_max: int, rows: int, heads: int, dims: tuple[int, int], page: int,
        cols: int, causal: bool, scale: float, trash_page: int, dtype: torch.dtype, device: torch.device,
    ) -> FlashMLA:  # fmt: skip
        dk, dv = dims
        return cls(
            kernel=kernel,
            rows=rows,
            heads=heads,
            page=page,
            causal=causal,
            scale=scale,
            trash_page=trash_page,
            table=torch.zeros(n_max, cols, dtype=torch.int32, device=device),
            seqlens=torch.zeros(n_max, dtype=torch.int32, device=device),
            q=torch.zeros(n_max, rows, heads, dk, dtype=dtype, device=device),
            out=torch.zeros(n_max, rows, heads, dv, dtype=dtype, device=device),
            buf=FlashMLABuffers.allocate(kernel, n_max, rows, heads, device, dv),
        )

    def prepare(self, n: int, pages: torch.Tensor, first: torch.Tensor, lo: torch.Tensor, pos: torch.Tensor,
                width: torch.Tensor) -> None:  # fmt: skip
        """This step's table rows and lengths for its n (bucket) sessions, and the split plan."""
        cols = self.table.shape[1]
        grid = (n, triton.cdiv(cols, _TABLE_BLOCK))
        _table_kernel[grid](
            pages, first, lo, pos, width, self.table, self.seqlens, self.table.stride(0), cols, self.trash_page,
            PAGE=self.page, ROWS=self.rows, CAUSAL=self.causal, BLOCK=_TABLE_BLOCK,
        )  # fmt: skip
        self.kernel.plan(self.seqlens[:n], self.rows, self.buf.sched, self.buf.num_splits[: n + 1])

    def attend(self, q: torch.Tensor, q_rope: torch.Tensor | None, kv: torch.Tensor) -> torch.Tensor:
        """One layer: out [n, rows, heads, dv] of the block over ``kv`` [pages, page, dk] (``prepare`` ran).
        ``q``: the whole query in ``self.q[:n]`` (q_rope None), or its latent part beside ``q_rope``."""
        n = q.shape[0]
        if q_rope is not None:
            q = torch.cat((q, q_rope), dim=-1, out=self.q[:n])
        elif q.data_ptr() != self.q.data_ptr() or not q.is_contiguous():
            raise ValueError("FlashMLA reads the whole query from its buffer (PagedContext.query_buffer)")
        out = self.out[:n]
        b, parts = self.buf, self.buf.sched.shape[0]
        kc = kv.view(kv.shape[0], self.page, 1, kv.shape[-1])
        self.kernel.attend(
            q, kc, self.seqlens[:n], self.table[:n], self.scale, self.causal, b.sched, b.num_splits[: n + 1], out,
            b.lse[:n], b.lse_accum[: n + parts], b.o_accum[: n + parts],
        )  # fmt: skip
        return out


class ReferenceKernel:
    """The binding's contract in torch (float32 math, any dims and float dtype): ``plan`` records
    nothing the oracle needs, ``attend`` gathers each session's table row and runs masked softmax
    attention. Invisible tokens are zeroed before the value product (as the kernel zeroes its
    out-of-range values)."""

    parts = 2

    @staticmethod
    def num_sm_parts(s_q: int, h_q: int) -> int:
        return ReferenceKernel.parts

    @staticmethod
    def sched_meta_ints() -> int:
        return 8

    @staticmethod
    def plan(seqlens: torch.Tensor, s_q: int, sched: torch.Tensor, num_splits: torch.Tensor) -> None:
        num_splits.zero_()

    @staticmethod
    def attend(q: torch.Tensor, kcache: torch.Tensor, seqlens: torch.Tensor, block_table: torch.Tensor, scale: float,
               causal: bool, sched: torch.Tensor, num_splits: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               lse_accum: torch.Tensor, o_accum: torch.Tensor) -> None:  # fmt: skip
        b, s_q, _, dk = q.shape
        dv = out.shape[-1]
        page = kcache.shape[1]
        for i in range(b):
            t = int(seqlens[i])
            rows = kcache[block_table[i, : -(-t // page)].long()].reshape(-1, dk)[:t].float()
            s = torch.einsum("shd,td->sht", q[i].float(), rows) * scale
            limit = t - (s_q - 1 - torch.arange(s_q)) if causal and s_q > 1 else torch.full((s_q,), t)
            vis = torch.arange(t)[None, :] < limit[:, None]  # [s_q, t]
            s = s.masked_fill(~vis[:, None, :], float("-inf"))
            p = torch.softmax(s, -1).nan_to_num(0.0)
            v = rows[:, :dv].masked_fill(~vis.any(0)[:, None], 0.0)
            out[i] = torch.einsum("sht,td->shd", p, v).to(out.dtype)
