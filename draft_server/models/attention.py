"""How block rows reach their context: the attention back ends a forward pass is given.

A layer's attention (``layers/mla.py``, ``layers/gqa.py``) computes its queries ``q`` [N, B, H, D]
and the block's own cache tokens ``blk`` [N, B, *token_shape], then asks the context
``ctx.attend(layer, q, blk)`` for the attention output in value space [N, B, H, Dv]. What the
context is decides the cost, never the math:

- ``DenseContext``: every session's context tokens as a dense tensor per layer plus an explicit
  visibility mask over [context ; block] (the eager reference, and training, where many
  anchors of one sequence attend with a block-diagonal mask). Costs batch x the longest context.
- ``PagedContext``: the block's rows are written into the paged cache at their positions (the
  reserved scratch rows), then the Triton kernels read every session's pages in place
  (``kernels/paged_attention.py``): no gather, no padding, cost = the sum of the contexts. MLA
  in bf16 on a Hopper GPU with 64-token pages reads them through FlashMLA instead
  (``kernels/flash_mla.py``).

``TokenLayout`` says how a cached token splits into keys and values: MLA (one latent, keys =
the whole 576-wide row, values = its first ``kv_lora`` dims, all heads share it) or GQA (K and V
per kv head, ``group`` query heads per kv head).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from draft_server.models.layers.ops import block_attention

Query = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # MLA may pass (q_lat, q_pe) apart


class AttentionContext(Protocol):
    """Where a layer's block rows find their context."""

    def attend(self, layer: int, q: Query, blk: torch.Tensor | None) -> torch.Tensor:
        """The attention output; ``blk`` None: the block's tokens are in place already (``block_slots``)."""
        ...

    def block_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a layer may write its block's own cache tokens itself: (this layer's cache
        [1, slots, *token_shape], the block rows' slots [N * B]); None: pass them to ``attend``."""
        ...

    def query_buffer(self, n: int) -> torch.Tensor | None:
        """Where an MLA layer writes its whole query [n, B, H, 576] when the kernel reads it so
        (FlashMLA); None: pass ``(q_lat, q_pe)`` apart."""
        ...


