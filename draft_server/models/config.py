"""DSpark draft configs: parse ``config.json``, reject what we do not run, derive the contract.

Owns ``DSparkConfig`` (one flat, validated view of both checkpoint families), ``parse_config``,
``expected_shapes`` (every tensor name of the public checkpoint layout with its shape) and the
mapping to ``protocol.ModelContract``.

Families:

- ``k3_dspark`` (Kimi-K3 DSpark, Inferact / TorchSpec layout): MLA attention with q-LoRA,
  ``context_proj`` + ``context_norm``, ``final_norm``, 512-wide latent + 64 RoPE dims per token.
  ``hidden_size`` need not be divisible by ``num_attention_heads`` (K3.1-Pro: 96 heads, 7168).
- generic Qwen3-backbone DSpark (DeepSpec ``Qwen3DSparkModel`` layout): GQA attention with
  Qwen3's per-head ``q_norm``/``k_norm``, ``fc`` + ``hidden_norm``, ``norm``; optional pruned
  draft vocabulary (``draft_vocab_size`` < ``vocab_size``, with ``d2t`` and a draft ``lm_head``).

Tap indexing (open question 1 of dspark.md). The contract's ``tap_layer_ids`` use the vLLM aux
convention: aux id k is the residual stream after k decoder layers, i.e. HF
``hidden_states[k]`` (id 0 = embeddings). DeepSpec's ``target_layer_ids`` entry l means
``hidden_states[l + 1]`` (the output of 0-indexed layer l; -1 means the embeddings), so the
contract carries ``l + 1``. This is exactly what vLLM 0.32 does in
``get_eagle3_aux_layers_from_config`` (v2 runner) for ``target_layer_ids``,
``dspark_target_layer_ids`` and ``dflash_config.target_layer_ids``; an explicit
``eagle_aux_hidden_state_layer_ids`` is already in aux convention and is taken as is (vLLM's
precedence). Taps arrive concatenated in that (ascending) order.

Causality: ``is_causal`` wins, then ``dflash_config.causal``, else non-causal (every block row
sees the whole block), the vLLM rule (``_dflash_layer_causal``). Inferact K3 ships no
``dflash_config`` and is non-causal.

RoPE: K3 uses interleaved (GPT-J) pairs on the 64 rope dims; a non-default ``rope_type`` means
DeepSeek-YaRN with the softmax scale multiplied by mscale(factor, mscale_all_dim)^2 (vLLM K3
MLA). Qwen3 uses NeoX halves (``is_neox_style`` may override), default or standard YaRN.

``block_size`` missing on a ``k3_dspark`` config defaults to 7 (vLLM's default
``num_speculative_tokens`` for that config). ``dspark_draft_topk`` (vLLM's top-k Markov
approximation) is ignored: this server always applies the exact Markov bias.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from protocol import DType, ModelContract


class CheckpointError(ValueError):
    """A checkpoint we cannot serve. The message is one line naming tensor / flag / shape."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


K3 = "k3"
QWEN3 = "qwen3"

_K3_REJECTED_FLAGS = ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor", "fc_norm")
_QWEN3_REJECTED_FLAGS = ("dspark_bonus_anchor", "attn_output_gate", "use_output_gate", "fc_norm", "use_swa")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    dim: int  # rotated dims per head
    interleaved: bool  # GPT-J pairs (2i, 2i+1); False: NeoX halves (i, i + dim/2)
    kind: str = "default"  # default | yarn (HF/vLLM YaRN) | deepseek_yarn
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attn_factor: float = 1.0


@dataclass(frozen=True)
class DSparkConfig:
    variant: str  # K3 | QWEN3
    model_name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    rms_norm_eps: float
    vocab_size: int  # target vocabulary: embeddings, anchors, Markov W1 rows, returned ids
    draft_vocab_size: int  # lm_head / Markov W2 rows (< vocab_size: pruned, with d2t)
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]  # as written in the checkpoint (DeepSpec convention)
    tap_layer_ids: tuple[int, ...]  # contract / vLLM aux convention
    block_size: int
    mask_token_id: int
    markov_rank: int
    confidence: bool
    confidence_with_markov: bool
    causal: bool
    rope: RopeSpec
    logit_scale: float = 1.0
    # GQA (qwen3)
    num_kv_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    # MLA (k3)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_taps(self) -> int:
        return len(self.tap_layer_ids)

    @property
    def pruned_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    @property
    def kv_token_shape(self) -> tuple[int, ...]:
        """Cached elements per token per layer: MLA one latent; GQA K and V per kv head."""
        if self.variant == K3:
            return (self.kv_lora_rank + self.qk_rope_head_dim,)
        return (2, self.num_kv_heads, self.head_dim)

    @property
    def softmax_scale(self) -> float:
        if self.variant == K3:
            scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
            if self.rope.kind == "deepseek_yarn":
                m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
                scale *= m * m
            return scale
        return self.head_dim**-0.5

    def contract(self) -> ModelContract:
        return ModelContract(
            model_name=self.model_name,
            tap_layer_ids=self.tap_layer_ids,
            target_hidden_size=self.target_hidden_size,
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            mask_token_id=self.mask_token_id,
            tap_dtype=DType.BF16,
            has_confidence=self.confidence,
        )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _req(cfg: dict[str, Any], key: str, kind: type = int) -> Any:
    if key not in cfg or cfg[key] is None:
        raise CheckpointError(f"config.json: missing required field '{key}'")
    try:
        return kind(cfg[key])
    except (TypeError, ValueError):
        raise CheckpointError(f"config.json: field '{key}' must be {kind.__name__}, got {cfg[key]!r}") from None


