"""The CPU EXL3 decoder against the fixtures in tests/fixtures/exl3/.

Two kinds of fixture, told apart by their ``source`` metadata:

- ``exllamav3-gpu`` (``draft_tools/exl3_gpu.sh golden`` on a CUDA machine): exllamav3's own
  ``get_inner_weight_tensor`` must equal our decode bit for bit (tensor for small shapes, sha256 always);
  its ``get_weight_tensor``, ``quantize_exl3``'s dequantized weight and the ``exl3_gemm`` /
  ``LinearEXL3.forward`` outputs (``EXL3_INT8_GEMV=0``) within fp16 tolerance (``exl3_golden.compare``);
- ``draft_tools-cpu`` (``draft_tools.exl3_cpu.write_cpu_fixtures``): the sha256 of our own decode,
  which pins the decoder against itself (a regression check, not a proof of parity).

``test_gpu_goldens_present`` skips, naming the command, until the GPU fixtures are committed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draft_server.models.exl3.decode import dense_weight
from draft_server.models.exl3.linear import Exl3Linear
from draft_tools.exl3_golden import compare

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "exl3"
FILES = sorted(FIXTURES.glob("*.safetensors"))


def _read(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {}), {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_decoder_matches_fixture(path: Path) -> None:
    meta, t = _read(path)
    row = compare(path, meta, t)
    assert row["marker"] and row["K"] == int(meta["K"])
    assert row["inner"] == "exact"  # exllamav3's reconstruct (tensor and/or sha256): bit for bit
    assert row.get("weight_err", 0.0) <= 2e-3  # get_weight_tensor: fp32 Hadamards, GPU order, fp16
    assert row.get("weight_q_err", 0.0) <= 5e-3  # quantize_exl3's own dequantized weight (fp32 scales)
    assert row.get("y_err", 0.0) <= 1e-2  # exl3_gemm (fp16 / fp32 out), LinearEXL3.forward: fp16 activations
    if "x" in t:  # and our CPU linear on the same input
        cb, k, n = meta["codebook"], int(meta["in"]), int(meta["out"])
        lin = Exl3Linear(path.stem, k, n, t["trellis"], t["suh"], t["svh"], cb)
        y = t["x"].double() @ dense_weight(lin.inner(), lin.suh, lin.svh)
        assert (lin(t["x"].float()).double() - y).abs().max().item() <= 1e-5 * y.abs().max().item() + 1e-6


def test_gpu_goldens_present() -> None:
    gpu = [p for p in FILES if _read(p)[0].get("source") == "exllamav3-gpu"]
    if not gpu:
        pytest.skip(
            "no exllamav3 GPU goldens in tests/fixtures/exl3 yet: run draft_tools/exl3_gpu.sh on a CUDA machine"
            " (its docstring has the device command) and commit the fixtures it returns"
        )
    codebooks = {_read(p)[0]["codebook"] for p in gpu}
    assert codebooks == {"3inst", "mcg", "mul1"}
