"""The DSpark draft network, batched over sessions: context ingest and the block forward.

Owns what both backbones share: tap fusion (``context_proj``/``context_norm`` for K3,
``fc``/``hidden_norm`` for Qwen3), the pre-norm decoder loop with SwiGLU MLPs, the final norm
and the base logits. The attention of one layer (what a token caches, and how the block rows
attend) lives in ``qwen3.py`` (GQA) and ``k3_mla.py`` (MLA).

Shapes: N sessions, B block rows, S gathered context slots (pages x page size, masked),
H hidden. Weights are plain tensors (``self.w`` by checkpoint name). The GEMMs of weights an EXL3
checkpoint may quantize go through ``self.linear`` / ``linear_add`` / ``swiglu_add``, which are the plain
ops of ``layers/ops.py``; ``route_linears`` (EXL3 only) swaps them, per instance, for versions that also
take packed linears, and puts those modules where the dense weights were.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from draft_server.models import gemm
from draft_server.models.attention import AttentionContext, TokenLayout
from draft_server.models.config import K3, DSparkConfig
from draft_server.models.layers import ops
from draft_server.models.layers.ops import Rope, acc_dtype, rms_norm


class DSparkModel:
    """Base: subclasses implement ``context_kv``, ``attention`` and set ``token_shape`` and ``layout``."""

    token_shape: tuple[int, ...]
    layout: TokenLayout
    gate_up: list[Any]  # per layer: the stacked gate/up weight (or its FusedLinear)
    linear = staticmethod(gemm.linear)
    linear_add = staticmethod(ops.linear_add)
    swiglu_add = staticmethod(ops.swiglu_add)
    norm_linear = staticmethod(ops.norm_linear)  # rms_norm then a projection: one kernel where it can be

    def __init__(self, cfg: DSparkConfig, w: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
        self.cfg, self.w, self.device, self.dtype = cfg, w, device, dtype
        self.acc = acc_dtype(dtype)
        self.rope = Rope(cfg.rope, device)
        self.eps = cfg.rms_norm_eps
        k3 = cfg.variant == K3
        self.ctx_proj = w["context_proj.weight" if k3 else "fc.weight"]
        self.ctx_norm = w["context_norm.weight" if k3 else "hidden_norm.weight"]
        self.final_norm = w["final_norm.weight" if k3 else "norm.weight"]
        self.embed = w["embed_tokens.weight"]
        self.lm_head = w["lm_head.weight"]
        self.markov_w1 = w.get("markov_head.markov_w1.weight")
        self.markov_w2 = w.get("markov_head.markov_w2.weight")
        self.d2t = w.get("d2t")
        self.conf_w = w.get("confidence_head.proj.weight") if cfg.confidence else None
        self.conf_b = w.get("confidence_head.proj.bias") if cfg.confidence else None
        self.mask_cache: dict[int, torch.Tensor] = {}
        self.stacked: dict[str, list[str]] = {}  # stacked weight -> its sources (EXL3 keeps one GEMM per source)
        self.linears: dict[str, Any] = {}  # EXL3: runtime weight name -> module holding the packed tensors
        self.weight_info: Any = None  # format, bits, weight bytes (set by the loader)
        self.gate_up = [  # one GEMM for gate and up, as vLLM stacks them
            self._stack(
                f"layers.{i}.mlp.gate_up_proj.weight", [f"layers.{i}.mlp.{n}_proj.weight" for n in ("gate", "up")]
            )
            for i in range(cfg.num_layers)
        ]

    def _stack(self, fused: str, parts: list[str]) -> torch.Tensor:
        """Replace weights that read the same input by one stacked weight (one GEMM), named as vLLM names it."""
        t = torch.cat([self.w.pop(p) for p in parts])
        self.w[fused] = t
        self.stacked[fused] = list(parts)
        return t

    def route_linears(self) -> None:
        """EXL3: each GEMM site whose weight is quantized reads its packed module from ``self.linears``
        (``FusedLinear`` for a stacked weight), in place of the dense tensor, which is dropped."""
        from draft_server.models.exl3 import linear as exl3

        self.linear, self.linear_add, self.swiglu_add = exl3.linear, exl3.linear_add, exl3.swiglu_add
        self.norm_linear = exl3.norm_linear
        for name, mod in self.linears.items():
            if name in self.w:
                self.w[name] = mod
        ctx = "context_proj.weight" if self.cfg.variant == K3 else "fc.weight"
        self.ctx_proj = self.linears.get(ctx, self.ctx_proj)
        self.gate_up = [self.linears.get(f"layers.{i}.mlp.gate_up_proj.weight", t) for i, t in enumerate(self.gate_up)]
        self._route_attention()

    def _route_attention(self) -> None:
        """The variant's attention GEMM sites (``route_linears``)."""
        raise NotImplementedError

    # -- per-variant -------------------------------------------------------------------------
    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Fused context projection into every layer's cache rows: [L, R, *token_shape]."""
        raise NotImplementedError

    def write_context(self, cache: Any, slots: torch.Tensor, c: torch.Tensor, positions: torch.Tensor) -> None:
        """Fused context rows c [R, H] at ``positions`` into every layer's cache at ``slots`` (distinct)."""
        cache.write(slots, self.context_kv(c, positions))

    def _fused_rows(self, x: torch.Tensor, cos: torch.Tensor, cache: torch.Tensor | None = None) -> bool:
        """Whether a Triton kernel forms x's cached tokens (CUDA, a half or single dtype, float32 cos/sin)
        and, given the ``cache``, writes them into it itself (its dtype is x's: no rounding on the way)."""
        fused = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and cos.dtype == torch.float32
        return fused and (cache is None or cache.dtype == x.dtype)

    def attention(
        self, i: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext
    ) -> torch.Tensor:
        """Layer i attention of block rows h [N, B, H] (the residual stream: the layer's
        ``input_layernorm`` goes with the first projection, ``norm_linear``; cos/sin of their
        positions) over their context and the block itself: the heads' output [N, B, heads * v],
        before ``o_proj``."""
        raise NotImplementedError

    def input_norm(self, i: int) -> torch.Tensor:
        return self.w[f"layers.{i}.input_layernorm.weight"]

    # -- shared ------------------------------------------------------------------------------
    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """Taps [R, n_taps * target_hidden] (compute dtype) -> fused context c [R, H]."""
        return rms_norm(self.linear(taps, self.ctx_proj), self.ctx_norm, self.eps)

    def block_mask(self, ctx_mask: torch.Tensor, B: int, width: list[int] | None = None) -> torch.Tensor:
        """[N, B, S + B]: context visibility per session, then the block (full or causal). ``width``:
        per session, the block rows in use; a non-causal block sees only its first ``width`` rows."""
        blk = self.mask_cache.get(B)
        if blk is None:
            blk = torch.ones(B, B, dtype=torch.bool, device=self.device)
            blk = blk.tril() if self.cfg.causal else blk
            self.mask_cache[B] = blk
        n, s = ctx_mask.shape
        blocks = blk.expand(n, B, B)
        if width is not None and not self.cfg.causal and any(w < B for w in width):
            cols = torch.arange(B, device=self.device)
            w = torch.tensor(width, device=self.device)
            blocks = blocks & (cols[None, None, :] < w[:, None, None])
        return torch.cat([ctx_mask[:, None, :].expand(n, B, s), blocks], dim=-1)

    def block(self, ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Block rows ids/positions [N, B] over their sessions' context -> final-normed z [N, B, H]."""
        w, eps = self.w, self.eps
        rope = self.rope.cos_sin(positions, self.acc)  # once per step, shared by every layer
        h = F.embedding(ids, self.embed)
        for i in range(self.cfg.num_layers):
            p = f"layers.{i}."
            o = self.attention(i, h, rope, ctx)
            o_b = w.get(p + "self_attn.o_proj.bias")
            h = (
                self.linear_add(h, o, w[p + "self_attn.o_proj.weight"])
                if o_b is None
                else h + self.linear(o, w[p + "self_attn.o_proj.weight"], o_b)
            )
            post = (w[p + "post_attention_layernorm.weight"], eps)
            h = self.swiglu_add(h, h, self.gate_up[i], w[p + "mlp.down_proj.weight"], post)
        return rms_norm(h, self.final_norm, eps)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """Base draft-vocab logits in the accumulation dtype."""
        out = gemm.linear(z, self.lm_head).to(self.acc)
        return out * self.cfg.logit_scale if self.cfg.logit_scale != 1.0 else out

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor | None:
        return None if self.markov_w1 is None else F.embedding(prev, self.markov_w1)

    def markov_bias(self, e: torch.Tensor) -> torch.Tensor:
        out = F.linear(e, self.markov_w2).to(self.acc)
        return out * self.cfg.logit_scale if self.cfg.logit_scale != 1.0 else out

    def confidence_logit(self, z: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        feat = torch.cat([z, e], dim=-1) if self.cfg.confidence_with_markov else z
        return F.linear(feat.to(self.conf_w.dtype), self.conf_w, self.conf_b).squeeze(-1)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]
