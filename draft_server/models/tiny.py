"""``make_tiny``: write a random small DSpark draft checkpoint plus its matching target head.

The draft uses the public release layout and tensor names (config.json + safetensors):

- ``k3``: ``k3_dspark`` MLA draft, one ``model.safetensors``, carrying the frozen
  ``embed_tokens`` copy and no ``lm_head`` (as Inferact's K3 release); 6 heads over hidden 64,
  so hidden is not a multiple of heads; no ``block_size`` in the config (defaults to 7).
- ``qwen3``: DeepSpec ``Qwen3DSparkModel`` draft, sharded in two files with
  ``model.safetensors.index.json``, without embedding or lm_head (both come from the target).
  ``draft_vocab_size`` below ``vocab_size`` in the overrides makes a pruned draft with ``d2t``.

``<out>/target/`` holds a target-head directory: config.json and safetensors with only
``lm_head.weight`` and ``model.embed_tokens.weight`` (sharded with an index for qwen3).
Overrides replace config.json fields before the shapes are derived (e.g. ``is_causal=True``,
``num_attention_heads=96``, ``rope_parameters={...}``). Weights are random, stored in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, NamedTuple

import torch
from safetensors.torch import save_file

from draft_server.models.config import K3, expected_shapes, parse_config

K3_CONFIG: dict[str, Any] = {
    "architectures": ["K3DSparkModel"],
    "model_type": "k3_dspark",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": False,
    "mla_use_output_gate": False,
    "vocab_size": 320,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_theta": 50000.0,
    "num_target_layers": 3,
    "target_hidden_size": 64,
    "target_num_hidden_layers": 8,
    "target_layer_ids": [1, 4, 6],
    "mask_token_id": 317,
    "markov_rank": 16,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "tie_word_embeddings": False,
    "draft_vocab_size": 320,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

QWEN3_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3DSparkModel"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 320,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "hidden_act": "silu",
    "num_target_layers": 6,
    "target_layer_ids": [0, 2, 4],
    "block_size": 8,
    "mask_token_id": 318,
    "num_anchors": 64,
    "markov_rank": 16,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "layer_types": ["full_attention", "full_attention"],
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


class TinyPaths(NamedTuple):
    draft: str
    target: str


def _tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight") or "layernorm" in name:
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith("bias"):
        return 0.1 * torch.randn(shape, generator=g)
    if name == "markov_head.markov_w1.weight":
        return torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / shape[-1] ** 0.5


def _save(tensors: dict[str, torch.Tensor], directory: str, shards: int) -> None:
    names = list(tensors)
    if shards <= 1:
        save_file(tensors, os.path.join(directory, "model.safetensors"))
        return
    weight_map = {}
    per = -(-len(names) // shards)
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per : (s + 1) * per]}
        save_file(part, os.path.join(directory, fname))
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


def make_tiny(variant: str, out_dir: str, seed: int = 0, **overrides: Any) -> TinyPaths:
    """Write a random tiny draft checkpoint to ``out_dir`` and its target head to ``out_dir/target``."""
    if variant not in ("k3", "qwen3"):
        raise ValueError(f"variant must be 'k3' or 'qwen3', got {variant!r}")
    cfg_json = dict(K3_CONFIG if variant == "k3" else QWEN3_CONFIG)
    cfg_json.update(overrides)
    cfg = parse_config(cfg_json)
    g = torch.Generator().manual_seed(seed)
    req, _ = expected_shapes(cfg)
    V, H = cfg.vocab_size, cfg.hidden_size
    embed = torch.randn((V, H), generator=g)
    lm_head = torch.randn((V, H), generator=g) / H**0.5
    draft: dict[str, torch.Tensor] = {}
    for name, shape in req.items():
        if name == "d2t":
            keep = torch.sort(torch.randperm(V, generator=g)[: cfg.draft_vocab_size]).values
            draft[name] = keep - torch.arange(cfg.draft_vocab_size)  # target id = draft id + d2t[id]
        else:
            draft[name] = _tensor(name, shape, g)
    if cfg.variant == K3:
        draft["embed_tokens.weight"] = embed  # the frozen copy Inferact's release carries
    draft = {n: t if n == "d2t" else t.to(torch.bfloat16).contiguous() for n, t in draft.items()}
    os.makedirs(out_dir, exist_ok=True)
    _save(draft, out_dir, shards=1 if cfg.variant == K3 else 2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg_json, f, indent=1)
    target_dir = os.path.join(out_dir, "target")
    os.makedirs(target_dir, exist_ok=True)
    head = {"model.embed_tokens.weight": embed.to(torch.bfloat16), "lm_head.weight": lm_head.to(torch.bfloat16)}
    _save(head, target_dir, shards=1 if cfg.variant == K3 else 2)
    with open(os.path.join(target_dir, "config.json"), "w") as f:
        tcfg = {
            "model_type": "kimi_k3" if cfg.variant == K3 else "qwen3",
            "hidden_size": H,
            "vocab_size": V,
            "num_hidden_layers": int(cfg_json.get("target_num_hidden_layers", cfg_json.get("num_target_layers", 8))),
            "tie_word_embeddings": False,
        }
        json.dump(tcfg, f, indent=1)
    return TinyPaths(out_dir, target_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="draft-server make-tiny", description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=["k3", "qwen3"], required=True)
    ap.add_argument("--out", required=True, help="output directory (the target head goes to OUT/target)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a config.json field")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, _, val = item.partition("=")
        try:
            overrides[key] = json.loads(val)
        except json.JSONDecodeError:
            overrides[key] = val
    paths = make_tiny(args.variant, args.out, seed=args.seed, **overrides)
    print(f"draft:  {paths.draft}\ntarget: {paths.target}")
    return 0
