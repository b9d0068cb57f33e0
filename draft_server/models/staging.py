"""Rows from the wire to the device, and the context they give, in each wire format.

Owns the server's half of ``protocol.wire``: rows stay in their wire storage until they are on
the device (bf16 bit patterns as int16, fp8 rows as uint8, f32 as float32; ``STORAGE``), then
``context_rows`` turns them into the fused context c [rows, hidden]: bf16 taps through the
model's ``context`` (context projection + norm), fp8 taps dequantized on the device (codes x the
row's float32 scale) and then the same, projected rows already are c (the client applied the
projection; only a cast to the model's dtype is left).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from draft_server.drafters.base import DeviceRows, device_runs
from protocol import DType, WireFormat
from protocol.wire import SCALE_BYTES, projection_id

if TYPE_CHECKING:
    from draft_server.models.model import DSparkModel

# torch dtype each wire dtype is staged in (bf16 as int16: numpy has no bf16, the bits are the same)
STORAGE: dict[DType, torch.dtype] = {
    DType.BF16: torch.int16,
    DType.F16: torch.float16,
    DType.F32: torch.float32,
    DType.U8: torch.uint8,
}


def rows_to_device(arrays: Sequence[np.ndarray | DeviceRows], device: torch.device) -> torch.Tensor:
    """Concatenate rows of one format (numpy, as received, or ``DeviceRows`` already on the device:
    transport cuda_ipc) on the device, in wire storage."""
    if any(isinstance(a, DeviceRows) for a in arrays):
        parts: list[torch.Tensor] = []  # each run of neighbouring device rows one tensor, host rows copied up
        for on_device, group in itertools.groupby(arrays, key=lambda a: isinstance(a, DeviceRows)):
            if on_device:
                parts += [d.tensor() for d in device_runs(list(group))]  # type: ignore[arg-type]
            else:
                parts.append(rows_to_device(list(group), device))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    host = arrays[0] if len(arrays) == 1 and arrays[0].flags.writeable else np.concatenate(arrays)
    if host.dtype == np.uint16:
        host = host.view(np.int16)
    return torch.from_numpy(np.ascontiguousarray(host)).to(device, non_blocking=True)


def dequantize_fp8(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 rows [R, W + 4] uint8 (W e4m3 codes, then the row's float32 scale) -> taps [R, W] in ``dtype``."""
    w = rows.shape[1] - SCALE_BYTES
    codes = rows[:, :w].view(torch.float8_e4m3fn)
    scale = rows[:, w:].contiguous().view(torch.float32)  # [R, 1]
    return (codes.to(torch.float32) * scale).to(dtype)


def context_rows(m: DSparkModel, rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows of wire format ``fmt`` in wire storage, on the device -> the fused context c [R, H]."""
    if rows.dtype == torch.int16:
        rows = rows.view(torch.bfloat16)
    if fmt == WireFormat.PROJECTED:
        return rows.to(m.dtype)
    taps = dequantize_fp8(rows, m.dtype) if fmt == WireFormat.FP8 else rows.to(m.dtype)
    return m.context(taps)


def torch_projection_id(proj: torch.Tensor, norm: torch.Tensor, eps: float) -> str:
    """``protocol.wire.projection_id`` of these weights (any device and dtype), 1,024 rows at a time."""

    def blocks(t: torch.Tensor) -> Iterator[np.ndarray]:
        for a in range(0, t.shape[0], 1024):
            yield t[a : a + 1024].detach().to("cpu", torch.float32).numpy()

    return projection_id([(tuple(proj.shape), blocks(proj)), (tuple(norm.shape), blocks(norm))], eps)
