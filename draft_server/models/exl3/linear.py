"""Linear modules over EXL3 weights: one packed source (``Exl3Linear``), several (``FusedLinear``).

Owns the packed tensors of a quantized linear and the interface every backend implements:
``forward(x) -> x @ W.T (+ bias)`` in ``nn.Linear`` orientation, with ``in_features`` /
``out_features`` the model's (unpadded) sizes. The default backend (``DequantBackend``, the CPU's)
decodes the weight once into the compute dtype and runs a GEMM; on CUDA the loader installs
``cuda.Exl3Backend`` (exllamav3's fused ``exl3_gemm`` for small batches) through ``set_backend``.
Also owns the GEMM primitives an EXL3 model's call sites use (``linear``, ``linear_add``,
``swiglu_add``: ``DSparkModel.route_linears``), which take a dense tensor or a packed module.

Fused projections (``fused_qkv_a_proj``, ``gate_up_proj``, ``qkv_proj``) whose parts are
separate EXL3 tensors never concatenate trellises: each source has its own K, suh and svh, so a
``FusedLinear`` runs one GEMM per source and concatenates the outputs.

Padding: exllamav3 pads both dims to multiples of 128 at conversion. The input is zero-extended
(padded ``suh`` rows meet zeros) and padded outputs (noise) are trimmed.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from draft_server.models.exl3.decode import HAD, decode_inner, dense_weight, trellis_bits, unpack_signs
from draft_server.models.layers import ops

DECODE_ROWS = 1024  # input rows per decode chunk (a multiple of the 128-row Hadamard block)


def pad128(n: int) -> int:
    return -(-n // HAD) * HAD


class Linear(Protocol):
    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    def stored_bytes(self) -> int: ...


class Exl3Backend(Protocol):
    """How an ``Exl3Linear`` multiplies (CPU dequantize + GEMM; later exllamav3 kernels on CUDA)."""

    def forward(self, lin: Exl3Linear, x: torch.Tensor) -> torch.Tensor: ...


class DequantBackend:
    """Decode once into x's dtype and device, cache the dense weight, run ``F.linear``."""

    def forward(self, lin: Exl3Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, lin.weight(x.dtype, x.device), lin.bias_as(x))


_backend: Exl3Backend = DequantBackend()


def set_backend(backend: Exl3Backend) -> Exl3Backend:
    """Install the backend every ``Exl3Linear`` uses; returns the previous one."""
    global _backend
    prev, _backend = _backend, backend
    return prev


