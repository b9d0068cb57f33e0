"""Qwen3-backbone DSpark attention (GQA, Qwen3 per-head q_norm/k_norm, NeoX RoPE by default).

A token caches K and V per kv head: ``k = RoPE(k_norm(k_proj(x)))``, ``v = v_proj(x)``, where
x is the fused context c for context rows (not passed through the layer's input norm, as in
DeepSpec and vLLM's ``precompute_and_store_context_kv``) and the normed hidden state u for
block rows. Context K/V of all layers come from one stacked GEMM. On a GPU one kernel
(``fused.gqa_kv``) norms, ropes and writes K and copies V straight into the cache slots.
"""

from __future__ import annotations

from typing import Any

import torch

from draft_server.models.attention import AttentionContext, TokenLayout
from draft_server.models.config import DSparkConfig
from draft_server.models.layers.ops import rms_rope
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
        self.qkv = [
            self._stack(sa.format(i) + "qkv_proj.weight", [sa.format(i) + f"{n}_proj.weight" for n in "qkv"]) for i in L
        ]
        self.qkv_b = [
            self._stack(sa.format(i) + "qkv_proj.bias", [sa.format(i) + f"{n}_proj.bias" for n in "qkv"])
            if cfg.attention_bias
            else None
            for i in L
        ]

    def _route_attention(self) -> None:
        """qkv_proj per layer; the context K/V of all layers: each layer's k and v sources (a dense
        layer's rows as a ``DenseLinear``), the stacked bias added after."""
        from draft_server.models.exl3.linear import DenseLinear, FusedLinear

        fused = [self.linears.get(f"layers.{i}.self_attn.qkv_proj.weight") for i in range(self.cfg.num_layers)]
        if not any(fused):
            return
        self.qkv = [f or t for f, t in zip(fused, self.qkv, strict=True)]
        kv, n = self.kv_w, self.kv_w.shape[0] // self.cfg.num_layers
        parts = []
        for i, f in enumerate(fused):
            parts += f.parts[1:] if f else [DenseLinear(f"layers.{i}.kv", kv[i * n : (i + 1) * n])]
        self.kv_w = FusedLinear("context_kv_proj", parts)

    def _context_inputs(
        self, c: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every layer's raw K/V rows [R, L, 2, nkv, hd] of context rows c, and their cos/sin."""
        cfg = self.cfg
        kv = self.linear(c, self.kv_w, self.kv_b).view(c.shape[0], cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
        return (kv, *self.rope.cos_sin(positions, self.acc))

    def _context_tokens(self, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        k = rms_rope(kv[:, :, 0], self.k_norm[:, None, :], self.eps, self.rope, cos[:, None, None], sin[:, None, None])
        return torch.stack([k, kv[:, :, 1]], dim=2).transpose(0, 1)  # [L, R, 2, nkv, hd]

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._context_tokens(*self._context_inputs(c, positions))

    def write_context(self, cache: Any, slots: torch.Tensor, c: torch.Tensor, positions: torch.Tensor) -> None:
        """On a GPU K (normed, roped) and V go from one kernel straight into their slots (no index_copy)."""
        kv, cos, sin = self._context_inputs(c, positions)
        dest = cache.slots_view()
        if not self._fused_rows(kv, cos, dest):
            cache.write(slots, self._context_tokens(kv, cos, sin))
            return
        from draft_server.models.kernels.fused import gqa_kv

        gqa_kv(kv[:, :, 0], kv[:, :, 1], self.k_norm, cos, sin, self.eps, self.rope.interleaved, into=(dest, slots))

    def attention(
        self, i: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext
    ) -> torch.Tensor:
        cfg, w, p = self.cfg, self.w, f"layers.{i}.self_attn."
        N, B, _ = h.shape
        H, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = rope[0][:, :, None], rope[1][:, :, None]  # [N, B, 1, hd/2]
        qkv = self.norm_linear(h, self.input_norm(i), self.eps, self.qkv[i], self.qkv_b[i])
        qkv = qkv.view(N * B, H + 2 * nkv, hd)
        q = rms_rope(qkv[:, :H].view(N, B, H, hd), w[p + "q_norm.weight"], self.eps, self.rope, cos, sin)
        k_raw, v = qkv[:, H : H + nkv], qkv[:, H + nkv :]
        dest = ctx.block_slots(i)
        if dest is not None and self._fused_rows(k_raw, rope[0], dest[0]):  # the block's K/V into the cache directly
            from draft_server.models.kernels.fused import gqa_kv

            c2, s2 = rope[0].reshape(N * B, -1), rope[1].reshape(N * B, -1)
            gqa_kv(k_raw[:, None], v[:, None], w[p + "k_norm.weight"], c2, s2, self.eps, self.rope.interleaved, dest)
            o = ctx.attend(i, q, None)
        else:
            k = rms_rope(k_raw.view(N, B, nkv, hd), w[p + "k_norm.weight"], self.eps, self.rope, cos, sin)
            o = ctx.attend(i, q, torch.stack([k, v.view(N, B, nkv, hd)], dim=2))  # [N, B, H, hd]
        return o.reshape(N, B, H * hd)
