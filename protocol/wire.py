"""Wire formats of a Step's rows: their layouts, the Hello-time refusal, the projection id.

A client names one format in its Hello; the server's Welcome lists those it accepts
(``WireOffer``); every Step says which one its rows use (``Step.wire``). Per row, at K3 size
(5 taps x 7168 = 35,840 tap values, hidden 7168):

========== ======================================== ============ ========================
format     one row                                  dtype        bytes per row (K3)
========== ======================================== ============ ========================
bf16       the taps as they are                     bf16         71,680
projected  ``context_norm(context_proj(taps))``     bf16 (f32)   14,336 (28,672 in f32)
fp8        e4m3 taps, then their float32 scale      u8           35,844
========== ======================================== ============ ========================

``projected`` moves the drafter's first matmul to the target's GPU: the client loads
``context_proj`` + ``context_norm`` (Qwen3: ``fc`` + ``hidden_norm``) from the draft checkpoint
and both sides name those weights by ``projection_id``; a client whose id differs from the
server's is refused at Hello. Its rows travel in the server's ``projected_dtype``: bf16, or f32
when the drafter computes in f32/f64 (then projected context gives exactly the raw-tap drafts).
``fp8`` scales each row by amax / 448 (the e4m3 maximum) and the server dequantizes on its device.

Compatibility: the fields are additive (protocol version 1 is unchanged). A client that names no
format sends bf16, a Welcome without an offer means bf16 only, and a Step without ``wire`` is bf16.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from protocol.messages import DType, ModelContract, WireFormat, WireOffer

FP8_MAX = 448.0  # largest finite e4m3 (float8_e4m3fn) value: a row's scale is amax / FP8_MAX
SCALE_BYTES = 4  # the float32 scale after each fp8 row's codes
FORMATS = tuple(f.value for f in WireFormat)
BF16_ONLY = WireOffer()  # what a server that predates wire formats offers

RowLayout = tuple[DType, int]  # (frame dtype, values per row)


def row_layout(fmt: str, contract: ModelContract, offer: WireOffer) -> RowLayout:
    """The dtype and width of one row of ``fmt`` (ValueError for a format that is not known)."""
    if fmt == WireFormat.BF16:
        return contract.tap_dtype, contract.tap_width
    if fmt == WireFormat.PROJECTED:
        return offer.projected_dtype, offer.projected_width
    if fmt == WireFormat.FP8:
        return DType.U8, contract.tap_width + SCALE_BYTES
    raise ValueError(f"unknown wire format {fmt!r} (one of {', '.join(FORMATS)})")


def refusal(fmt: str, projection_id: str, offer: WireOffer) -> str | None:
    """Why a client sending ``fmt`` (with ``projection_id``) cannot use a server offering
    ``offer``: one line naming both sides; None when it can."""
    if fmt not in offer.formats:
        return f"wire format {fmt!r} refused: server accepts {', '.join(offer.formats)}"
    if fmt == WireFormat.PROJECTED and projection_id != offer.projection_id:
        return (
            f"wire format 'projected' refused: client projection weights {projection_id or '(none)'} != "
            f"server's {offer.projection_id or '(none)'} (context_proj/context_norm of another draft checkpoint)"
        )
    return None


def projection_id(weights: Sequence[tuple[tuple[int, ...], Iterable[np.ndarray]]], eps: float) -> str:
    """A short id of a context projection: sha256 over the shapes and float32 values of
    ``context_proj`` then ``context_norm`` (each given as its shape and its values in row-order
    blocks of any size, so neither side needs a float32 copy of a whole K3 projection) and the
    norm's epsilon. Values are taken as stored in the checkpoint: bf16 and f16 widen exactly."""
    h = hashlib.sha256(b"dspark-context-projection-v1\0")
    for shape, blocks in weights:
        h.update(repr(tuple(int(d) for d in shape)).encode())
        for b in blocks:
            h.update(memoryview(np.ascontiguousarray(b, dtype="<f4")).cast("B"))
    h.update(repr(float(eps)).encode())
    return h.hexdigest()[:16]