def _flag(cfg: dict[str, Any], key: str) -> bool:
    v = cfg.get(key)
    if isinstance(v, dict):
        return bool(v)
    return bool(v)


def _variant_of(cfg: dict[str, Any]) -> str:
    mt = str(cfg.get("model_type", ""))
    arch = " ".join(cfg.get("architectures") or [])
    if mt == "k3_dspark" or "K3DSpark" in arch:
        return K3
    if "DSpark" in arch or mt in ("qwen3", "qwen3_dspark", "dspark") or "target_layer_ids" in cfg:
        if "kv_lora_rank" in cfg and mt != "qwen3":
            raise CheckpointError(f"config.json: MLA DSpark with model_type '{mt}' is not supported (want k3_dspark)")
        return QWEN3
    raise CheckpointError(f"config.json: model_type '{mt}' / architectures '{arch}' is not a DSpark draft")


def _tap_ids(cfg: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(checkpoint target_layer_ids, contract aux ids), in vLLM 0.32's precedence."""
    dflash = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    ids = cfg.get("target_layer_ids") or cfg.get("dspark_target_layer_ids") or dflash.get("target_layer_ids")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux:
        aux_ids = tuple(int(i) for i in aux)
        return (tuple(int(i) for i in ids) if ids else tuple(i - 1 for i in aux_ids)), aux_ids
    if not ids:
        raise CheckpointError("config.json: missing required field 'target_layer_ids'")
    ids = tuple(int(i) for i in ids)
    if any(i < -1 for i in ids) or list(ids) != sorted(set(ids)):
        raise CheckpointError(f"config.json: target_layer_ids {list(ids)} must be strictly increasing and >= -1")
    return ids, tuple(i + 1 for i in ids)


def _rope(cfg: dict[str, Any], variant: str, dim: int) -> RopeSpec:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    default_theta = 50000.0 if variant == K3 else 1000000.0
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    rtype = str(params.get("rope_type", params.get("type", "default")))
    if variant == K3:
        interleaved = True
        if cfg.get("rope_interleave") is False:
            raise CheckpointError(
                "config.json: rope_interleave=false is not supported for k3_dspark (MLA uses GPT-J RoPE)"
            )
    else:
        interleaved = not bool(cfg.get("is_neox_style", True))
    if rtype == "default":
        return RopeSpec(theta=theta, dim=dim, interleaved=interleaved)
    if rtype not in ("yarn", "deepseek_yarn"):
        raise CheckpointError(f"config.json: rope_type '{rtype}' is not supported (default or yarn)")
    if variant == K3 and not params.get("apply_yarn_scaling", True):
        raise CheckpointError("config.json: rope apply_yarn_scaling=false (deepseek_llama_scaling) is not supported")
    factor = float(params.get("factor", 1.0))
    orig = int(params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096)))
    return RopeSpec(
        theta=theta,
        dim=dim,
        interleaved=interleaved,
        kind="deepseek_yarn" if variant == K3 else "yarn",
        factor=factor,
        original_max_position=orig,
        beta_fast=float(params.get("beta_fast", 32)),
        beta_slow=float(params.get("beta_slow", 1)),
        mscale=float(params.get("mscale", 1.0)),
        mscale_all_dim=float(params.get("mscale_all_dim", 0.0)),
        attn_factor=float(params.get("attention_factor", params.get("attn_factor", 1.0)) or 1.0),
    )


def _causal(cfg: dict[str, Any]) -> bool:
    if cfg.get("is_causal") is not None:
        return bool(cfg["is_causal"])
    dflash = cfg.get("dflash_config")
    if isinstance(dflash, dict) and dflash.get("causal") is not None:
        return bool(dflash["causal"])
    return False


