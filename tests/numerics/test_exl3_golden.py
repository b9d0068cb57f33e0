"""The CPU EXL3 decoder against the fixtures in tests/fixtures/exl3/.

Two kinds of fixture, told apart by their ``source`` metadata:

- ``exllamav3-gpu`` (``python -m draft_tools.exl3_golden`` on a CUDA machine): exllamav3's own
  ``get_inner_weight_tensor`` must equal our decode bit for bit; its ``get_weight_tensor`` and the
  ``exl3_gemm`` / ``LinearEXL3.forward`` outputs (``EXL3_INT8_GEMV=0``) within fp16 tolerance;
- ``draft_tools-cpu`` (``draft_tools.exl3_cpu.write_cpu_fixtures``): the sha256 of our own decode,
  which pins the decoder against itself (a regression check, not a proof of parity).

``test_gpu_goldens_present`` skips, naming the command, until the GPU fixtures are committed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draft_server.models.exl3.decode import MCG_MULT, MUL1_MULT, dense_weight, weight_fp16_like_exllamav3
from draft_server.models.exl3.linear import Exl3Linear

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "exl3"
FILES = sorted(FIXTURES.glob("*.safetensors"))


def _read(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {}), {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_decoder_matches_fixture(path: Path) -> None:
    meta, t = _read(path)
    cb, k, n = meta["codebook"], int(meta["in"]), int(meta["out"])
    if cb in t:
        assert t[cb].view(torch.int32).item() & 0xFFFFFFFF == (MCG_MULT if cb == "mcg" else MUL1_MULT)
    lin = Exl3Linear(path.stem, k, n, t["trellis"], t["suh"], t["svh"], cb)
    assert lin.K == int(meta["K"])
    inner = lin.inner()
    if "inner" in t:  # exllamav3's reconstruct: bit for bit
        assert torch.equal(inner.view(torch.int16), t["inner"].view(torch.int16))
    else:
        assert hashlib.sha256(inner.view(torch.int16).numpy().tobytes()).hexdigest() == meta["inner_sha256"]
    if "weight" in t:  # get_weight_tensor: fp32 Hadamards (GPU summation order) rounded to fp16
        ours = weight_fp16_like_exllamav3(inner, lin.suh, lin.svh).float()
        ref = t["weight"].float()
        scale = ref.abs().max().item()
        assert (ours - ref).abs().max().item() <= 2e-3 * scale
        assert (dense_weight(inner, lin.suh, lin.svh).float() - ref).abs().max().item() <= 4e-3 * scale
    if "x" in t:  # the fused GEMM and LinearEXL3.forward: fp16 activations, fp16 out
        y = t["x"].double() @ dense_weight(inner, lin.suh, lin.svh)
        tol = 1e-2 * y.abs().max().item() + 1e-3
        for key in ("y_gemm", "y_forward"):
            if key in t:
                assert (t[key].double() - y).abs().max().item() <= tol, key
        assert (lin(t["x"].float()).double() - y[:, :n]).abs().max().item() <= tol


def test_gpu_goldens_present() -> None:
    gpu = [p for p in FILES if _read(p)[0].get("source") == "exllamav3-gpu"]
    if not gpu:
        pytest.skip(
            "no exllamav3 GPU goldens in tests/fixtures/exl3 yet: run "
            "`EXL3_INT8_GEMV=0 TORCH_CUDA_ARCH_LIST=9.0 python -m draft_tools.exl3_golden` on a CUDA machine"
        )
    codebooks = {_read(p)[0]["codebook"] for p in gpu}
    assert codebooks == {"3inst", "mcg", "mul1"}
