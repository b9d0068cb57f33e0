"""The EXL3 decode kernels' machine code, counted without a GPU: instructions per decoded weight.

Owns one offline measurement: Triton compiles ``kernels/exl3_gemm.py``'s decode-GEMM and the
decode-into-scratch kernel for an sm_90a
target with the ``ptxas`` Triton ships, ``nvdisasm`` lists the SASS, and this counts the instructions
of the kernel's k loop (the one loop; one trip decodes BLOCK_K x BLOCK_N weights, shared by the
program's threads) by opcode. The decode in registers is bound by integer instructions on an H100 /
H200 (``README`` "EXL3 measured"), so instructions per weight is the number its speed follows; it is
not a timing (issue rows are claimed from the GPU runs only).

    python -m draft_tools.bench.exl3_sass --out bench/results/exl3_sass_sm90.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from draft_server.models.kernels import exl3_gemm as K

MATMUL_SIG = {
    "A": "*fp16", "T": "*i32", "C": "*fp32", "M": "i32", "N": "i32", "k_per_split": "i32", "s_am": "i32",
    "s_cm": "i32", "s_cs": "i32", "row_words": "i32", "MASK": "i32",
}  # fmt: skip
DECODE_SIG = {"T": "*i32", "W": "*fp16", "ldw": "i32", "row_words": "i32", "MASK": "i32"}
LABEL = re.compile(r"^\.L_x_\d+:$")
INSTR = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def sass(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4) -> str:
    src = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 1})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def counts(lines: list[str]) -> Counter[str]:
    return Counter(m.group(1) for line in lines if (m := INSTR.search(line)))


def loop_body(text: str) -> list[str] | None:
    """The instructions from a label to the branch back to it (the k loop), or None without a loop."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if LABEL.match(line.strip()):
            label = line.strip()[:-1]
            for j in range(i + 1, len(lines)):
                if f"BRA `({label})" in lines[j]:
                    return lines[i : j + 1]
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    bm, bn, bk, warps = 16, 64, 64, 4  # the decode-GEMM's default launch shape at up to 16 rows
    weights_per_thread = bn * bk // (32 * warps)
    res: dict[str, Any] = {
        "triton": triton.__version__,
        "target": "sm_90a (compiled offline, no GPU)",
        "command": "python -m draft_tools.bench.exl3_sass " + " ".join(argv if argv is not None else sys.argv[1:]),
        "launch": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps},
        "kernels": {},
    }
    for cb_name, cb in K.CODEBOOK_IDS.items():
        ce = {"BITS": 4, "CB": cb, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
        body = loop_body(sass(K._exl3_matmul_kernel, MATMUL_SIG, ce, warps))
        assert body is not None, "no k loop found"
        c = counts(body)
        row = {"loop_instructions": sum(c.values()), "per_weight": round(sum(c.values()) / weights_per_thread, 2),
               "ops": dict(c.most_common())}  # fmt: skip
        res["kernels"][f"matmul_{cb_name}_K4"] = row
        print(f"decode-GEMM {cb_name:5s} K=4: {row['per_weight']:5.2f} instructions a weight"
              f" ({row['loop_instructions']} in the loop)")  # fmt: skip
        ce = {"BITS": 4, "CB": cb, "BLOCK_N": 64, "BLOCK_K": 64, "TRANS": True}
        c = counts(sass(K._exl3_decode_kernel, DECODE_SIG, ce, 4).splitlines())  # no loop: one block a program
        row = {"instructions": sum(c.values()), "per_weight": round(sum(c.values()) / (64 * 64 // 128), 2),
               "ops": dict(c.most_common())}  # fmt: skip
        res["kernels"][f"decode_{cb_name}_K4"] = row
        print(f"exl3_decode {cb_name:5s} K=4: {row['per_weight']:5.2f} instructions a weight (whole kernel)")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