class Exl3Linear:
    """One EXL3 linear as stored: ``trellis`` [k/16, n/16, 16K] int16, ``suh`` [k], ``svh`` [n] fp16."""

    def __init__(
        self,
        key: str,
        in_features: int,
        out_features: int,
        trellis: torch.Tensor,
        suh: torch.Tensor,
        svh: torch.Tensor,
        codebook: str,
        bias: torch.Tensor | None = None,
    ) -> None:
        self.key, self.codebook = key, codebook
        self.in_features, self.out_features = in_features, out_features
        self.K = trellis_bits(trellis)
        k, n = pad128(in_features), pad128(out_features)
        if tuple(trellis.shape[:2]) != (k // 16, n // 16):
            raise ValueError(
                f"{key}.trellis {list(trellis.shape)} is not [{k // 16}, {n // 16}, {16 * self.K}] padded to 128"
                f" for in {in_features} x out {out_features}"
            )
        if suh.dtype == torch.int16:  # legacy packed sign words
            suh = unpack_signs(suh)
        if svh.dtype == torch.int16:
            svh = unpack_signs(svh)
        if suh.shape != (k,) or svh.shape != (n,) or suh.dtype != torch.float16 or svh.dtype != torch.float16:
            raise ValueError(
                f"{key}: suh {list(suh.shape)} {suh.dtype} / svh {list(svh.shape)} {svh.dtype},"
                f" expected fp16 [{k}] / [{n}]"
            )
        if bias is not None and bias.shape not in ((out_features,), (n,)):
            raise ValueError(f"{key}.bias has shape {list(bias.shape)}, expected [{out_features}]")
        self.trellis, self.suh, self.svh = trellis, suh, svh
        self.bias = None if bias is None else bias[:out_features]
        self._dense: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    # -- decode --------------------------------------------------------------------------------
    def inner(self) -> torch.Tensor:
        """fp16 Wq [k_pad, n_pad], bit-exact with exllamav3's ``reconstruct``."""
        return decode_inner(self.trellis, self.codebook)

    def exact_weight(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The dense weight, ``nn.Linear`` orientation [out, in] (padding trimmed), computed in float64
        ``DECODE_ROWS`` input rows at a time (bounded memory for K3-size linears) and stored in ``dtype``,
        on the packed tensors' device (the decode is plain torch: it runs on CUDA as well)."""
        out = torch.empty((self.out_features, self.in_features), dtype=dtype, device=self.trellis.device)
        for k0 in range(0, self.in_features, DECODE_ROWS):
            k1 = min(k0 + DECODE_ROWS, pad128(self.in_features))
            wq = decode_inner(self.trellis[k0 // 16 : k1 // 16], self.codebook)
            w = dense_weight(wq, self.suh[k0:k1], self.svh)  # (k1 - k0, out_pad) float64
            rows = min(k1, self.in_features) - k0
            out[:, k0 : k0 + rows] = w[:rows, : self.out_features].t().to(dtype)
        return out

    def weight(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """Dense [out, in] in ``dtype`` on ``device``, decoded once and cached."""
        key = (dtype, torch.device(device))
        if key not in self._dense:
            self._dense[key] = self.exact_weight(dtype).to(device).contiguous()
        return self._dense[key]

    def drop_cache(self) -> None:
        self._dense.clear()

    def bias_as(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.to(x.dtype).to(x.device)

    # -- module interface ----------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _backend.forward(self, x)

    __call__ = forward

    def stored_bytes(self) -> int:
        """Bytes of the packed tensors (trellis, suh, svh, bias, the 4-byte codebook marker)."""
        ts = [self.trellis, self.suh, self.svh] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in ts) + (4 if self.codebook != "3inst" else 0)

    def to(self, device: torch.device | str) -> Exl3Linear:
        self.trellis, self.suh, self.svh = (t.to(device) for t in (self.trellis, self.suh, self.svh))
        if self.bias is not None:
            self.bias = self.bias.to(device)
        return self

    def __repr__(self) -> str:
        return f"Exl3Linear({self.key}, in={self.in_features}, out={self.out_features}, K={self.K}, {self.codebook})"


class DenseLinear:
    """A plain weight [out, in] behind the same interface (the dense part of a mixed fused layer)."""

    def __init__(self, key: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.key, self.w, self.bias = key, weight, bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    __call__ = forward

    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.bias) if t is not None)

    def __repr__(self) -> str:
        return f"DenseLinear({self.key}, in={self.in_features}, out={self.out_features}, {self.w.dtype})"


class FusedLinear:
    """Several sources reading the same input: one GEMM each, outputs concatenated in order."""

    def __init__(self, key: str, parts: list[Exl3Linear | DenseLinear]) -> None:
        if len({p.in_features for p in parts}) != 1:
            raise ValueError(f"{key}: parts read different input widths {[p.in_features for p in parts]}")
        self.key, self.parts = key, parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.forward(x) for p in self.parts], dim=-1)

    __call__ = forward

    def stored_bytes(self) -> int:
        return sum(p.stored_bytes() for p in self.parts)

    def __repr__(self) -> str:
        return f"FusedLinear({self.key}, {self.parts})"


# -- the GEMM sites of an EXL3 model (DSparkModel.route_linears): a dense weight or a packed module ----


def linear(x: torch.Tensor, w: torch.Tensor | Linear, b: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    y = w.forward(x)
    return y if b is None else y + b


def linear_add(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor | Linear) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return ops.linear_add(h, x, w)
    return h + w.forward(x)


def swiglu_add(
    h: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor | Linear, down: torch.Tensor | Linear
) -> torch.Tensor:
    return linear_add(h, ops.swiglu(linear(x, gate_up)), down)
