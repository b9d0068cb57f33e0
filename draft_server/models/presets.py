"""Full-size random-weight presets: serve a real-sized DSpark drafter without a checkpoint.

`draft-server serve --model random:k3` (or `random:qwen3-8b`) builds the model with the
dimensions of Kimi-K3 DSpark (5 MLA layers, hidden 7168, vocab 163840) or a Qwen3-8B-sized
DSpark directly on the device, with seeded random weights. Drafts are meaningless; latency,
memory and behaviour under load are real — what benchmarks and soak tests need before any
weights exist on the machine.
"""

from __future__ import annotations

import torch

from draft_server.models.config import expected_shapes, parse_config
from draft_server.models.drafter import DSparkDrafter
from draft_server.models.loader import build_model, resolve_device, resolve_dtype
from draft_server.models.tiny import K3_CONFIG, QWEN3_CONFIG

K3_FULL = {
    **K3_CONFIG,
    "hidden_size": 7168,
    "intermediate_size": 14336,
    "num_hidden_layers": 5,
    "num_attention_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 163840,
    "draft_vocab_size": 163840,
    "num_target_layers": 5,
    "target_hidden_size": 7168,
    "target_layer_ids": [2, 23, 47, 71, 89],
    "mask_token_id": 163837,
    "markov_rank": 256,
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
QWEN3_8B = {
    **QWEN3_CONFIG,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "target_layer_ids": [1, 9, 17, 25, 33],
    "num_target_layers": 36,
    "block_size": 7,
    "mask_token_id": 151669,
    "markov_rank": 256,
    "layer_types": ["full_attention"] * 5,
}


PRESETS = {"k3": K3_FULL, "qwen3-8b": QWEN3_8B}


def random_weights(cfg_json: dict, dev: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Seeded random tensors of every checkpoint name of the config (embedding and lm_head included), on ``dev``."""
    cfg = parse_config(cfg_json, "random")
    req, _ = expected_shapes(cfg)
    req["embed_tokens.weight"] = (cfg.vocab_size, cfg.hidden_size)
    req["lm_head.weight"] = (cfg.draft_vocab_size, cfg.hidden_size)
    g = torch.Generator(device=dev).manual_seed(0)
    w = {}
    for name, shape in req.items():
        if "norm" in name:
            w[name] = torch.ones(shape, device=dev, dtype=dtype)
        else:
            t = torch.randn(shape, device=dev, dtype=dtype, generator=g)
            w[name] = t.div_(shape[-1] ** 0.5) if name != "embed_tokens.weight" else t
        if name.startswith("confidence_head"):
            w[name] = w[name].float()
    return w


def random_drafter(
    cfg_json: dict,
    dev: torch.device,
    kv_bytes: int | None,
    dtype: torch.dtype = torch.bfloat16,
    attention: str = "auto",
    block_width: str = "k",
    page_size: int | None = None,
) -> DSparkDrafter:
    """A drafter of the given config with seeded random weights (``random_weights``), made on ``dev``."""
    model = build_model(parse_config(cfg_json, "random"), random_weights(cfg_json, dev, dtype), dev, dtype)
    return DSparkDrafter(
        model, kv_budget_bytes=kv_bytes, attention=attention, block_width=block_width, page_size=page_size
    )


def load_preset(
    name: str, device: str, dtype: str, kv_budget_bytes: int | None, attention: str = "auto", block_width: str = "k"
) -> DSparkDrafter:
    """``random:NAME``: a full-size drafter of a preset config with seeded random weights."""
    if name not in PRESETS:
        raise ValueError(f"unknown random preset {name!r} (have {sorted(PRESETS)})")
    dev = resolve_device(device)
    return random_drafter(PRESETS[name], dev, kv_budget_bytes, resolve_dtype(dtype, dev), attention, block_width)
