"""Programmatic dependent launch (Hopper and later) for the step's Triton kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still running:
its programs become resident early, so the launch and prologue gap between two kernels of a
CUDA graph (about a microsecond each, some 160 kernels in a K3 step at one session) is hidden.
Every such kernel calls ``enter`` before it reads anything an earlier kernel wrote or writes
anything an earlier kernel reads: ``gdc_wait`` returns once the grid before it has completed and
its writes are visible, then ``gdc_launch_dependents`` lets the grid after it launch. Only
weights, which no kernel of the step writes, may be read before ``enter``: the Markov argmax loads
its weight tile there, and the skinny GEMM prefetches its first weight tiles into the L2
(``prefetch_l2``, which costs no registers or shared memory). ``enter`` is unconditional in every
program, early-exiting ones included: a grid whose programs all skipped the wait could complete
before the grid it depends on, and the next kernel's wait would then cover the wrong grid.

On for CUDA devices of compute capability 9 or more when this Triton has the instructions; off
under Triton's interpreter and on other devices (``enter`` then compiles to nothing), and while
``ENABLED`` is false. ``ENABLED`` holds for a whole process; it is read when a kernel is launched,
so set it before any CUDA graph is captured.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

ENABLED = False  # until the H200 A/B (draft_tools/bench/pdl_ab.py) shows it pays; the benchmark's --pdl sets it
EARLY = True  # let the next grid launch right after the wait; False: only as this grid's programs exit


@functools.cache
def _supported(index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    if cuda is None or not hasattr(cuda, "gdc_wait") or not hasattr(cuda, "gdc_launch_dependents"):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def on(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use PDL now."""
    return ENABLED and device.type == "cuda" and _supported(device.index or 0)


def opts(device: torch.device) -> dict[str, Any]:
    """Launch keywords for a kernel taking a ``PDL: tl.constexpr`` argument."""
    return {"PDL": True, "EARLY": EARLY, "launch_pdl": True} if on(device) else {"PDL": False, "EARLY": False}


@triton.jit
def enter(PDL: tl.constexpr, EARLY: tl.constexpr):
    """Wait for the grid before (complete, writes visible), then let the grid after launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(rows, NBYTES: tl.constexpr, PDL: tl.constexpr):
    """Hopper's bulk L2 prefetch of NBYTES from each address in ``rows`` (16-byte aligned, NBYTES a
    multiple of 16): a hint with no result, so weights can start streaming before ``enter``."""
    if PDL:
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
            "=r,l,r",
            [rows, tl.full(rows.shape, NBYTES, tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
