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

With the shm transport the copy lands straight in a region of the client's shared-memory ring
(``claim``: ``DraftClient.claim_rows``), page-locked once, which the client sends where it lies.
Otherwise it lands in ``PinnedRows``: page-locked host memory, reused once the client lets go
of a step's rows (a copy into pageable memory runs at a fraction of the bus: 10.6 ms for 64 sessions
of K3 taps on the H200 host, ``bench/results/cuda_ipc_h200.json`` ``prep``).

Lives under ``vllm/`` because it needs torch, which the client imports inside functions only.
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from protocol import DType, WireFormat
from protocol.wire import FORMATS, FP8_MAX, SCALE_BYTES
from target_client.projection import Projection

if TYPE_CHECKING:
    import torch

Claim = Callable[[int, Any], "np.ndarray | None"]  # DraftClient.claim_rows: (nbytes, pin) -> a region, or None


class WireEncoder:
    """Encodes taps into rows of one wire format (see the module docstring)."""

    def __init__(self, fmt: str, projection: Projection | None = None, pinned_mib: int = 0) -> None:
        """``pinned_mib``: page-locked host memory for the rows of device taps (``PinnedRows``, made at
        the first such call); 0: each step's rows go to a fresh pageable tensor."""
        if fmt not in FORMATS:
            raise ValueError(f"unknown wire format {fmt!r} (one of {', '.join(FORMATS)})")
        if fmt == WireFormat.PROJECTED and projection is None:
            raise ValueError("the projected wire format needs the draft checkpoint's Projection")
        self.fmt = fmt
        self.projection = projection
        self._weights: dict[tuple[str, Any], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pinned_bytes = pinned_mib << 20
        self.pinned: PinnedRows | None = None
        self.claimed = 0  # steps whose rows went into a region of the client's ring

    def __call__(
        self, taps: torch.Tensor, projected_dtype: DType = DType.BF16, claim: Claim | None = None
    ) -> np.ndarray:
        """Rows on the host for ``taps`` (``projected_dtype``: the Welcome's ``wire.projected_dtype``).

        ``claim`` (``DraftClient.claim_rows``): the rows go straight into a region of the client's
        shared-memory ring (page-locked first when they come from a GPU), which the client then
        sends where they lie: one copy from the target's device to the server's view. When it
        gives no region, the rows land as below."""
        if claim is not None:
            out = self._into_claimed(taps, projected_dtype, claim)
            if out is not None:
                return out
        rows = self.device_rows(taps, projected_dtype)
        if rows.device.type == "cpu" or not self._pinned_bytes:
            return to_host(rows)
        if self.pinned is None:
            self.pinned = PinnedRows(self._pinned_bytes)
        return self.pinned.host_rows(rows)

    def _into_claimed(self, taps: torch.Tensor, projected_dtype: DType, claim: Claim) -> np.ndarray | None:
        """The rows written into a claimed region: raw bf16 taps straight from the caller's tensor
        (the region is the fresh memory), other formats after encoding on the device; None when
        no region was given."""
        import torch

        if self.fmt == WireFormat.BF16 and taps.dim() == 2:
            src, dtype, shape = taps, torch.bfloat16, tuple(taps.shape)
        else:
            src = self.device_rows(taps, projected_dtype)
            dtype, shape = src.dtype, tuple(src.shape)
        nbytes = math.prod(shape) * dtype.itemsize
        buf = claim(nbytes, pin_cuda if src.is_cuda else None)
        if buf is None:
            return None
        dst = torch.from_numpy(buf).view(dtype).view(shape)
        dst.copy_(src, non_blocking=src.is_cuda)
        if src.is_cuda:
            torch.cuda.current_stream(src.device).synchronize()
        self.claimed += 1
        return _numpy(dst)

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


def pin_cuda(address: int, nbytes: int) -> Callable[[], object]:
    """Page-lock host memory for CUDA copies (the shm ring, ``ClientRing.claim``); returns what
    unlocks it. RuntimeError when CUDA refuses."""
    import torch

    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(address, nbytes, 1))  # cudaHostRegisterPortable
    if err:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {err}")
    return lambda: cudart.cudaHostUnregister(address)


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
    acknowledged its rows (``PinnedRows`` is the reused buffer that tracks that)."""
    return _numpy(rows if rows.device.type == "cpu" else rows.to("cpu"))


def _numpy(host: torch.Tensor) -> np.ndarray:
    """A host tensor as numpy in wire storage (bf16 as uint16 bit patterns)."""
    import torch

    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(np.uint16)
    return host.numpy()


class PinnedRows:
    """Page-locked host memory for the rows of device taps, each step's rows in a region of it.

    The client keeps a step's rows by reference until the server acknowledges them (its resend
    buffer, frames in flight), so a region is free again when no array views it any more: Python's
    reference count is the acknowledgement tracking (a finalizer on the root object every view of
    the region holds). Regions are placed next-fit: after the last one, else in the first gap that
    holds them, so rows one lagging session keeps do not stop the others. Rows that do not fit
    (more than half the buffer, or no gap) go to a fresh pageable tensor as without it (counted in
    ``fallbacks``): it never blocks and never overwrites rows still held. Any thread may take or
    free (one lock)."""

    ALIGN = 256

    def __init__(self, nbytes: int, pin: bool = True) -> None:
        """``pin``: page-lock the buffer (needs CUDA; False: plain memory, for tests on the CPU)."""
        import torch

        self.size = nbytes
        self._slab = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._lock = threading.Lock()
        self._live: dict[int, tuple[int, int]] = {}  # region id -> [start, end)
        self._ids = 0
        self._next = 0  # where the last region ended
        self.taken = 0  # steps whose rows landed here
        self.fallbacks = 0  # steps whose rows did not fit: a pageable copy

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self.size - sum(b - a for a, b in self._live.values())

    def _take(self, nbytes: int) -> tuple[int, int] | None:
        """A region of ``nbytes``: (id, offset), or None (lock held)."""
        if not 0 < nbytes <= self.size // 2:
            return None
        need = -(-nbytes // self.ALIGN) * self.ALIGN
        gaps, end = [], 0
        for a, b in sorted(self._live.values()):
            if a - end >= need:
                gaps.append(end)
            end = max(end, b)
        if self.size - end >= need:
            gaps.append(end)
        if not gaps:
            return None
        start = next((g for g in gaps if g >= self._next), gaps[0])
        self._ids += 1
        self._live[self._ids] = (start, start + need)
        self._next = start + need
        return self._ids, start

    def host_rows(self, rows: torch.Tensor) -> np.ndarray:
        """``rows`` (contiguous, any device) copied to the host: into a free region, else a fresh
        tensor; returns once the copy is done, as numpy in wire storage."""
        import torch

        with self._lock:
            got = self._take(rows.numel() * rows.element_size())
        if got is None:
            self.fallbacks += 1
            return to_host(rows)
        region, off = got
        try:
            dst = self._slab[off : off + rows.numel() * rows.element_size()].view(rows.dtype).view(rows.shape)
            dst.copy_(rows, non_blocking=rows.is_cuda)
            if rows.is_cuda:
                torch.cuda.current_stream(rows.device).synchronize()
            out = _numpy(dst)
        except BaseException:
            self._free(region)
            raise
        owner: Any = out
        while isinstance(owner, np.ndarray) and owner.base is not None:  # every view of ``out`` holds it
            owner = owner.base
        weakref.finalize(owner, self._free, region).atexit = False
        self.taken += 1
        return out

    def _free(self, region: int) -> None:
        with self._lock:
            self._live.pop(region, None)


def _tensor(a: np.ndarray, stored: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A stored checkpoint array (BF16 as uint16 bits) as a torch tensor on ``device`` in ``dtype``."""
    import torch

    with warnings.catch_warnings():  # read-only file bytes: torch only reads them here
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a.view(np.int16) if stored == "BF16" else a)
    if stored == "BF16":
        t = t.view(torch.bfloat16)
    return t.to(device=device, dtype=dtype)
