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

from collections.abc import Sequence
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

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor: ...

    def stored_bytes(self) -> int: ...


class Exl3Backend(Protocol):
    """How EXL3 linears multiply (CPU: dequantize + GEMM; CUDA: ``cuda.Exl3Backend``, exllamav3's kernels)."""

    def outputs(self, parts: Sequence[Exl3Linear | DenseLinear], x2: torch.Tensor) -> list[torch.Tensor]:
        """Each part's product with the same input x2 [rows, in]: [rows, out_i], bias added, padding
        trimmed, in any float dtype (the caller rounds once, where it adds, concatenates or activates;
        one input conversion serves every part)."""
        ...

    def product_add(self, lin: Exl3Linear | DenseLinear, x2: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
        """h2 + lin's product with x2, a new tensor in h2's dtype, rounded once (the residual add)."""
        ...

    def swiglu(
        self,
        gate: Exl3Linear | DenseLinear,
        up: Exl3Linear | DenseLinear,
        x2: torch.Tensor,
        dtype: torch.dtype,
        store: torch.dtype | None = None,
    ) -> torch.Tensor:
        """silu(gate's product) * up's product in ``dtype``, each product rounded to it first; ``store``:
        the result converted to that dtype (for a consumer that reads it so, ``half_input``)."""
        ...

    def half_input(self, parts: Sequence[Exl3Linear | DenseLinear], rows: int, dtype: torch.dtype) -> bool:
        """Whether ``outputs(parts, x2)`` for ``rows`` rows of ``dtype`` reads x2 as fp16, converting it
        first: then whoever makes x2 may make it fp16 at once (the same values: one conversion fewer)."""
        ...


def add_rounded(h2: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """h2 + y into a new tensor of h2's dtype: the rounding of y (any float dtype) and the add in one op."""
    out = torch.empty(h2.shape, dtype=h2.dtype, device=h2.device)
    torch.add(h2, y, out=out)
    return out


class DequantBackend:
    """Decode once into x's dtype and device, cache the dense weight, run ``F.linear``."""

    def outputs(self, parts: Sequence[Exl3Linear | DenseLinear], x2: torch.Tensor) -> list[torch.Tensor]:
        return [p.dense_forward(x2) for p in parts]

    def product_add(self, lin: Exl3Linear | DenseLinear, x2: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
        return add_rounded(h2, lin.dense_forward(x2))

    def swiglu(
        self,
        gate: Exl3Linear | DenseLinear,
        up: Exl3Linear | DenseLinear,
        x2: torch.Tensor,
        dtype: torch.dtype,
        store: torch.dtype | None = None,
    ) -> torch.Tensor:
        return ops.swiglu_parts(gate.dense_forward(x2), up.dense_forward(x2), dtype, store)

    def half_input(self, parts: Sequence[Exl3Linear | DenseLinear], rows: int, dtype: torch.dtype) -> bool:
        return False  # the dense product runs in x2's own dtype


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
    def dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T (+ bias) on the dense weight decoded once into x's dtype and device."""
        return F.linear(x, self.weight(x.dtype, x.device), self.bias_as(x))

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W.T (+ bias) in ``dtype`` (default x's)."""
        return _finish(_backend.outputs([self], _rows(x, self.in_features))[0], x, self.out_features, dtype)

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

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        y = F.linear(x, self.w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return y if dtype is None else y.to(dtype)

    __call__ = forward

    def dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)

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

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One backend call for every part (one input conversion), concatenated into ``dtype`` (default x's)
        in one op."""
        outs = _backend.outputs(self.parts, _rows(x, self.in_features))
        y = torch.empty((outs[0].shape[0], self.out_features), dtype=dtype or x.dtype, device=x.device)
        torch.cat(outs, dim=-1, out=y)
        return y.view(*x.shape[:-1], self.out_features)

    __call__ = forward

    def stored_bytes(self) -> int:
        return sum(p.stored_bytes() for p in self.parts)

    def __repr__(self) -> str:
        return f"FusedLinear({self.key}, {self.parts})"


# -- the GEMM sites of an EXL3 model (DSparkModel.route_linears): a dense weight or a packed module ----


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[-1] != width:
        raise ValueError(f"input has {x.shape[-1]} features, the linear reads {width}")
    return x.reshape(-1, width)


def _finish(y: torch.Tensor, x: torch.Tensor, width: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A backend output [rows, width] (any dtype, maybe strided) as ``dtype`` (default x's), shaped like x."""
    return y.to(dtype or x.dtype).contiguous().view(*x.shape[:-1], width)


def _parts(w: torch.Tensor | Linear) -> list[Exl3Linear | DenseLinear] | None:
    """The packed sources of a module (None: a dense tensor or another kind of module)."""
    if isinstance(w, FusedLinear):
        return w.parts
    return [w] if isinstance(w, Exl3Linear | DenseLinear) else None


def _store_for(consumer: Sequence[Exl3Linear | DenseLinear] | None, x: torch.Tensor) -> torch.dtype | None:
    """The dtype to store x (values of x's dtype, shaped [..., in]) in for ``consumer``: fp16 where every
    part would convert it to that first (``half_input``: exllamav3's kernels read fp16), else None (x's
    own); the same values either way."""
    if consumer is None or x.dtype == torch.float16:
        return None
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.float16 if _backend.half_input(consumer, rows, x.dtype) else None


def _normed(x: torch.Tensor, norm_w: torch.Tensor, eps: float, consumer: Sequence[Exl3Linear | DenseLinear] | None):
    """rms_norm(x) for ``consumer``, stored as ``_store_for`` says."""
    return ops.rms_norm(x, norm_w, eps, _store_for(consumer, x))


def linear(x: torch.Tensor, w: torch.Tensor | Linear, b: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    y = w.forward(x)
    return y if b is None else y + b


def linear_add(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor | Linear) -> torch.Tensor:
    """h + x @ W.T: for a packed module, the product's rounding into h's dtype and the add are one op (the
    backend's ``product_add``: on CUDA, with the output rotation too)."""
    if isinstance(w, torch.Tensor):
        return ops.linear_add(h, x, w)
    h2 = h.reshape(-1, w.out_features)
    if isinstance(w, Exl3Linear | DenseLinear):
        return _backend.product_add(w, _rows(x, w.in_features), h2).view(h.shape)
    return add_rounded(h2, w.forward(_rows(x, w.in_features))).view(h.shape)


def norm_linear(
    x: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor | Linear, b: torch.Tensor | None = None
) -> torch.Tensor:
    """rms_norm(x) @ W.T (+ b) (``ops.norm_linear`` for a dense weight)."""
    if isinstance(w, torch.Tensor):
        return ops.norm_linear(x, norm_w, eps, w, b)
    parts = _parts(w)
    if parts is None:  # another kind of module: its own forward
        y = w.forward(ops.rms_norm(x, norm_w, eps))
    else:  # the norm may store fp16 for it (``_normed``); the product comes back in x's dtype
        y = w.forward(_normed(x, norm_w, eps, parts), x.dtype)
    return y if b is None else y + b


def swiglu_add(
    h: torch.Tensor,
    x: torch.Tensor,
    gate_up: torch.Tensor | Linear,
    down: torch.Tensor | Linear,
    norm: ops.Norm | None = None,
) -> torch.Tensor:
    """h + down(silu(gate(x)) * up(x)); ``norm`` (weight, eps): of ``rms_norm(x)``. Separate gate and
    up sources (a two-part ``FusedLinear``) are activated straight from their products: no
    concatenation, one rounding."""
    if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor):
        return ops.swiglu_add(h, x, gate_up, down, norm)
    x0, dtype = x, x.dtype
    if norm is not None:
        x = _normed(x, norm[0], norm[1], _parts(gate_up))
    if (
        isinstance(gate_up, FusedLinear)
        and len(gate_up.parts) == 2
        and gate_up.parts[0].out_features * 2 == (gate_up.out_features)
    ):
        gate, up = gate_up.parts
        store = _store_for(_parts(down), x0)  # the activation has x0's rows and dtype
        act = _backend.swiglu(gate, up, _rows(x, gate_up.in_features), dtype, store)
        act = act.view(*x.shape[:-1], gate.out_features)
    else:
        act = ops.swiglu(linear(x, gate_up) if x.dtype == dtype else gate_up.forward(x, dtype))
    return linear_add(h, act, down)
