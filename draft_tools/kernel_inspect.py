"""Look inside the step's Triton kernels as an H100/H200 would run them, without a GPU.

Compiles a kernel for sm_90 with the pip Triton's own ptxas (the JIT's divisibility hints on every
pointer and stride, as it specialises them on a GPU) and prints what decides its speed there:
shared memory, registers and spilled bytes per thread, and the instruction mix of its main loop (the
longest backward branch in the SASS). A launch shape that cannot hold on the GPU, a loop that spills,
or a load that is not pipelined (no ``LDGSTS``) shows here before any device time is spent.

    python -m draft_tools.kernel_inspect mla [--block-m 64 --block-n 64 --warps 8 --stages 2]
    python -m draft_tools.kernel_inspect gqa [--block-m 32 --block-n 64 --warps 2 --stages 3]
    python -m draft_tools.kernel_inspect skinny [--block-n 128 --block-k 256 --warps 4 --stages 2]

Shapes are Kimi-K3's MLA (64 heads, latent 512 + rope 64), Qwen3-8B's GQA (group 4, head 128) and
a skinny GEMM of 7 rows, bf16, 16-token pages, a 7-row causal block. The Triton on this machine may
be newer than the device's; treat counts as a guide, timings only come from the H200.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRA = re.compile(r"BRA (0x[0-9a-f]+)")


def _signature(fn: Any, ptrs: dict[str, str], const: dict[str, Any]) -> tuple[dict[str, str], dict]:
    """Triton types of a kernel's arguments and the divisibility hints the JIT would give them."""
    sig, attrs = {}, {}
    for i, name in enumerate(inspect.signature(fn.fn).parameters):
        if name in const:
            sig[name] = "constexpr"
            continue
        sig[name] = ptrs.get(name) or ("fp32" if name in ("qk_scale", "eps") else "i32")
        strided = name.startswith("stride") or (name[0] == "s" and len(name) <= 3)  # skinny's sx, sw, ...
        if name in ptrs or strided or name in ("K", "N", "K_SLICE"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _kernel(which: str, a: argparse.Namespace) -> tuple[Any, dict[str, str], dict[str, Any]]:
    if which == "skinny":
        from draft_server.models.kernels import skinny

        ptrs = {"X": "*bf16", "W": "*bf16", "H": "*bf16", "Y": "*bf16", "PART": "*fp32", "CNT": "*i32"}
        const = dict(HAS_H=False, BLOCK_M=16, BLOCK_N=a.block_n, BLOCK_K=a.block_k, UPCAST=False)
        return skinny._skinny_kernel, ptrs, const
    from draft_server.models.kernels import paged_attention as pa

    ptrs = {k: "*i32" for k in ("BT", "FIRST", "LO", "POS", "WID", "WORK", "NCH")}
    ptrs.update({"Q": "*bf16", "QR": "*bf16", "KV": "*bf16", "OUT": "*bf16", "PO": "*fp32", "PL": "*fp32"})
    common = dict(ROWS=7, PAGE=16, CHUNK=1024, CAUSAL=True, BLOCK_M=a.block_m, BLOCK_N=a.block_n, DOT_PREC="tf32")
    if which == "mla":
        const = dict(common, HEADS=64, KV_LORA=512, ROPE=64, BLOCK_DL=512, BLOCK_DR=64)
        return pa._mla_stage1_kernel, ptrs, const
    const = dict(common, GROUP=4, HEAD_DIM=128, BLOCK_D=128, M_BLOCKS=-(-28 // a.block_m))
    return pa._gqa_stage1_kernel, ptrs, const


def main_loop(sass: str) -> dict[str, Any]:
    """Instruction count and top opcodes of the longest loop (largest backward branch) in ``sass``."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in map(_ADDR.search, sass.splitlines()) if m]
    best: tuple[int, int] | None = None
    for addr, text in ins:
        m = _BRA.search(text)
        if m and int(m.group(1), 16) < addr and (best is None or addr - int(m.group(1), 16) > best[1] - best[0]):
            best = (int(m.group(1), 16), addr)
    if best is None:
        return {"instructions": 0, "opcodes": {}}
    body = [t for addr, t in ins if best[0] <= addr <= best[1]]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    return {"instructions": len(body), "opcodes": dict(ops.most_common(16))}


def inspect_kernel(which: str, a: argparse.Namespace) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, ptrs, const = _kernel(which, a)
    sig, attrs = _signature(fn, ptrs, const)
    k = triton.compile(
        ASTSource(fn, sig, const, attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=a.warps, num_stages=a.stages),
    )
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        usage = subprocess.run(
            [str(tools / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True
        ).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return {
        "kernel": which,
        "triton": triton.__version__,
        "launch": {k: v for k, v in vars(a).items() if k != "kernel"},
        "shared_bytes": int(k.metadata.shared),
        "registers": int(regs.group(1)) if regs else None,
        "spill_stack_bytes": int(stack.group(1)) if stack else None,
        "loop": main_loop(sass),
        "async_copies_in_ttgir": k.asm["ttgir"].count("async_copy_global_to_local"),
    }


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels would be interpreter functions
        print("kernel_inspect compiles real kernels: run it without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=["mla", "gqa", "skinny"])
    ap.add_argument("--block-m", type=int, default=None)
    ap.add_argument("--block-n", type=int, default=None)
    ap.add_argument("--block-k", type=int, default=256)
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--stages", type=int, default=None)
    a = ap.parse_args(argv)
    defaults = {"mla": (64, 64, 8, 2), "gqa": (32, 64, 2, 3), "skinny": (16, 128, 4, 2)}[a.kernel]
    for name, d in zip(("block_m", "block_n", "warps", "stages"), defaults, strict=True):
        if getattr(a, name) is None:
            setattr(a, name, d)
    print(json.dumps(inspect_kernel(a.kernel, a), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
