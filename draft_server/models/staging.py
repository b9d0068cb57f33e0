"""Taps from the wire to the device: decode the wire dtype and copy the batch's rows to the GPU."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def taps_to_tensor(arrays: Sequence[np.ndarray], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Concatenate tap rows (uint16 bf16 bit patterns, or f16/f32) and move them to the device."""
    host = arrays[0] if len(arrays) == 1 and arrays[0].flags.writeable else np.concatenate(arrays)
    if host.dtype == np.uint16:
        t = torch.from_numpy(np.ascontiguousarray(host).view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(host))
    return t.to(device, non_blocking=True).to(dtype)


