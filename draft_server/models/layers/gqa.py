"""Qwen3-backbone DSpark attention (GQA, Qwen3 per-head q_norm/k_norm, NeoX RoPE by default).

A token caches K and V per kv head: ``k = RoPE(k_norm(k_proj(x)))``, ``v = v_proj(x)``, where
x is the fused context c for context rows (not passed through the layer's input norm, as in
DeepSpec and vLLM's ``precompute_and_store_context_kv``) and the normed hidden state u for
block rows. Context K/V of all layers come from one stacked GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draft_server.models.attention import AttentionContext, TokenLayout
from draft_server.models.config import DSparkConfig
from draft_server.models.layers.ops import rms_norm
from draft_server.models.model import DSparkModel


class Qwen3DSpark(DSparkModel):
    def __init__(self, cfg: DSparkConfig, w: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
        super().__init__(cfg, w, device, dtype)
        self.token_shape = (2, cfg.num_kv_heads, cfg.head_dim)
        self.layout = TokenLayout(mla=False, value_dims=cfg.head_dim, group=cfg.num_heads // cfg.num_kv_heads)
        L = range(cfg.num_layers)
        sa = "layers.{}.self_attn."
        self.kv_w = torch.cat(
            [torch.cat([w[sa.format(i) + "k_proj.weight"], w[sa.format(i) + "v_proj.weight"]]) for i in L]
        )
        self.kv_b = None
        if cfg.attention_bias:
            self.kv_b = torch.cat(
                [torch.cat([w[sa.format(i) + "k_proj.bias"], w[sa.format(i) + "v_proj.bias"]]) for i in L]
            )
        self.k_norm = torch.stack([w[sa.format(i) + "k_norm.weight"] for i in L])  # [L, hd]

    def _bias(self, i: int, name: str) -> torch.Tensor | None:
        return self.w[f"layers.{i}.self_attn.{name}.bias"] if self.cfg.attention_bias else None

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        R, L = c.shape[0], cfg.num_layers
        kv = F.linear(c, self.kv_w, self.kv_b).view(R, L, 2, cfg.num_kv_heads, cfg.head_dim)
        k = rms_norm(kv[:, :, 0], self.k_norm[None, :, None, :], self.eps)
        cos, sin = self.rope.cos_sin(positions, self.acc)
        k = self.rope.apply(k, cos[:, None, None], sin[:, None, None])
        return torch.stack([k, kv[:, :, 1]], dim=2).transpose(0, 1)  # [L, R, 2, nkv, hd]

    def attention(self, i: int, u: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        cfg, w, p = self.cfg, self.w, f"layers.{i}.self_attn."
        N, B, _ = u.shape
        nkv, hd = cfg.num_kv_heads, cfg.head_dim
        cos, sin = self.rope.cos_sin(positions, self.acc)  # [N, B, hd/2]
        cos, sin = cos[:, :, None], sin[:, :, None]
        q = F.linear(u, w[p + "q_proj.weight"], self._bias(i, "q_proj")).view(N, B, cfg.num_heads, hd)
        q = self.rope.apply(rms_norm(q, w[p + "q_norm.weight"], self.eps), cos, sin)
        k = F.linear(u, w[p + "k_proj.weight"], self._bias(i, "k_proj")).view(N, B, nkv, hd)
        k = self.rope.apply(rms_norm(k, w[p + "k_norm.weight"], self.eps), cos, sin)
        v = F.linear(u, w[p + "v_proj.weight"], self._bias(i, "v_proj")).view(N, B, nkv, hd)
        o = ctx.attend(i, q, torch.stack([k, v], dim=2))  # [N, B, H, hd]
        return F.linear(o.reshape(N, B, cfg.num_heads * hd), w[p + "o_proj.weight"], self._bias(i, "o_proj"))
