"""Kimi-K3 DSpark attention: MLA with q-LoRA, absorbed ``kv_b_proj``, interleaved RoPE.

A token caches one 576-wide latent per layer: ``[kv_a_layernorm(c~) (512); RoPE(k~) (64)]`` with
``[c~; k~] = kv_a_proj_with_mqa(x)`` (x = fused context for context rows, the normed hidden
state for block rows). Context latents of all layers come from one stacked GEMM (vLLM's
``context_kv_proj``). Queries: ``q_b_proj(q_a_layernorm(q_a_proj(u)))`` split into
128 nope + 64 rope dims per head. Attention runs in latent space: the nope query is absorbed
through W_UK (the K half of ``kv_b_proj``), scores are ``[q_lat; q_pe] . latent``, the output
latent goes through W_UV (the V half) and ``o_proj``. Nothing divides hidden_size by heads.
"""

from __future__ import annotations

from typing import Any

import torch

from draft_server.models.attention import AttentionContext, Query, TokenLayout
from draft_server.models.config import DSparkConfig
from draft_server.models.layers.ops import rms_norm
from draft_server.models.model import DSparkModel


class K3DSpark(DSparkModel):
    def __init__(self, cfg: DSparkConfig, w: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
        super().__init__(cfg, w, device, dtype)
        self.lat = cfg.kv_lora_rank
        self.token_shape = (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)
        self.layout = TokenLayout(mla=True, value_dims=cfg.kv_lora_rank)
        L = range(cfg.num_layers)
        sa = "layers.{}.self_attn."
        self.kv_a_all = torch.cat([w[sa.format(i) + "kv_a_proj_with_mqa.weight"] for i in L])  # [L*576, H]
        self.kv_a_norm = torch.stack([w[sa.format(i) + "kv_a_layernorm.weight"] for i in L])  # [L, 512]
        nope, vd = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.w_uk, self.w_uv = [], []
        for i in L:
            kv_b = w[sa.format(i) + "kv_b_proj.weight"].view(cfg.num_heads, nope + vd, cfg.kv_lora_rank)
            self.w_uk.append(kv_b[:, :nope])  # [heads, nope, 512]
            self.w_uv.append(kv_b[:, nope:])  # [heads, v, 512]
        self.qkv_a = [
            self._stack(
                sa.format(i) + "fused_qkv_a_proj.weight",
                [sa.format(i) + n for n in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight")],
            )
            for i in L
        ]

    def _route_attention(self) -> None:
        """fused_qkv_a per layer; the context latents of all layers: one GEMM per layer's kv_a source
        (vLLM's ``context_kv_proj`` shards), a dense layer's rows as a ``DenseLinear``."""
        from draft_server.models.exl3.linear import DenseLinear, FusedLinear

        fused = [self.linears.get(f"layers.{i}.self_attn.fused_qkv_a_proj.weight") for i in range(self.cfg.num_layers)]
        if not any(fused):
            return
        self.qkv_a = [f or t for f, t in zip(fused, self.qkv_a, strict=True)]
        kv, n = self.kv_a_all, self.token_shape[0]
        parts = [f.parts[1] if f else DenseLinear(f"kv_a.{i}", kv[i * n : (i + 1) * n]) for i, f in enumerate(fused)]
        self.kv_a_all = FusedLinear("context_kv_proj", parts)

    def _latent(
        self,
        kv: torch.Tensor,
        norm_w: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layers_first: bool = False,
        into: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """kv [R, L, 576] raw kv_a output of R rows (positions) in L layers, cos/sin [R, rope/2] -> cached
        tokens [R, L, 576] ([L, R, 576] with ``layers_first``); on a GPU in one kernel (``fused.mla_latent``),
        which writes them straight into cache slots with ``into`` (cache [L, slots, 576], slots [R])."""
        if self._fused_rows(kv, cos):
            from draft_server.models.kernels.fused import mla_latent

            eps, inter = self.eps, self.rope.interleaved
            return mla_latent(kv, norm_w, cos, sin, eps, inter, layers_first=layers_first, into=into)
        if into is not None:
            raise ValueError("rows go into cache slots only through the fused kernel")
        c = rms_norm(kv[..., : self.lat], norm_w, self.eps)
        tok = torch.cat([c, self.rope.apply(kv[..., self.lat :], cos[:, None], sin[:, None])], dim=-1)
        return tok.transpose(0, 1) if layers_first else tok

    def _context_inputs(
        self, c: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every layer's raw kv_a rows [R, L, 576] of context rows c, and their cos/sin."""
        kv = self.linear(c, self.kv_a_all).view(c.shape[0], self.cfg.num_layers, -1)
        return (kv, *self.rope.cos_sin(positions, self.acc))

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kv, cos, sin = self._context_inputs(c, positions)
        return self._latent(kv, self.kv_a_norm, cos, sin, layers_first=True)  # [L, R, 576]

    def write_context(self, cache: Any, slots: torch.Tensor, c: torch.Tensor, positions: torch.Tensor) -> None:
        """On a GPU the cached tokens go from the latent kernel straight into their slots (no index_copy)."""
        kv, cos, sin = self._context_inputs(c, positions)
        dest = cache.slots_view()
        if self._fused_rows(kv, cos, dest):
            self._latent(kv, self.kv_a_norm, cos, sin, into=(dest, slots))
        else:
            cache.write(slots, self._latent(kv, self.kv_a_norm, cos, sin, layers_first=True))

    def attention(
        self, i: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext
    ) -> torch.Tensor:
        cfg, w, p = self.cfg, self.w, f"layers.{i}.self_attn."
        N, B, _ = h.shape
        nh, nope = cfg.num_heads, cfg.qk_nope_head_dim
        cos, sin = rope
        qkv_a = self.norm_linear(h, self.input_norm(i), self.eps, self.qkv_a[i])  # [q_a (q_lora) | kv_a (576)]
        q_a = qkv_a[..., : cfg.q_lora_rank]
        q = self.norm_linear(q_a, w[p + "q_a_layernorm.weight"], self.eps, w[p + "q_b_proj.weight"])
        q = q.view(N, B, nh, nope + cfg.qk_rope_head_dim)
        q_nope = q.view(N * B, nh, -1)[..., :nope].transpose(0, 1)  # [nh, N*B, nope], read in place
        c, s = cos[:, :, None], sin[:, :, None]
        whole = ctx.query_buffer(N)
        if whole is None:
            q_pe = self.rope.apply(q[..., nope:], c, s)
            query: Query = (torch.bmm(q_nope, self.w_uk[i]).view(nh, N, B, self.lat).permute(1, 2, 0, 3), q_pe)
        else:  # the kernel reads [q_lat; q_pe] as one row: both land in its buffer, W_UK's product in place
            torch.bmm(q_nope, self.w_uk[i], out=whole.view(N * B, nh, -1)[..., : self.lat].transpose(0, 1))
            self.rope.apply(q[..., nope:], c, s, out=whole[..., self.lat :])
            query = whole
        kv = qkv_a[..., cfg.q_lora_rank :].reshape(N * B, 1, -1)  # a view: qkv_a's rows are evenly strided
        cos2, sin2 = cos.reshape(N * B, -1), sin.reshape(N * B, -1)
        dest = ctx.block_slots(i)
        if dest is not None and not self._fused_rows(kv, cos2, dest[0]):  # else attend writes them (index_copy)
            dest = None
        blk = self._latent(kv, w[p + "kv_a_layernorm.weight"], cos2, sin2, into=dest)
        # the block's own tokens: in the cache already (dest), or for the context to place
        o = ctx.attend(i, query, None if dest is not None else blk.view(N, B, -1))  # [N, B, nh, 512]
        out = torch.empty(N * B, nh, cfg.v_head_dim, dtype=o.dtype, device=o.device)
        torch.bmm(o.reshape(N * B, nh, self.lat).transpose(0, 1), self.w_uv[i].transpose(1, 2), out=out.transpose(0, 1))
        return out.view(N, B, nh * cfg.v_head_dim)
