"""FlashMLA's Hopper decode kernel for the K3 (MLA) draft block: build, load, call into fixed buffers.

Owns the optional CUDA path of MLA attention on sm_90: ``flash_mla.cu`` (our binding, which allocates
nothing) compiled at run time with torch's extension builder against a FlashMLA source tree
(deepseek-ai/FlashMLA: ``csrc/``, with CUTLASS at ``csrc/cutlass`` or ``$DRAFT_FLASHMLA_CUTLASS``),
found at ``$DRAFT_FLASHMLA_SRC``. Only the three translation units of dense decode are built (the
split schedule, the SM90 split-KV kernel, the combine), for ``sm_90a``; the build is cached in
``$TORCH_EXTENSIONS_DIR``. ``load()`` returns None (with the reason in ``why_not()``) wherever that
cannot be: no CUDA, not a Hopper GPU, no source tree, a failed build; callers keep the Triton kernel.

The kernel's contract (checked by the binding): bf16, one KV head, q ``[b, s_q, h_q, 576]``
contiguous, the cache as ``[pages, 64, 1, 576]`` (64-token pages), ``block_table [b, max_pages]``
int32 and ``seqlens [b]`` int32: session i attends to its first ``seqlens[i]`` tokens through its
row of the table; with ``causal`` row j of the block sees all but the last ``s_q - 1 - j``.
Out-of-range values of a session's last page are zeroed in shared memory before the value product,
so stale NaN/Inf there never reach an output.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

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


def why_not() -> str:
    """Why ``load()`` returned None ("" once loaded)."""
    return _why_not


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
            name="draft_flash_mla",
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
            verbose=bool(os.environ.get("DRAFT_FLASHMLA_VERBOSE")),
        )
    except Exception as e:  # a compiler or toolkit problem: say it once, keep the Triton kernel
        last = str(e).strip().splitlines()[-1:] or [""]
        _why_not = f"FlashMLA build failed: {type(e).__name__}: {last[0]}"
        log.warning("%s", _why_not)
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
    def allocate(cls, mod: ModuleType, b: int, s_q: int, h_q: int, device: torch.device) -> FlashMLABuffers:
        parts = int(mod.num_sm_parts(s_q, h_q))
        rows = s_q * h_q
        f32 = {"dtype": torch.float32, "device": device}
        return cls(
            sched=torch.zeros(parts, int(mod.sched_meta_ints()), dtype=torch.int32, device=device),
            num_splits=torch.zeros(b + 1, dtype=torch.int32, device=device),
            lse=torch.empty(b, rows, **f32),
            lse_accum=torch.empty(b + parts, rows, **f32),
            o_accum=torch.empty(b + parts, rows, HEAD_DIM_V, **f32),
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
