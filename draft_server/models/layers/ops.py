"""Small tensor ops shared by both backbones: RMSNorm, SwiGLU, RoPE, masked block attention.

RMSNorm and RoPE compute in float32 (float64 when the model runs in float64) and cast back.
RoPE angles are formed in float64 from integer positions, so large positions keep precision.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from draft_server.models import gemm
from draft_server.models.config import RopeSpec, yarn_mscale

Norm = tuple[torch.Tensor, float]  # an RMSNorm's weight and eps


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for norms, softmax and sampling: float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fused(x: torch.Tensor) -> bool:
    """CUDA tensors of a half or single dtype go through the Triton kernels (``kernels/fused.py``)."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.dim() <= 4


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out_dtype``: the result (rounded as x's dtype rounds) converted to it, on a GPU in the same kernel."""
    if _fused(x) and x.stride(-1) == 1:
        from draft_server.models.kernels.fused import rms_norm as fused_rms_norm

        return fused_rms_norm(x, w, eps, out_dtype)
    xf = x.to(acc_dtype(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf.to(x.dtype) * w
    return y if out_dtype is None else y.to(out_dtype)


def rms_rope(
    x: torch.Tensor, w: torch.Tensor, eps: float, rope: Rope, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``rope.apply(rms_norm(x, w, eps), cos, sin)``: one kernel on a GPU (``fused.rms_rope``)."""
    if _fused(x) and x.stride(-1) == 1 and w.stride(-1) == 1 and cos.dtype == torch.float32:
        from draft_server.models.kernels.fused import rms_rope as fused_rms_rope

        return fused_rms_rope(x, w, cos, sin, eps, rope.interleaved)
    return rope.apply(rms_norm(x, w, eps), cos, sin)


def linear_add(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """h + x @ w.T in one GEMM (the residual add in the epilogue; ``gemm`` picks the way per shape)."""
    return gemm.linear_add(h, x, w)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, with gate and up side by side on the last dim."""
    if _fused(gu):
        from draft_server.models.kernels.fused import silu_mul

        return silu_mul(gu)
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def swiglu_parts(
    g: torch.Tensor, u: torch.Tensor, dtype: torch.dtype, store: torch.dtype | None = None
) -> torch.Tensor:
    """silu(gate) * up in ``dtype`` from separate gate and up products (rounded to ``dtype`` first);
    ``store``: converted to that dtype (on a GPU in the same kernel)."""
    if _fused(g):
        from draft_server.models.kernels.fused import silu_mul_parts

        return silu_mul_parts(g, u, dtype, store)
    y = F.silu(g.to(dtype)) * u.to(dtype)
    return y if store is None else y.to(store)


def swiglu_add(
    h: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, norm: Norm | None = None
) -> torch.Tensor:
    """h + down(silu(gate(x)) * up(x)), with gate and up stacked in one weight [2F, H]; ``norm``
    (weight, eps): of ``rms_norm(x)`` (``norm_linear``)."""
    gu = gemm.linear(x, gate_up) if norm is None else norm_linear(x, norm[0], norm[1], gate_up)
    return linear_add(h, swiglu(gu), down)


def norm_linear(
    x: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor, b: torch.Tensor | None = None
) -> torch.Tensor:
    """rms_norm(x, norm_w, eps) @ w.T (+ b): the seam where a quantized weight takes its own way
    (``exl3.norm_linear``)."""
    return gemm.linear(rms_norm(x, norm_w, eps), w, b)


def rope_inv_freq(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] float64, cos/sin multiplier) for this RoPE spec."""
    d = spec.dim
    pos_freqs = spec.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    if spec.kind == "default":
        return 1.0 / pos_freqs, 1.0

    def corr_dim(rot: float) -> float:
        return d * math.log(spec.original_max_position / (rot * 2 * math.pi)) / (2 * math.log(spec.theta))

    low = max(math.floor(corr_dim(spec.beta_fast)), 0)
    high = min(math.ceil(corr_dim(spec.beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1.0 - ramp  # 1: keep the original frequency
    inv = (1.0 / (spec.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    if spec.kind == "deepseek_yarn":
        mul = yarn_mscale(spec.factor, spec.mscale) / yarn_mscale(spec.factor, spec.mscale_all_dim) * spec.attn_factor
    else:
        mul = yarn_mscale(spec.factor) * spec.attn_factor
    return inv, mul


class Rope:
    def __init__(self, spec: RopeSpec, device: torch.device) -> None:
        inv, self.mul = rope_inv_freq(spec)
        self.inv_freq = inv.to(device)
        self.mul_t = torch.tensor([self.mul], dtype=torch.float64, device=device)  # the fused kernel's operand
        self.interleaved = spec.interleaved

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [*positions.shape, dim/2] in ``dtype``: angles in float64 (large positions keep their
        precision), rounded once; on a GPU in one kernel that holds the float64 values in registers."""
        if positions.is_cuda and dtype == torch.float32 and not positions.dtype.is_floating_point:
            from draft_server.models.kernels.fused import cos_sin

            return cos_sin(positions.contiguous(), self.inv_freq, self.mul_t)
        ang = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq
        return (ang.cos() * self.mul).to(dtype), (ang.sin() * self.mul).to(dtype)

    def apply(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rotate x [..., dim] with cos/sin [..., dim/2] (broadcastable to x's leading dims); into ``out``
        (x's shape and dtype) when given."""
        if _fused(x) and x.stride(-1) == 1 and cos.dtype == torch.float32 and (out is None or out.stride(-1) == 1):
            from draft_server.models.kernels.fused import rope

            return rope(x, cos, sin, self.interleaved, out=out)
        y = self._apply_eager(x, cos, sin)
        return y if out is None else out.copy_(y)

    def _apply_eager(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        xf = x.to(cos.dtype)
        if self.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = xf.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped attention that never repeats K/V per head.

    q [N, G, g, B, D] (G kv groups of g query heads, B block rows), k [N, G, S, D],
    v [N, G, S, Dv], mask [N, B, S] bool (True = visible). Returns [N, G, g, B, Dv].
    The g heads are folded into the row dimension, so both products are plain batched GEMMs
    over (N, G) and K/V are read in place; scores and softmax run in the accumulation dtype.
    """
    N, G, g, B, D = q.shape
    acc = acc_dtype(q.dtype)
    scores = torch.matmul(q.reshape(N, G, g * B, D), k.transpose(-1, -2)).to(acc) * scale
    scores = scores.view(N, G, g, B, -1).masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(N, G, g * B, -1)
    return torch.matmul(probs, v).view(N, G, g, B, -1)
