"""The client's wire encoders: a step's taps, on the target's device, to rows of its wire format.

Owns ``WireEncoder``: taps [rows, n_taps * target_hidden] of any float dtype on the target's
device in, one C-contiguous host numpy array in the format's wire storage out (``protocol.wire``),
after one device-to-host copy of the (reduced) rows:

* ``bf16``: the taps rounded to bf16, as uint16 bit patterns;
* ``fp8``: per row, scale = amax / 448 and codes = taps / scale as e4m3 (float8_e4m3fn), the row's
  bytes being its codes then its float32 scale (the server dequantizes on its device);
* ``projected``: ``context_norm(context_proj(taps))`` with the draft checkpoint's weights
  (``target_client.projection.Projection``, moved to the device once). The math is the server's
  (``DSparkModel.context``: the linear, then RMSNorm in float32 cast back and times the weight),
  on the taps rounded to bf16 as the raw format would carry them, in the dtype the server's
  Welcome asks for (bf16; f32 when the drafter computes in f32/f64, where projected rows then give
  exactly the drafts raw taps give).

Lives under ``vllm/`` because it needs torch, which the client imports inside functions only.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from protocol import DType, WireFormat
from protocol.wire import FORMATS, FP8_MAX, SCALE_BYTES
from target_client.projection import Projection

if TYPE_CHECKING:
    import torch


class WireEncoder:
    """Encodes taps into rows of one wire format (see the module docstring)."""

    def __init__(self, fmt: str, projection: Projection | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown wire format {fmt!r} (one of {', '.join(FORMATS)})")
        if fmt == WireFormat.PROJECTED and projection is None:
            raise ValueError("the projected wire format needs the draft checkpoint's Projection")
        self.fmt = fmt
        self.projection = projection
        self._weights: dict[tuple[str, Any], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, taps: torch.Tensor, projected_dtype: DType = DType.BF16) -> np.ndarray:
        """Rows on the host for ``taps`` (``projected_dtype``: the Welcome's ``wire.projected_dtype``)."""
        return to_host(self.device_rows(taps, projected_dtype))

    def device_rows(self, taps: torch.Tensor, projected_dtype: DType = DType.BF16) -> torch.Tensor:
        """The rows in wire storage, still on the taps' device (bf16 and f32 as such, fp8 as uint8),
        always in a fresh tensor: the client keeps the frame by reference until it is acknowledged."""
        import torch

        if self.fmt == WireFormat.FP8:
            return quantize_fp8(taps)
        if self.fmt == WireFormat.PROJECTED:
            return self.project(taps, torch.float32 if projected_dtype == DType.F32 else torch.bfloat16)
        return taps.to(torch.bfloat16, copy=True).contiguous()  # fresh: never the caller's buffer

    def project(self, taps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The fused context c [rows, hidden] in ``dtype``, as the server's ``DSparkModel.context``."""
        import torch
        import torch.nn.functional as F

        assert self.projection is not None
        proj, norm = self._device_weights(taps.device, dtype)
        if taps.shape[-1] != proj.shape[1]:
            raise ValueError(f"taps width {taps.shape[-1]} != the projection's input width {proj.shape[1]}")
        y = F.linear(taps.to(torch.bfloat16).to(dtype), proj)
        yf = y.to(torch.float32)
        yf = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + self.projection.eps)
        return (yf.to(dtype) * norm).contiguous()

    def _device_weights(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (str(device), dtype)
        hit = self._weights.get(key)
        if hit is None:
            p = self.projection
            assert p is not None
            hit = (_tensor(p.proj, p.proj_dtype, device, dtype), _tensor(p.norm, p.norm_dtype, device, dtype))
            self._weights[key] = hit
        return hit


def quantize_fp8(taps: torch.Tensor) -> torch.Tensor:
    """fp8 rows [R, W + 4] uint8: W e4m3 codes of taps / scale, then the float32 scale = amax / 448."""
    import torch

    x = taps.to(torch.float32)
    r, w = x.shape
    scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch.empty((r, w + SCALE_BYTES), dtype=torch.uint8, device=taps.device)
    out[:, :w] = codes.view(torch.uint8)
    out[:, w:] = scale.view(torch.uint8)
    return out


def to_host(rows: torch.Tensor) -> np.ndarray:
    """One device-to-host copy (none on the CPU) and a numpy view in wire storage (bf16 as uint16).

    Into a fresh host tensor: the client keeps the frame by reference until the server has
    acknowledged its rows, so a reused staging buffer would need acknowledgement tracking."""
    import torch

    host = rows if rows.device.type == "cpu" else rows.to("cpu")
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(np.uint16)
    return host.numpy()


def _tensor(a: np.ndarray, stored: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A stored checkpoint array (BF16 as uint16 bits) as a torch tensor on ``device`` in ``dtype``."""
    import torch

    with warnings.catch_warnings():  # read-only file bytes: torch only reads them here
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a.view(np.int16) if stored == "BF16" else a)
    if stored == "BF16":
        t = t.view(torch.bfloat16)
    return t.to(device=device, dtype=dtype)
