"""Frame codec: msgpack header plus raw tensor frames, no copies on either side.

``encode`` returns ``[header, *payloads]`` where payloads are the caller's buffers, handed to
ZeroMQ as they are (send_multipart(copy=False)). ``decode`` parses frame 0 into a message
struct; ``tensor`` turns a ``TensorSpec`` plus the received frames into a read-only numpy view
over the frame's bytes after checking dtype, shape and byte size against the header.
Everything that can go wrong raises ``ProtocolError`` with a typed code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from protocol.messages import (
    PROTOCOL_VERSION,
    DType,
    ErrorCode,
    Message,
    Reply,
    Request,
    TensorSpec,
)

Buffer = bytes | bytearray | memoryview | np.ndarray

NUMPY_DTYPE: dict[DType, np.dtype] = {
    DType.BF16: np.dtype(np.uint16),  # raw bf16 bit patterns
    DType.F16: np.dtype(np.float16),
    DType.F32: np.dtype(np.float32),
    DType.I32: np.dtype(np.int32),
    DType.I64: np.dtype(np.int64),
    DType.U8: np.dtype(np.uint8),
}

MAX_DIMS = 4


class ProtocolError(Exception):
    """A message that cannot be served, with the code the reply carries."""

    def __init__(self, code: ErrorCode, message: str, call_id: int = -1) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.call_id = call_id


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_any_decoder = msgspec.msgpack.Decoder(Message)
_raw_decoder = msgspec.msgpack.Decoder()


def encode(msg: Message, payloads: Sequence[Buffer] = ()) -> list[Buffer]:
    """Header bytes followed by the payload buffers, untouched."""
    return [_encoder.encode(msg), *payloads]


def _decode(decoder: msgspec.msgpack.Decoder, header: Buffer) -> Any:
    try:
        return decoder.decode(header)
    except msgspec.ValidationError as e:
        call_id = _peek_call_id(header)
        kind = _peek_kind(header)
        if kind is not None and "Invalid value" in str(e) and "`$.kind`" in str(e):
            raise ProtocolError(ErrorCode.UNKNOWN_KIND, f"unknown message kind {kind!r}", call_id) from None
        raise ProtocolError(ErrorCode.BAD_MESSAGE, str(e), call_id) from None
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError) as e:
        # e.g. invalid UTF-8 inside a string: the header cannot be decoded, but its call id may
        # still be readable, so the sender gets an Error instead of silence
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"undecodable header: {e}", scan_call_id(header)) from None


def _peek(header: Buffer) -> dict | None:
    try:
        obj = _raw_decoder.decode(header)
    except Exception:
        return None
    return obj if isinstance(obj, dict) else None


def _peek_call_id(header: Buffer) -> int:
    obj = _peek(header)
    cid = obj.get("call_id") if obj else None
    return cid if isinstance(cid, int) and not isinstance(cid, bool) and -(2**63) <= cid < 2**64 else -1


_CALL_ID_KEY = b"\xa7call_id"  # msgpack fixstr "call_id"


def scan_call_id(header: Buffer) -> int:
    """The integer after the ``call_id`` key, read from the raw msgpack bytes (-1 if there is none)."""
    b = bytes(header)
    at = b.find(_CALL_ID_KEY)
    if at < 0 or at + 8 >= len(b):
        return -1
    i = at + 8
    t = b[i]
    if t <= 0x7F:
        return t
    widths = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False)}
    widths |= {0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)}
    if t in widths:
        n, signed = widths[t]
        if i + 1 + n <= len(b):
            return int.from_bytes(b[i + 1 : i + 1 + n], "big", signed=signed)
    return -1


def _peek_kind(header: Buffer) -> str | None:
    obj = _peek(header)
    kind = obj.get("kind") if obj else None
    return kind if isinstance(kind, str) else None


def decode_request(header: Buffer) -> Request:
    return _decode(_request_decoder, header)


def decode_reply(header: Buffer) -> Reply:
    return _decode(_reply_decoder, header)


def decode_any(header: Buffer) -> Message:
    return _decode(_any_decoder, header)


def tensor(spec: TensorSpec, payloads: Sequence[Buffer], call_id: int = -1) -> np.ndarray:
    """A read-only numpy view of payload frame ``spec.frame``, checked against ``spec``."""
    if not 0 <= spec.frame < len(payloads):
        raise ProtocolError(
            ErrorCode.BAD_FRAMES, f"tensor frame {spec.frame} missing ({len(payloads)} payload frames)", call_id
        )
    if not 1 <= len(spec.shape) <= MAX_DIMS or any(d < 0 for d in spec.shape):
        raise ProtocolError(ErrorCode.BAD_FRAMES, f"bad tensor shape {spec.shape}", call_id)
    buf = memoryview(payloads[spec.frame]).cast("B")
    if buf.nbytes != spec.nbytes:
        raise ProtocolError(
            ErrorCode.BAD_FRAMES,
            f"frame {spec.frame} holds {buf.nbytes} bytes, header says {spec.dtype.value}{list(spec.shape)} "
            f"= {spec.nbytes} bytes",
            call_id,
        )
    arr = np.frombuffer(buf, dtype=NUMPY_DTYPE[spec.dtype]).reshape(spec.shape)
    arr.flags.writeable = False
    return arr


def spec_for(array: np.ndarray, dtype: DType, frame: int) -> TensorSpec:
    """The TensorSpec describing ``array`` sent as payload frame ``frame``."""
    if array.dtype != NUMPY_DTYPE[dtype]:
        raise TypeError(f"array dtype {array.dtype} cannot travel as {dtype.value}")
    if not array.flags.c_contiguous:
        raise ValueError("tensor payloads must be C-contiguous (no copies are made)")
    return TensorSpec(dtype=dtype, shape=tuple(int(d) for d in array.shape), frame=frame)


def check_version(version: int, call_id: int = -1) -> None:
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version} not supported (this side speaks {PROTOCOL_VERSION})",
            call_id,
        )