def parse_config(cfg: dict[str, Any], model_name: str = "dspark") -> DSparkConfig:
    """Validate a DSpark ``config.json`` dict; raise ``CheckpointError`` naming the problem."""
    variant = _variant_of(cfg)
    rejected = _K3_REJECTED_FLAGS if variant == K3 else _QWEN3_REJECTED_FLAGS
    for flag in rejected:
        if _flag(cfg, flag):
            raise CheckpointError(f"config.json: unsupported flag '{flag}'={cfg[flag]!r}")
    if cfg.get("sample_from_anchor", True) is False:
        raise CheckpointError("config.json: unsupported flag 'sample_from_anchor'=false (bonus-anchor 1+N layout)")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise CheckpointError(f"config.json: unsupported layer_types {sorted(set(layer_types))} (full_attention only)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config.json: hidden_act '{act}' is not supported (silu)")
    markov_rank = int(cfg.get("markov_rank") or 0)
    mtype = cfg.get("markov_head_type", "vanilla")
    if markov_rank > 0 and mtype != "vanilla":
        raise CheckpointError(f"config.json: markov_head_type '{mtype}' is not supported (vanilla)")
    confidence = bool(cfg.get("enable_confidence_head", False))
    conf_markov = confidence and bool(cfg.get("confidence_head_with_markov", False))
    if conf_markov and markov_rank == 0:
        raise CheckpointError("config.json: confidence_head_with_markov needs markov_rank > 0")

    hidden = _req(cfg, "hidden_size")
    heads = _req(cfg, "num_attention_heads")
    vocab = _req(cfg, "vocab_size")
    draft_vocab = int(cfg.get("draft_vocab_size") or vocab)
    target_ids, tap_ids = _tap_ids(cfg)
    dflash = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    mask = cfg.get("mask_token_id", dflash.get("mask_token_id"))
    if mask is None:
        raise CheckpointError("config.json: missing required field 'mask_token_id'")
    mask = int(mask)
    if not 0 <= mask < vocab:
        raise CheckpointError(f"config.json: mask_token_id {mask} outside vocab [0, {vocab})")
    block = int(cfg.get("block_size") or cfg.get("num_speculative_tokens") or (7 if variant == K3 else 0))
    if block <= 0:
        raise CheckpointError("config.json: missing required field 'block_size'")
    common: dict[str, Any] = dict(
        model_name=str(cfg.get("_name_or_path") or model_name),
        hidden_size=hidden,
        intermediate_size=_req(cfg, "intermediate_size"),
        num_layers=_req(cfg, "num_hidden_layers"),
        num_heads=heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
        target_layer_ids=target_ids,
        tap_layer_ids=tap_ids,
        block_size=block,
        mask_token_id=mask,
        markov_rank=markov_rank,
        confidence=confidence,
        confidence_with_markov=conf_markov,
        causal=_causal(cfg),
        logit_scale=float(cfg.get("logit_scale", 1.0)),
        extra=dict(cfg),
    )
    if variant == K3:
        if cfg.get("q_lora_rank") is None:
            raise CheckpointError("config.json: unsupported flag 'q_lora_rank'=None (k3_dspark needs q-LoRA)")
        if draft_vocab != vocab:
            raise CheckpointError(f"config.json: draft_vocab_size {draft_vocab} != vocab_size {vocab} (k3_dspark)")
        n_target = cfg.get("num_target_layers")
        if n_target is not None and int(n_target) != len(target_ids):
            raise CheckpointError(
                f"config.json: num_target_layers {n_target} != len(target_layer_ids) {len(target_ids)}"
            )
        rope_dim = _req(cfg, "qk_rope_head_dim")
        return DSparkConfig(
            variant=K3,
            rope=_rope(cfg, K3, rope_dim),
            q_lora_rank=_req(cfg, "q_lora_rank"),
            kv_lora_rank=_req(cfg, "kv_lora_rank"),
            qk_nope_head_dim=_req(cfg, "qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim,
            v_head_dim=_req(cfg, "v_head_dim"),
            **common,
        )
    if draft_vocab > vocab:
        raise CheckpointError(f"config.json: draft_vocab_size {draft_vocab} > vocab_size {vocab}")
    head_dim = int(cfg.get("head_dim") or 0)
    if not head_dim:
        if hidden % heads:
            raise CheckpointError(f"config.json: head_dim missing and hidden_size {hidden} % heads {heads} != 0")
        head_dim = hidden // heads
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"config.json: num_attention_heads {heads} not a multiple of num_key_value_heads {kv_heads}"
        )
    return DSparkConfig(
        variant=QWEN3,
        rope=_rope(cfg, QWEN3, head_dim),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        attention_bias=bool(cfg.get("attention_bias", False)),
        **common,
    )


