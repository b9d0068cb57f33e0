"""Must-show 4 and the config rules: bad checkpoints fail in ``load_drafter`` with one clear line.

Covers a missing tensor, a wrong shape, a tap-layer count that differs from the context
projection's width, a vocab mismatch against the target head, rejected flags (each named), and
that valid-but-unusual configs load: a 96-head K3 draft with hidden 7168, Qwen3's q_norm/k_norm,
YaRN, the target_layer_ids -> contract tap id (+1) mapping, and make-tiny's CLI.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_server.drafters.base import DraftItem, IngestItem
from draft_server.models import CheckpointError, load_drafter, parse_config
from draft_server.models.config import expected_shapes
from draft_server.models.tiny import K3_CONFIG, QWEN3_CONFIG, main, make_tiny
from protocol import GREEDY

# The Inferact / TorchSpec K3 DSpark config.json as published (dspark.md §1.1, tokenspeed fixture).
INFERACT_K3 = {
    **{k: v for k, v in K3_CONFIG.items() if k not in ("torch_dtype",)},
    "hidden_size": 7168,
    "intermediate_size": 14336,
    "num_hidden_layers": 5,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 163840,
    "draft_vocab_size": 163840,
    "num_target_layers": 5,
    "target_hidden_size": 7168,
    "target_num_hidden_layers": 93,
    "target_layer_ids": [2, 23, 47, 71, 89],
    "mask_token_id": 163837,
    "markov_rank": 256,
    "max_position_embeddings": 1048576,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 32768,
        "rope_theta": 50000.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}


def load_err(draft: str, target: str | None) -> str:
    with pytest.raises(CheckpointError) as ei:
        load_drafter(draft, target, "cpu", "float32", 1 << 20)
    msg = str(ei.value)
    assert "\n" not in msg and msg
    return msg


def edit_config(d: str, **changes) -> None:
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def edit_tensors(path: str, drop: str | None = None, replace: dict[str, torch.Tensor] | None = None) -> None:
    t = load_file(path)
    if drop:
        del t[drop]
    t.update(replace or {})
    save_file(t, path)


def test_missing_tensor(tmp_path):
    p = make_tiny("k3", str(tmp_path))
    edit_tensors(os.path.join(p.draft, "model.safetensors"), drop="layers.1.self_attn.kv_b_proj.weight")
    msg = load_err(p.draft, p.target)
    assert "missing tensor 'layers.1.self_attn.kv_b_proj.weight'" in msg and "[192, 32]" in msg


def test_wrong_shape_in_a_shard(tmp_path):
    p = make_tiny("qwen3", str(tmp_path))
    with open(os.path.join(p.draft, "model.safetensors.index.json")) as f:
        shard = json.load(f)["weight_map"]["layers.0.self_attn.k_proj.weight"]
    edit_tensors(os.path.join(p.draft, shard), replace={"layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)})
    msg = load_err(p.draft, p.target)
    assert "'layers.0.self_attn.k_proj.weight' has shape [16, 64], expected [32, 64]" in msg


@pytest.mark.parametrize("variant", ["k3", "qwen3"])
def test_tap_count_differs_from_context_projection(tmp_path, variant):
    p = make_tiny(variant, str(tmp_path))
    ids = [0, 1, 2, 5] if variant == "k3" else [0, 4]
    edit_config(p.draft, target_layer_ids=ids, num_target_layers=len(ids) if variant == "k3" else 6)
    msg = load_err(p.draft, p.target)
    name = "context_proj.weight" if variant == "k3" else "fc.weight"
    want = f"[64, {len(ids) * 64}]"
    assert f"'{name}' has shape [64, 192], expected {want}" in msg and f"{len(ids)} taps" in msg


def test_k3_num_target_layers_must_match_taps(tmp_path):
    p = make_tiny("k3", str(tmp_path))
    edit_config(p.draft, num_target_layers=4)
    assert "num_target_layers 4 != len(target_layer_ids) 3" in load_err(p.draft, p.target)


@pytest.mark.parametrize("variant", ["k3", "qwen3"])
def test_vocab_mismatch_against_target_head(tmp_path, variant):
    p = make_tiny(variant, str(tmp_path))
    bad = {"lm_head.weight": torch.zeros(336, 64, dtype=torch.bfloat16)}
    for f in os.listdir(p.target):
        if f.endswith(".safetensors") and "lm_head.weight" in load_file(os.path.join(p.target, f)):
            edit_tensors(os.path.join(p.target, f), replace=bad)
    msg = load_err(p.draft, p.target)
    assert "'lm_head.weight' has shape [336, 64], expected [320, 64]" in msg and "vocab mismatch" in msg


def test_draft_without_head_needs_the_target(tmp_path):
    p = make_tiny("qwen3", str(tmp_path))
    assert "no lm_head.weight; pass the target model directory" in load_err(p.draft, None)


def test_kv_budget_below_one_page_fails_before_loading(tmp_path):
    p = make_tiny("k3", str(tmp_path))
    with pytest.raises(CheckpointError, match="below one KV page"):
        load_drafter(p.draft, p.target, "cpu", "float32", kv_budget_bytes=100)


def test_unexpected_tensor_is_named(tmp_path):
    p = make_tiny("k3", str(tmp_path))
    extra = {"layers.0.self_attn.g_proj.weight": torch.zeros(96, 64)}
    edit_tensors(os.path.join(p.draft, "model.safetensors"), replace=extra)
    assert "unexpected tensor 'layers.0.self_attn.g_proj.weight'" in load_err(p.draft, p.target)


@pytest.mark.parametrize(
    "variant,flag,value",
    [
        ("k3", "mla_use_qk_norm", True),
        ("k3", "mla_use_output_gate", True),
        ("k3", "mla_use_nope", True),
        ("k3", "dspark_bonus_anchor", True),
        ("k3", "q_lora_rank", None),
        ("k3", "fc_norm", True),
        ("qwen3", "dspark_bonus_anchor", True),
        ("qwen3", "attn_output_gate", True),
        ("qwen3", "sample_from_anchor", False),
        ("qwen3", "markov_head_type", "gated"),
        ("qwen3", "layer_types", ["sliding_attention", "full_attention"]),
    ],
)
def test_unsupported_flags_are_named(tmp_path, variant, flag, value):
    p = make_tiny(variant, str(tmp_path))
    edit_config(p.draft, **{flag: value})
    msg = load_err(p.draft, p.target)
    assert (flag if flag != "layer_types" else "sliding_attention") in msg


def test_inferact_k3_and_96_head_configs_parse():
    c = parse_config(INFERACT_K3)
    assert c.contract().tap_layer_ids == (3, 24, 48, 72, 90)  # DeepSpec id + 1 (vLLM aux convention)
    assert (c.block_size, c.mask_token_id, c.causal, c.kv_token_shape) == (7, 163837, False, (576,))
    assert c.rope.kind == "deepseek_yarn" and c.rope.interleaved
    assert abs(c.softmax_scale - (0.1 * 1.0 * torch.log(torch.tensor(32.0)).item() + 1) ** 2 / 192**0.5) < 1e-9
    req, _ = expected_shapes(c)
    assert req["context_proj.weight"] == (7168, 35840)
    assert req["markov_head.markov_w2.weight"] == (163840, 256)
    assert req["confidence_head.proj.weight"] == (1, 7424)
    big = parse_config({**INFERACT_K3, "num_attention_heads": 96, "num_key_value_heads": 96, "markov_rank": 512})
    req, _ = expected_shapes(big)  # 7168 % 96 != 0: MLA never divides hidden by heads
    assert req["layers.0.self_attn.q_b_proj.weight"] == (96 * 192, 1536)
    assert req["layers.0.self_attn.o_proj.weight"] == (7168, 96 * 128)
    assert req["layers.0.self_attn.kv_b_proj.weight"] == (96 * 256, 512)


def test_qwen3_contract_and_causality_rules():
    c = parse_config(QWEN3_CONFIG)
    assert c.contract().tap_layer_ids == (1, 3, 5) and not c.causal and not c.rope.interleaved
    assert parse_config({**QWEN3_CONFIG, "dflash_config": {"causal": True}}).causal
    assert not parse_config({**QWEN3_CONFIG, "is_causal": False, "dflash_config": {"causal": True}}).causal
    aux = parse_config({**QWEN3_CONFIG, "eagle_aux_hidden_state_layer_ids": [2, 4, 6]})
    assert aux.contract().tap_layer_ids == (2, 4, 6)  # already aux convention: taken as is
    emb = parse_config({**QWEN3_CONFIG, "target_layer_ids": [-1, 3, 5]})
    assert emb.contract().tap_layer_ids == (0, 4, 6)  # -1 = embeddings = aux id 0


def test_make_tiny_cli_writes_both_layouts(tmp_path, capsys):
    assert main(["--variant", "qwen3", "--out", str(tmp_path / "q"), "--set", "is_causal=true"]) == 0
    assert os.path.exists(tmp_path / "q" / "model.safetensors.index.json")
    assert os.path.exists(tmp_path / "q" / "target" / "model.safetensors.index.json")
    assert main(["--variant", "k3", "--out", str(tmp_path / "k")]) == 0
    assert "target" in capsys.readouterr().out
    for d in ("q", "k"):
        drafter = load_drafter(str(tmp_path / d), str(tmp_path / d / "target"), "cpu", "bf16", 1 << 20)
        assert drafter.contract.has_confidence and drafter.capacity_tokens() > 0
        c = drafter.contract
        rows = torch.randn(5, c.tap_width).to(torch.bfloat16).view(torch.int16).numpy().view("uint16")
        assert drafter.reserve(1, 0, 5)
        drafter.ingest([IngestItem(1, 0, 0, rows)])
        out = drafter.draft([DraftItem(1, 0, 5, 3, c.block_size, GREEDY)])[0]  # bf16 end to end on CPU
        assert len(out.tokens) == c.block_size and all(0 <= t < c.vocab_size for t in out.tokens)
    assert load_drafter(str(tmp_path / "q"), str(tmp_path / "q" / "target"), "cpu", "fp32", 1 << 20).cfg.causal


def test_k3_uses_the_target_embedding_like_vllm(tmp_path):
    """vLLM's K3 loader drops the draft's frozen embed copy and aliases the target's: so do we."""
    p = make_tiny("k3", str(tmp_path))
    c = load_drafter(p.draft, p.target, "cpu", "float32", 1 << 20).contract
    rows = torch.randn(6, c.tap_width).to(torch.bfloat16).view(torch.int16).numpy().view("uint16")

    def drafts() -> list[int]:
        d = load_drafter(p.draft, p.target, "cpu", "float32", 1 << 20)
        assert d.reserve(1, 0, 6)
        d.ingest([IngestItem(1, 0, 0, rows)])
        return d.draft([DraftItem(1, 0, 6, 3, c.block_size, GREEDY)])[0].tokens

    before = drafts()
    emb = torch.zeros(320, 64, dtype=torch.bfloat16)
    edit_tensors(os.path.join(p.draft, "model.safetensors"), replace={"embed_tokens.weight": emb})
    assert drafts() == before
    # without the target directory the draft's own copy is what there is (tokenspeed's choice)
    with pytest.raises(CheckpointError, match=r"no lm_head\.weight"):
        load_drafter(p.draft, None, "cpu", "float32", 1 << 20)
