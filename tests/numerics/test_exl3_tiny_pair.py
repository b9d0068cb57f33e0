"""The shipped tiny EXL3 drafter (draft_tools/tiny_pair/assets/draft_exl3_k4) end to end on the CPU.

It is the shipped BF16 drafter's decoder layers encoded at K=4 (mul1) by ``draft_tools.exl3_cpu``
(an independent CPU encoder, not exllamav3's quantizer). Loaded by the production loader as EXL3, it
drafts through the same engine-style loop as the BF16 drafter; held-out greedy acceptance is compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from draft_server.models import DSparkConfig, DSparkDrafter, load_drafter
from draft_server.models.exl3 import Exl3Linear, FusedLinear
from draft_tools.tiny_pair import pair as tp
from tests.numerics.test_tiny_pair import one_thread  # noqa: F401 - autouse: one thread for tiny matmuls

pytest.importorskip("transformers")
EXL3_DIR = tp.ASSET_DIR / "draft_exl3_k4"
pytestmark = pytest.mark.skipif(not EXL3_DIR.exists(), reason="no shipped tiny EXL3 drafter")


@dataclass
class Loaded:
    """What ``tp.acceptance`` needs of a draft: its config and a fresh drafter."""

    path: str
    c: DSparkConfig
    embed_w: torch.Tensor = field(default_factory=lambda: torch.zeros(1))  # its dtype: the drafter's (float32)

    def drafter(self, block_width: str = "k") -> DSparkDrafter:
        return load_drafter(self.path, str(tp.TARGET_DIR), "cpu", "float32", 16 << 20, block_width=block_width)


def test_loads_as_exl3() -> None:
    m = load_drafter(str(EXL3_DIR), str(tp.TARGET_DIR), "cpu", "float32", 16 << 20).model
    info = m.weight_info
    assert (info.format, info.bits, info.codebooks, info.quantized) == ("exl3", 4.0, ("mul1",), 14)
    assert isinstance(m.linears["layers.1.mlp.gate_up_proj.weight"], FusedLinear)
    assert isinstance(m.linears["layers.0.self_attn.o_proj.weight"], Exl3Linear)
    dense = load_drafter(str(tp.DRAFT_DIR), str(tp.TARGET_DIR), "cpu", "float32", 16 << 20).model.weight_info
    assert info.weight_bytes < dense.weight_bytes


def test_held_out_acceptance_close_to_bf16() -> None:
    target = tp.load_target()
    prompts = json.loads((tp.ASSET_DIR / "eval_prompts.json").read_text())
    means = {}
    for name, path in (("bf16", tp.DRAFT_DIR), ("exl3", EXL3_DIR)):
        draft = Loaded(str(path), load_drafter(str(path), str(tp.TARGET_DIR), "cpu", "float32", 16 << 20).cfg)
        stats = tp.AcceptStats()
        for pr in prompts:
            tp.acceptance(target, draft, pr["ids"], 48, stats=stats)
        means[name] = stats.mean
    print(f"mean acceptance length: bf16 {means['bf16']:.3f}, exl3 K=4 {means['exl3']:.3f}")
    assert means["exl3"] >= 0.95 * means["bf16"], means  # the issue: within 5% (measured: 2.858 vs 2.924)