def load_config(model_dir: str) -> DSparkConfig:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json in the draft checkpoint directory") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None
    if os.path.exists(os.path.join(model_dir, "mask_embedding.pt")):
        raise CheckpointError(f"{model_dir}: unsupported mask_embedding.pt (separate mask embedding)")
    return parse_config(cfg, model_name=os.path.basename(os.path.normpath(model_dir)) or "dspark")


def expected_shapes(c: DSparkConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(required, optional) checkpoint tensors with their shapes, in the public release layout.

    Optional: the frozen embedding / lm_head copies (the server then uses them instead of the
    target's), and ``t2d`` (training only). Names carry no ``model.`` prefix.
    """
    h, v, dv, r = c.hidden_size, c.vocab_size, c.draft_vocab_size, c.markov_rank
    req: dict[str, tuple[int, ...]] = {}
    if c.variant == K3:
        req["context_proj.weight"] = (h, c.n_taps * c.target_hidden_size)
        req["context_norm.weight"] = (h,)
        req["final_norm.weight"] = (h,)
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        for i in range(c.num_layers):
            p = f"layers.{i}."
            req[p + "input_layernorm.weight"] = (h,)
            req[p + "post_attention_layernorm.weight"] = (h,)
            req[p + "self_attn.q_a_proj.weight"] = (c.q_lora_rank, h)
            req[p + "self_attn.q_a_layernorm.weight"] = (c.q_lora_rank,)
            req[p + "self_attn.q_b_proj.weight"] = (c.num_heads * qk, c.q_lora_rank)
            req[p + "self_attn.kv_a_proj_with_mqa.weight"] = (c.kv_lora_rank + c.qk_rope_head_dim, h)
            req[p + "self_attn.kv_a_layernorm.weight"] = (c.kv_lora_rank,)
            req[p + "self_attn.kv_b_proj.weight"] = (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
            req[p + "self_attn.o_proj.weight"] = (h, c.num_heads * c.v_head_dim)
            req[p + "mlp.gate_proj.weight"] = (c.intermediate_size, h)
            req[p + "mlp.up_proj.weight"] = (c.intermediate_size, h)
            req[p + "mlp.down_proj.weight"] = (h, c.intermediate_size)
    else:
        req["fc.weight"] = (h, c.n_taps * c.target_hidden_size)
        req["hidden_norm.weight"] = (h,)
        req["norm.weight"] = (h,)
        qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for i in range(c.num_layers):
            p = f"layers.{i}."
            req[p + "input_layernorm.weight"] = (h,)
            req[p + "post_attention_layernorm.weight"] = (h,)
            req[p + "self_attn.q_proj.weight"] = (qd, h)
            req[p + "self_attn.k_proj.weight"] = (kvd, h)
            req[p + "self_attn.v_proj.weight"] = (kvd, h)
            req[p + "self_attn.o_proj.weight"] = (h, qd)
            if c.attention_bias:
                req[p + "self_attn.q_proj.bias"] = (qd,)
                req[p + "self_attn.k_proj.bias"] = (kvd,)
                req[p + "self_attn.v_proj.bias"] = (kvd,)
                req[p + "self_attn.o_proj.bias"] = (h,)
            req[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            req[p + "self_attn.k_norm.weight"] = (c.head_dim,)
            req[p + "mlp.gate_proj.weight"] = (c.intermediate_size, h)
            req[p + "mlp.up_proj.weight"] = (c.intermediate_size, h)
            req[p + "mlp.down_proj.weight"] = (h, c.intermediate_size)
        if c.pruned_vocab:
            req["lm_head.weight"] = (dv, h)
            req["d2t"] = (dv,)
    if r:
        req["markov_head.markov_w1.weight"] = (v, r)
        req["markov_head.markov_w2.weight"] = (dv, r)
    if c.confidence:
        req["confidence_head.proj.weight"] = (1, h + (r if c.confidence_with_markov else 0))
        req["confidence_head.proj.bias"] = (1,)
    opt: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (v, h), "t2d": (v,)}
    if not c.pruned_vocab:
        opt["lm_head.weight"] = (v, h)
    if not c.confidence:  # training-only head: present in some releases, ignored (as vLLM does)
        opt["confidence_head.proj.weight"] = (1, -1)
        opt["confidence_head.proj.bias"] = (1,)
    return req, opt
