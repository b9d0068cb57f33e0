"""Wire messages of the draft RPC: msgspec structs, encoded as msgpack.

A message on the wire is a multipart ZeroMQ message: frame 0 is the msgpack header (one of
the structs below, tagged by ``kind``), frames 1.. are raw tensor payloads described by
``TensorSpec`` entries of the header. This module owns the structs, the status and error
codes, and nothing else: no sockets, no validation beyond types (see ``validate``).
"""

from __future__ import annotations

import enum
import hashlib

import msgspec

PROTOCOL_VERSION = 1


class Status(enum.IntEnum):
    """Outcome of one Step entry (one request of the target batch)."""

    OK = 0  # rows applied; drafts (possibly empty for k=0) attached
    OVERLOADED = 1  # not admitted: rows NOT applied; retry after retry_after_ms
    EXPIRED = 2  # budget passed before drafting could start; rows applied, no drafts
    BAD_ENTRY = 3  # entry invalid (message says why); rows NOT applied
    INTERNAL = 4  # server-side failure while computing; rows state unknown (resend)
    # a commit (``Phase.COMMIT``) whose context rows below its position are not all held (a lost
    # Taps, a restart in between), or an entry of a session with early taps that a newer step of
    # that session overtook on the way: nothing drafted, its rows NOT applied; ``end``/``start`` say
    # what the session holds (-1: nothing). Only ever sent in sessions of a client that saw
    # ``FEATURE_EARLY_TAPS`` in the Welcome and sent early taps: an older client never sees it.
    MISSING_ROWS = 5


class Phase(enum.IntEnum):
    """Which part of a verify step a Step entry carries (DESIGN §4, "Early taps").

    WHOLE is the single message: rows, then the anchor and k drafts. With early taps (negotiated:
    ``FEATURE_EARLY_TAPS`` in the Welcome) the target sends every row of its verified span as an
    ingest-only TAPS entry right after its forward, then, once its sampler has decided, a COMMIT
    entry (rows usually 0, ``pos`` = the committed context end, the anchor, k): the server drafts
    from the rows it holds below ``pos`` (rows past it, the rejected drafts, are cut), or answers
    ``Status.MISSING_ROWS`` when it does not hold them all. Rejected rows are simply overwritten
    by position later.
    """

    WHOLE = 0
    TAPS = 1  # ingest only (k = 0), early: ingested after any waiting commit's drafting
    COMMIT = 2  # drafts only from context held below its first row; never from a gap


FEATURE_EARLY_TAPS = "early_taps"  # Welcome.features: the server takes Phase.TAPS / Phase.COMMIT entries


class ErrorCode(enum.IntEnum):
    """Whole-message failures, answered with an ``Error`` message."""

    BAD_MESSAGE = 1  # header decodes but fails validation
    UNSUPPORTED_VERSION = 2
    UNKNOWN_KIND = 3
    BAD_FRAMES = 4  # frame count, size, dtype or shape disagree with the header
    TOO_LARGE = 5  # over a server limit (rows, entries, bytes)
    CONTRACT_MISMATCH = 6
    NOT_READY = 7
    INTERNAL = 8
    WIRE_FORMAT = 9  # a wire format (or projection) this server does not accept (see ``protocol.wire``)
    TRANSPORT = 10  # a transport not offered, or a shm ring / CUDA IPC buffer the server cannot map or no longer holds


class DType(enum.StrEnum):
    """Tensor dtypes on the wire. bf16 travels as its raw 16-bit pattern."""

    BF16 = "bf16"
    F16 = "f16"
    F32 = "f32"
    I32 = "i32"
    I64 = "i64"
    U8 = "u8"  # raw bytes (fp8 rows: e4m3 codes followed by a float32 scale)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {DType.BF16: 2, DType.F16: 2, DType.F32: 4, DType.I32: 4, DType.I64: 8, DType.U8: 1}


