"""The wire contract between target engines and the draft server.

Owns message structs (``messages``), the zero-copy frame codec (``codec``), Step validation
(``validate``), the row layouts of the negotiated wire formats (``wire``), the shared-memory
ring of transport "shm" (``shm``: segment layout, lifetime, refusals), the device buffer of
transport "cuda_ipc" (``cuda_ipc``: naming, regions, host identity, refusals) and the histogram
layouts both sides export, with the queue of metric updates both take off the hop (``telemetry``),
and the self-pipe both sides' threads wake each other with (``wake``).
Imports numpy and
msgspec only: both sides import it, and the client side lives inside the target engine's process.
"""

from protocol.codec import ProtocolError, decode_any, decode_reply, decode_request, encode, spec_for, tensor
from protocol.messages import (
    FEATURE_EARLY_TAPS,
    GREEDY,
    PROTOCOL_VERSION,
    CudaIpcAnnounce,
    DType,
    EntryResult,
    Error,
    ErrorCode,
    Free,
    Hello,
    ModelContract,
    Phase,
    Ping,
    Pong,
    RingAck,
    RingAnnounce,
    RowsAt,
    Sampling,
    ServerLimits,
    Status,
    Step,
    StepEntry,
    StepResult,
    TensorSpec,
    Timing,
    Transport,
    Weights,
    Welcome,
    WireFormat,
    WireOffer,
)
from protocol.validate import check_entry, validate_step

__all__ = [
    "FEATURE_EARLY_TAPS",
    "GREEDY",
    "PROTOCOL_VERSION",
    "CudaIpcAnnounce",
    "DType",
    "EntryResult",
    "Error",
    "ErrorCode",
    "Free",
    "Hello",
    "ModelContract",
    "Phase",
    "Ping",
    "Pong",
    "ProtocolError",
    "RingAck",
    "RingAnnounce",
    "RowsAt",
    "Sampling",
    "ServerLimits",
    "Status",
    "Step",
    "StepEntry",
    "StepResult",
    "TensorSpec",
    "Timing",
    "Transport",
    "Weights",
    "Welcome",
    "WireFormat",
    "WireOffer",
    "check_entry",
    "decode_any",
    "decode_reply",
    "decode_request",
    "encode",
    "spec_for",
    "tensor",
    "validate_step",
]
