"""``draft_tools.kernel_inspect``: a step kernel compiled for sm_90 on a machine without a GPU, and
what it reports (shared memory, registers, spills, the main loop's instructions). The tool runs in
its own process: other tests put Triton in interpreter mode, where kernels cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from draft_tools import kernel_inspect
from tests.conftest import ROOT


def _inspect(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "draft_tools.kernel_inspect", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_skinny_gemm_compiles_for_sm90_with_a_pipelined_loop_and_no_spills() -> None:
    res = _inspect("skinny", "--block-n", "64", "--block-k", "256", "--stages", "3")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["shared_bytes"] > 0 and out["registers"] > 0
    assert out["spill_stack_bytes"] == 0
    assert out["async_copies_in_ttgir"] > 0  # the weight tiles stream through cp.async
    loop = out["loop"]
    assert loop["instructions"] > 0 and loop["opcodes"].get("LDGSTS", 0) > 0


def test_in_interpreter_mode_it_refuses_with_one_line() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "draft_tools.kernel_inspect", "skinny"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "TRITON_INTERPRET" in res.stderr and not res.stdout


def test_main_loop_reads_the_longest_backward_branch() -> None:
    sass = "\n".join(
        [
            "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
            "        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;",
            "        /*0020*/                   HMMA.16816.F32 R4, R8, R12, R4 ;",
            "        /*0030*/               @P0 BRA 0x10 ;",
            "        /*0040*/                   EXIT ;",
        ]
    )
    loop = kernel_inspect.main_loop(sass)
    assert loop["instructions"] == 3 and loop["opcodes"] == {"IADD3": 1, "HMMA": 1, "BRA": 1}