class TensorSpec(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Describes payload frame ``frame`` (0 = first frame after the header)."""

    dtype: DType
    shape: tuple[int, ...]
    frame: int

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class ModelContract(msgspec.Struct, frozen=True):
    """What the drafter needs from the target; both sides must agree on all of it."""

    model_name: str
    tap_layer_ids: tuple[int, ...]  # vLLM aux convention: residual stream after k layers
    target_hidden_size: int
    vocab_size: int
    block_size: int  # largest k the server drafts per step
    mask_token_id: int
    tap_dtype: DType = DType.BF16
    has_confidence: bool = False

    @property
    def tap_width(self) -> int:
        return len(self.tap_layer_ids) * self.target_hidden_size

    def fingerprint(self) -> str:
        """A short stable id of the contract, carried in every reply."""
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:16]

    def mismatches(self, other: ModelContract) -> list[str]:
        """Names of fields that differ, with both values (empty when compatible)."""
        out = []
        for f in self.__struct_fields__:
            a, b = getattr(self, f), getattr(other, f)
            if f != "model_name" and a != b:
                out.append(f"{f}: {a!r} != {b!r}")
        return out


class WireFormat(enum.StrEnum):
    """How a Step's rows travel (``protocol.wire`` has the layouts and their sizes)."""

    BF16 = "bf16"  # raw taps, [rows, tap_width] bf16 (the default: what a client that names none sends)
    PROJECTED = "projected"  # context rows the client projected and normed itself, [rows, hidden_size]
    FP8 = "fp8"  # taps as e4m3 codes with a per-row float32 scale, [rows, tap_width + 4] bytes


class WireOffer(msgspec.Struct, frozen=True):
    """The wire formats a server accepts (in its Welcome). The defaults are what a server that
    predates wire formats offers: bf16 only."""

    formats: tuple[str, ...] = (WireFormat.BF16.value,)
    projection_id: str = ""  # ``wire.projection_id`` of the server's context projection ("" : none)
    projected_width: int = 0  # values per projected row (the draft's hidden_size)
    projected_dtype: DType = DType.BF16  # how they travel: bf16, or f32 when the drafter computes in f32/f64


class Transport(enum.StrEnum):
    """Where a Step's rows travel (``protocol.shm`` has the ring's layout and lifetime,
    ``protocol.cuda_ipc`` the CUDA IPC buffer's)."""

    FRAMES = "frames"  # in payload frame 0 of the Step message (any endpoint, any host)
    SHM = "shm"  # in a shared-memory ring the client made on the server's host (``Step.rows_at``)
    CUDA_IPC = "cuda_ipc"  # in a device buffer the client exported with CUDA IPC (``Step.rows_at``): GPU to GPU


class RingAnnounce(msgspec.Struct, frozen=True, array_like=True):
    """A client's shared-memory ring, named in its Hello: the server maps it read-only (or refuses)."""

    name: str  # POSIX shm name, e.g. "/dspark-ring-1234-0f1e2d3c4b5a" (``protocol.shm.ring_name``)
    nbytes: int  # segment size
    nonce: str  # hex; also in the segment's header, so the server knows it opened the right segment


class CudaIpcAnnounce(msgspec.Struct, frozen=True, omit_defaults=True):
    """A client's CUDA IPC buffer, named in its Hello (transport "cuda_ipc", ``protocol.cuda_ipc``):
    a device buffer of ``nbytes`` on the client's GPU, exported once with CUDA IPC, and the
    interprocess events the client records after writing a region. The server imports it on its own
    device (a peer mapping when the GPUs differ), or refuses in one line."""

    name: str  # "cuda-ipc-PID-HEX-N": this announcement (a re-Hello names the same buffer anew)
    nbytes: int  # usable bytes; regions lie in [0, nbytes), ``protocol.cuda_ipc.ALIGN``-aligned
    # torch's storage share tuple (``UntypedStorage._share_cuda_()``), field by field: the cudaIpcMemHandle
    # of the allocation, the storage's size and offset in it, torch's cross-process ref counter (a
    # /dev/shm file name and slot) and the share-time event (unused: each region has its own, below)
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter: bytes
    ref_counter_offset: int
    # cudaIpcEventHandle of each interprocess event; the write of region generation g is recorded on
    # events[g % len(events)] before the Step naming it is sent, and the server's copy waits on it
    events: tuple[bytes, ...]
    device: int = 0  # the client's device index, in its own numbering (logs)
    device_uuid: str = ""  # the client GPU's UUID: the server tells a plain copy from a peer copy
    host: str = ""  # the client's boot id (/proc/sys/kernel/random/boot_id): another host is refused at once
    pid: int = 0  # the client process, to release the buffer as soon as it is gone ...
    pid_ns: str = ""  # ... when the server sees the same pid namespace (/proc/self/ns/pid) ...
    start_time: int = 0  # ... and this is still the process that pid names (/proc/PID/stat starttime)


class RowsAt(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Where a Step's rows are when they are not in a payload frame: a region of the sender's
    shared-memory ring (``protocol.shm``) or of its CUDA IPC buffer (``protocol.cuda_ipc``)."""

    ring: str  # the ring's (buffer's) name, as announced in the Hello and confirmed in the Welcome
    offset: int  # of the region (shm: its 64-byte stamp, the rows follow it; cuda_ipc: the rows)
    nbytes: int  # of the rows
    generation: int  # which Step wrote the region (1, 2, ... per ring; shm: also its stamp)


class RingAck(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What the server still reads of a client's ring (or CUDA IPC buffer), cumulative (a lost reply loses nothing):
    every region of generation <= ``seen`` that is not in ``held`` may be written again."""

    ring: str
    seen: int  # the newest generation the server has received (0: none)
    held: tuple[int, ...] = ()  # generations <= seen whose rows the server may still read


class ServerLimits(msgspec.Struct, frozen=True):
    max_entries_per_step: int
    max_rows_per_step: int
    max_sessions: int
    max_queue_rows: int
    max_message_bytes: int
    max_position: int
    max_session_id_bytes: int
    prefill_chunk_rows: int
    max_budget_ms: float


class Sampling(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """Draft sampling. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    return_probs: int = 0  # >0: return the top-n draft probabilities per position


GREEDY = Sampling()


class _Message(msgspec.Struct, frozen=True, tag_field="kind"):
    """Base of every top-level message: tagged by ``kind`` on the wire."""


class StepEntry(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """One request of the target's batch.

    ``rows`` committed rows at absolute positions pos..pos+rows-1 (their taps are the next
    ``rows`` rows of the Step's tap frame, in entry order), then the anchor token at position
    pos+rows, and the wish for ``k`` drafts after it (k=0: ingest only). ``phase``: see ``Phase``.
    Fields added later (``phase``, ``after``, ``restart``) are trailing: msgspec writes every field of
    an array-like struct, and a peer that lacks one drops the extra element when decoding, while one
    reading an older peer's shorter array fills in the default.
    """

    session: str
    pos: int
    rows: int
    anchor: int
    k: int
    sampling: Sampling = GREEDY
    phase: Phase = Phase.WHOLE
    # COMMIT: the call id of the early Taps still carrying rows below ``pos`` (0: none, all acknowledged).
    # Unless that Taps is the session's latest, the rows below ``pos`` it holds are stale (a span's
    # rejected rows whose commit was lost): MISSING_ROWS. An entry with rows (a client catching up
    # sends a span's new rows alone): the call carrying the rows below ``pos``; unless that call's rows
    # reached the session last, MISSING_ROWS, nothing applied.
    after: int = 0
    # Early taps: the sender gave up rows below ``pos`` the server never acknowledged, so the server
    # may hold other rows there (a span's rejected drafts): it starts the session at ``pos``, as after
    # a gap (a commit without rows of its own is answered MISSING_ROWS).
    restart: bool = False


class Hello(_Message, tag="hello"):
    protocol_version: int
    client_name: str
    call_id: int = 0
    expect: ModelContract | None = None  # None: take whatever the server serves
    wire_format: str = WireFormat.BF16.value  # the row format this client sends (refused if not offered)
    projection_id: str = ""  # with "projected": ``wire.projection_id`` of the client's projection weights
    ring: RingAnnounce | None = None  # transport "shm": the client's ring (refused if the server cannot map it)
    cuda_ipc: CudaIpcAnnounce | None = None  # transport "cuda_ipc": the client's device buffer (or a refusal)


class Weights(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the drafter's weights are: ``format`` (dense, exl3; "" unknown), ``bits`` per weight,
    ``nbytes`` held (EXL3: the packed tensors plus the dense ones)."""

    format: str = ""
    bits: float = 0.0
    nbytes: int = 0


class Welcome(_Message, tag="welcome"):
    protocol_version: int
    call_id: int
    epoch: str
    contract: ModelContract
    contract_id: str
    limits: ServerLimits
    wire: WireOffer = WireOffer()
    transports: tuple[str, ...] = (Transport.FRAMES.value,)  # what this server takes (older servers: frames)
    ring: str = ""  # the name of the Hello's ring or CUDA IPC buffer, mapped ("" : none asked for)
    features: tuple[str, ...] = ()  # optional behaviours this server has, e.g. FEATURE_EARLY_TAPS
    weights: Weights = Weights()  # the drafter's weight format (older servers: unknown)
    # transport "shm": a same-host direct link for header-only messages (``protocol.direct``): the
    # listening socket's abstract name and the token that binds a connection to this client ("": none)
    direct: str = ""
    direct_token: bytes = b""


class Step(_Message, tag="step"):
    call_id: int
    budget_ms: float
    entries: tuple[StepEntry, ...]
    taps: TensorSpec | None = None  # [sum(rows), tap_width]; None when no entry has rows
    # the sender's monotonic clock at send, in ms (-1: not given). The server learns each
    # connection's smallest (receive - sent) and expires, unread, a Step that waited longer than its
    # budget beyond that (queued during a pause or an outage): its rows still commit.
    sent_ms: float = -1.0
    wire: str = WireFormat.BF16.value  # the format of ``taps`` (one the server's Welcome offered)
    # None: the rows are payload frame ``taps.frame``; else they are here (``taps.frame`` is then -1)
    rows_at: RowsAt | None = None
    # early taps whose commits the sender sends at once (predicted commits): a server may wait a moment
    # for them before ingesting these rows alone, so that rows and drafts go in one batch. A hint:
    # nothing waits for it, and a server that predates it ignores it
    commit_follows: bool = False


class EntryResult(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    status: Status
    drafts: tuple[int, ...] = ()
    end: int = -1  # session context end after this entry (-1: not applied / unknown)
    retry_after_ms: float = 0.0
    message: str = ""
    confidence: tuple[float, ...] = ()  # per-draft conditional survival, when served
    probs: TensorSpec | None = None  # top-n draft probabilities: frame of [k, n] f32 ...
    prob_ids: TensorSpec | None = None  # ... and their token ids [k, n] i32
    # the context the session holds after this entry is [start, end): drafts were made from
    # exactly that. A start later than the client's first row means the server lost the context
    # before it (eviction, TTL, restart) and restarted the session at a later position.
    start: int = -1


class Timing(msgspec.Struct, frozen=True, array_like=True, gc=False):
    queue_ms: float  # receive -> batch start (largest over the call's entries)
    compute_ms: float  # engine time of the batches that served this call
    server_ms: float  # receive -> reply queued


class StepResult(_Message, tag="result"):
    call_id: int
    epoch: str
    contract_id: str
    results: tuple[EntryResult, ...]
    timing: Timing
    advised_k: int = -1  # load-aware advice; -1 = no advice
    ring: RingAck | None = None  # the regions of the client's ring (or CUDA IPC buffer) the server is done with


class Free(_Message, tag="free"):
    """Release sessions. Fire-and-forget: no reply."""

    sessions: tuple[str, ...]


class Ping(_Message, tag="ping"):
    call_id: int


class Pong(_Message, tag="pong"):
    call_id: int
    epoch: str
    contract_id: str
    healthy: bool
    live_sessions: int
    queue_rows: int


class Error(_Message, tag="error"):
    call_id: int  # -1 when the failing message had no readable call id
    code: ErrorCode
    message: str
    epoch: str = ""


Message = Hello | Welcome | Step | StepResult | Free | Ping | Pong | Error
Request = Hello | Step | Free | Ping
Reply = Welcome | StepResult | Pong | Error