@dataclass(frozen=True)
class TokenLayout:
    mla: bool
    value_dims: int  # MLA: kv_lora (the value part of the latent); GQA: head_dim
    group: int = 1  # GQA: query heads per kv head

    def attend_dense(self, q: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """q [N, B, H, D] over tokens [N, S, *token_shape] with mask [N, B, S] -> [N, B, H, Dv]."""
        N, B, H, _ = q.shape
        if self.mla:
            qq = q.permute(0, 2, 1, 3).unsqueeze(1)  # [N, 1, H, B, 576]: all heads share one latent stream
            lat = tokens.unsqueeze(1)
            o = block_attention(qq, lat, lat[..., : self.value_dims], mask, scale)  # [N, 1, H, B, Dv]
            return o[:, 0].permute(0, 2, 1, 3)
        nkv = H // self.group
        keys = tokens[:, :, 0].transpose(1, 2)  # [N, nkv, S, hd]
        vals = tokens[:, :, 1].transpose(1, 2)
        qg = q.reshape(N, B, nkv, self.group, -1).permute(0, 2, 3, 1, 4)  # [N, nkv, g, B, hd]
        o = block_attention(qg, keys, vals, mask, scale)  # [N, nkv, g, B, hd]
        return o.permute(0, 3, 1, 2, 4).reshape(N, B, H, -1)


@dataclass
class PagedBatch:
    """The device-side description of a batch for ``PagedContext`` (all int32 [N] unless noted)."""

    pages: torch.Tensor  # block table, [N, L] (may be a ragged flat list viewed with row stride 0)
    first: torch.Tensor  # logical page of pages[n, 0]
    lo: torch.Tensor  # context start
    pos: torch.Tensor  # anchor position: the block occupies [pos, pos + B)
    slots: torch.Tensor  # int32 or int64 [N * B]: cache slots of the block rows (scratch)
    width: torch.Tensor  # block rows in use (<= B): a non-causal block sees its first ``width`` rows
    plan: object  # kernels.paged_attention.WorkPlan
    workspace: object  # kernels.paged_attention.Workspace
    out: torch.Tensor  # [N, B, H, Dv] output buffer, reused by every layer
    config: object = None  # kernels.paged_attention.KernelConfig of the launch (None: the kernel's default)
    flash: object = None  # kernels.flash_mla.FlashMLA: MLA through FlashMLA (prepared for this batch)
    mixed: bool = False  # with flash: sessions starting mid-page take the Triton kernel's rows


class PagedContext:
    """Block rows attend in place over the paged cache (see the module docstring)."""

    def __init__(self, cache: object, batch: PagedBatch, layout: TokenLayout, scale: float, causal: bool) -> None:
        self.cache, self.batch, self.layout, self.scale, self.causal = cache, batch, layout, scale, causal

    def query_buffer(self, n: int) -> torch.Tensor | None:
        flash = self.batch.flash
        return None if flash is None else flash.q[:n]  # type: ignore[attr-defined]

    def block_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.cache.slots_view()[layer : layer + 1], self.batch.slots  # type: ignore[attr-defined]

    def attend(self, layer: int, q: Query, blk: torch.Tensor | None) -> torch.Tensor:
        from draft_server.models.kernels.paged_attention import gqa_paged_attention, mla_paged_attention

        b, cache = self.batch, self.cache
        if blk is not None:
            cache.write_layer(layer, b.slots, blk.reshape(-1, *blk.shape[2:]))  # type: ignore[attr-defined]
        kv = cache.layer(layer)  # type: ignore[attr-defined]
        q, q_rope = q if isinstance(q, tuple) else (q, None)
        args = (q, kv, b.pages, b.first, b.lo, b.pos)
        common = dict(
            scale=self.scale,
            causal=self.causal,
            plan=b.plan,
            workspace=b.workspace,
            out=b.out,
            width=b.width,
            config=b.config,
        )
        if not self.layout.mla:
            return gqa_paged_attention(*args, **common)  # type: ignore[arg-type]
        flash = b.flash
        if flash is not None:
            o = flash.attend(q, q_rope, kv)  # type: ignore[attr-defined]
            if not b.mixed:
                return o
            if q_rope is None:  # the Triton kernel reads the two parts of the whole query in place
                q, q_rope = q[..., : self.layout.value_dims], q[..., self.layout.value_dims :]
                args = (q, kv, b.pages, b.first, b.lo, b.pos)
        # the Triton kernel reads q and q_rope through their strides
        t = mla_paged_attention(*args, kv_lora=self.layout.value_dims, q_rope=q_rope, **common)  # type: ignore[arg-type]
        if flash is None:
            return t
        mid_page = (b.lo % flash.page != 0).view(-1, 1, 1, 1)  # type: ignore[attr-defined]
        return torch.where(mid_page, t, o)


class DenseContext:
    """Context tokens per layer (``ctx(layer)`` -> [N, S, *token_shape]) and mask [N, B, S + B]."""

    def __init__(
        self, ctx: Callable[[int], torch.Tensor], mask: torch.Tensor, layout: TokenLayout, scale: float
    ) -> None:
        self.ctx, self.mask, self.layout, self.scale = ctx, mask, layout, scale

    def query_buffer(self, n: int) -> torch.Tensor | None:
        return None

    def block_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def attend(self, layer: int, q: Query, blk: torch.Tensor | None) -> torch.Tensor:
        if blk is None:
            raise ValueError("a dense context takes the block's tokens in attend")
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        tokens = torch.cat([self.ctx(layer), blk.to(q.dtype)], dim=1)
        # Tokens no row may see (padding, stale or foreign pages) are zeroed, not only masked: a zero
        # attention weight times a NaN value is still NaN.
        seen = self.mask.any(dim=1).view(*self.mask.shape[:1], -1, *([1] * (tokens.dim() - 2)))
        tokens = tokens.masked_fill(~seen, 0)
        return self.layout.attend_dense(q, tokens, self.mask, self.scale)
