"""Validation of a decoded Step against the model contract and the server limits.

Whole-message faults (budget, frame layout, totals) raise ``ProtocolError``; per-entry faults
are returned as messages so the server can answer BAD_ENTRY for that entry alone and serve
the rest. The client runs the same checks before sending, so a bug on the target side shows
up as a clear local error instead of a remote one. The row frame is checked against the Step's
own wire format (``protocol.wire``), which must be one the server offers. Rows that are not in a
frame (``Step.rows_at``: a region of the client's shared-memory ring, or of its CUDA IPC buffer) are
found by the caller's ``locate`` and checked the same way (device rows come back as the locator made
them: their bytes cannot be viewed from the host).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from protocol.codec import NUMPY_DTYPE, Buffer, ProtocolError, tensor
from protocol.messages import (
    GREEDY,
    ErrorCode,
    ModelContract,
    Phase,
    RowsAt,
    Sampling,
    ServerLimits,
    Step,
    StepEntry,
    TensorSpec,
    WireOffer,
)
from protocol.wire import BF16_ONLY, refusal, row_layout


def check_sampling(s: Sampling, vocab_size: int) -> str | None:
    if s == GREEDY:
        return None
    if not (math.isfinite(s.temperature) and s.temperature >= 0.0):
        return f"temperature must be finite and >= 0, got {s.temperature}"
    if not 0 <= s.top_k <= vocab_size:
        return f"top_k must be in [0, {vocab_size}], got {s.top_k}"
    if not (math.isfinite(s.top_p) and 0.0 < s.top_p <= 1.0):
        return f"top_p must be in (0, 1], got {s.top_p}"
    if s.seed is not None and not 0 <= s.seed < 2**63:
        return f"seed must be in [0, 2**63), got {s.seed}"
    if not 0 <= s.return_probs <= 1024:
        return f"return_probs must be in [0, 1024], got {s.return_probs}"
    if s.return_probs and s.temperature == 0.0:
        return "return_probs needs temperature > 0 (greedy drafts have one-hot probabilities)"
    return None


def check_entry(e: StepEntry, contract: ModelContract, limits: ServerLimits) -> str | None:
    """Why this entry cannot be served, or None."""
    pos, rows, k = e.pos, e.rows, e.k
    if (  # the common case in one expression (a step checks every entry): a valid greedy entry whose
        # session id is short enough in any encoding (at most 4 UTF-8 bytes a code point)
        0 < len(e.session) * 4 <= limits.max_session_id_bytes
        and pos >= 0
        and rows >= 0
        and 0 <= k <= contract.block_size
        and pos + rows + k <= limits.max_position
        and 0 <= e.anchor < contract.vocab_size
        and (not k or e.phase != Phase.TAPS)
        and e.sampling == GREEDY
    ):
        return None
    sid = e.session.encode("utf-8", "surrogatepass")
    if not sid:
        return "empty session id"
    if len(sid) > limits.max_session_id_bytes:
        return f"session id of {len(sid)} bytes exceeds {limits.max_session_id_bytes}"
    if e.pos < 0:
        return f"negative position {e.pos}"
    if e.rows < 0:
        return f"negative row count {e.rows}"
    if e.pos + e.rows + e.k > limits.max_position:
        return f"positions up to {e.pos + e.rows + e.k} exceed max_position {limits.max_position}"
    if not 0 <= e.k <= contract.block_size:
        return f"k={e.k} outside [0, block_size={contract.block_size}]"
    if not 0 <= e.anchor < contract.vocab_size:
        return f"anchor token {e.anchor} outside vocab [0, {contract.vocab_size})"
    if e.phase == Phase.TAPS and e.k:
        return f"a taps entry is ingest only (k=0), got k={e.k}"
    return check_sampling(e.sampling, contract.vocab_size)


def validate_step(
    step: Step,
    payloads: Sequence[Buffer],
    contract: ModelContract,
    limits: ServerLimits,
    offer: WireOffer = BF16_ONLY,
    locate: Callable[[RowsAt], np.ndarray] | None = None,
) -> tuple[np.ndarray | None, list[str | None]]:
    """Check a Step; return its rows (a view in ``step.wire``'s layout, or None) and a per-entry
    error list. A format ``offer`` does not hold is a WIRE_FORMAT error. ``locate`` turns a
    ``rows_at`` into the region's bytes (uint8, raising ProtocolError), or into the rows themselves
    when they are not host memory (any other type: returned as it is); without it such a Step is a
    TRANSPORT error."""
    cid = step.call_id
    if step.wire not in offer.formats:
        raise ProtocolError(ErrorCode.WIRE_FORMAT, refusal(step.wire, "", offer) or step.wire, cid)
    if not (math.isfinite(step.budget_ms) and 0.0 < step.budget_ms <= limits.max_budget_ms):
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE, f"budget_ms must be in (0, {limits.max_budget_ms}], got {step.budget_ms}", cid
        )
    if len(step.entries) > limits.max_entries_per_step:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"{len(step.entries)} entries exceed {limits.max_entries_per_step}", cid
        )
    total_rows = 0
    for e in step.entries:
        if e.rows < 0:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"negative row count in session {e.session!r}", cid)
        total_rows += e.rows
    if total_rows > limits.max_rows_per_step:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{total_rows} rows exceed {limits.max_rows_per_step}", cid)
    expected_frames = 0
    taps = None
    if step.taps is None:
        if total_rows:
            raise ProtocolError(ErrorCode.BAD_FRAMES, f"{total_rows} rows announced but no tap tensor", cid)
    else:
        spec = step.taps
        dtype, width = row_layout(step.wire, contract, offer)
        if spec.dtype != dtype:
            raise ProtocolError(
                ErrorCode.BAD_FRAMES, f"{step.wire} rows of dtype {spec.dtype.value}, server expects {dtype.value}", cid
            )
        if spec.frame != (0 if step.rows_at is None else -1):
            where = "payload frame 0" if step.rows_at is None else "in no frame (-1) with rows_at"
            raise ProtocolError(ErrorCode.BAD_FRAMES, f"taps must be {where}, got frame {spec.frame}", cid)
        want = (total_rows, width)
        if tuple(spec.shape) != want:
            raise ProtocolError(
                ErrorCode.BAD_FRAMES, f"{step.wire} rows of shape {list(spec.shape)}, expected {list(want)}", cid
            )
        if step.rows_at is None:
            taps = tensor(spec, payloads, cid)
            expected_frames = 1
        else:
            taps = _located(step.rows_at, spec, locate, cid)
    if step.rows_at is not None and step.taps is None:
        raise ProtocolError(ErrorCode.BAD_FRAMES, "rows_at without a taps tensor", cid)
    if len(payloads) != expected_frames:
        raise ProtocolError(
            ErrorCode.BAD_FRAMES, f"{len(payloads)} payload frames, header describes {expected_frames}", cid
        )
    errors: list[str | None] = []
    seen: set[str] = set()
    for e in step.entries:
        err = check_entry(e, contract, limits)
        if err is None and e.session in seen:
            err = f"session {e.session!r} appears twice in one step"
        seen.add(e.session)
        errors.append(err)
    return taps, errors


def _located(at: RowsAt, spec: TensorSpec, locate: Callable[[RowsAt], np.ndarray] | None, cid: int) -> np.ndarray:
    """The rows ``spec`` describes, read from where ``at`` says (a view, no copy)."""
    if locate is None:
        raise ProtocolError(ErrorCode.TRANSPORT, "rows_at given, but this server maps no shared-memory ring", cid)
    if at.nbytes != spec.nbytes:
        raise ProtocolError(
            ErrorCode.BAD_FRAMES,
            f"rows_at holds {at.nbytes} bytes, header says {spec.dtype.value}{list(spec.shape)} = {spec.nbytes} bytes",
            cid,
        )
    buf = locate(at)
    if not isinstance(buf, np.ndarray):  # rows in device memory (transport cuda_ipc): the locator shaped them
        return buf
    arr = buf.view(NUMPY_DTYPE[spec.dtype]).reshape(spec.shape)
    arr.flags.writeable = False
    return arr
