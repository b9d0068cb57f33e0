"""Public value types of the target-side draft client: configuration, requests, replies, errors.

Owns ``ClientConfig`` (checked when built), ``StepRequest`` (one request of the engine's batch
as the caller describes it), ``DraftReply`` (what the caller gets back for it) and the only
exceptions the client raises: from ``connect()`` and for caller bugs. No sockets, no threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol import GREEDY, ModelContract, Sampling, Status, WireFormat
from protocol.wire import FORMATS

TRANSPORTS = ("frames", "shm", "auto", "cuda_ipc")  # ClientConfig.transport


class DraftClientError(Exception):
    """Base of the client's own exceptions (never raised by step()/astep() for draft-side faults)."""


class ContractMismatchError(DraftClientError):
    """The server serves a model contract (or protocol version) this engine cannot use.

    ``fields`` names what differs, e.g. ``("tap_layer_ids", "vocab_size")``.
    """

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields


class ConnectTimeoutError(DraftClientError, TimeoutError):
    """connect(wait=True) got no Welcome within ``connect_timeout_s`` (the client keeps trying)."""


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Settings of one DraftClient. Times are milliseconds unless the name says seconds."""

    endpoint: str
    budget_ms: float = 20.0  # default wait per step (the hard bound on how long step() blocks)
    name: str = "engine"
    expect: ModelContract | None = None  # refuse a server serving another contract
    connect_timeout_s: float = 5.0
    resend_rows_limit: int = 64  # unacknowledged rows kept per session for resend
    # On a server restart (new epoch) each session keeps only its newest this-many unacknowledged
    # rows: the server lost all context anyway, and resending up to resend_rows_limit rows for
    # every session at once makes the first step after a restart too big to meet its budget.
    restart_resend_rows: int = 8
    # A step carries at most max(16, resend_ratio x its new rows) resent rows in all: without a
    # bound, the rows buffered while the breaker was open made every half-open trial step so big
    # that it missed its budget again (draft-soak, K3 on an H200), and drafting never came back.
    resend_ratio: float = 1.0
    breaker_failures: int = 5  # consecutive misses that open the breaker
    breaker_backoff_ms: float = 500.0  # ping period while open; after failed trials 50 ms doubling up to this
    # While open, a step() also sends a probe Ping when none went out for this long (0: off), and
    # while steps keep coming (within 250 ms) probes repeat at this period instead of the backoff,
    # so a server that is back (restart, SIGCONT) is noticed within one engine step.
    breaker_step_probe_ms: float = 10.0
    adaptive_budget: bool = False  # budget = clamp(adaptive_multiplier * p99 RTT, adaptive_min_ms, budget_ms)
    adaptive_multiplier: float = 2.0
    adaptive_min_ms: float = 2.0
    adaptive_window: int = 512  # RTT samples the p99 is taken over
    curve_server_key: bytes | None = None  # z85; setting it turns CurveZMQ on
    curve_public_key: bytes | None = None  # z85; generated when curve is on and these are None
    curve_secret_key: bytes | None = None
    registry: Any = None  # prometheus_client CollectorRegistry; None = the default REGISTRY
    hello_retry_ms: float = 250.0  # Hello resend period while connecting
    # ZeroMQ reconnect interval (and its backoff cap): a restarted server is found again within
    # ~25 ms, so drafting resumes within two engine steps (draft-soak's resume invariant). While
    # the server is down this costs one TCP connect attempt per 25 ms.
    reconnect_ivl_ms: int = 10
    reconnect_ivl_max_ms: int = 25
    max_reply_bytes: int = 64 << 20  # ZMQ_MAXMSGSIZE on receive
    send_hwm: int = 64  # messages queued towards the server before sends fail fast
    reply_margin_ms: float = 0.5  # subtracted from the budget the server is told, for the way back
    session_idle_s: float = 600.0  # client-side session state not touched this long is dropped
    close_timeout_s: float = 2.0  # join bound for the I/O thread in close()
    routing_id: bytes | None = None  # ZMQ IDENTITY; None = random per client instance
    # The rows step() is given (protocol.wire): "bf16" taps, "fp8" taps (e4m3 + per-row scale), or
    # "projected" context rows, with ``projection_id`` = target_client.projection.Projection.id of
    # the weights they were projected with (target_client.vllm.wire encodes all three). A server
    # that does not accept the format, or projects with other weights, is refused at Hello.
    wire_format: str = WireFormat.BF16.value
    projection_id: str = ""
    # Where a step's rows travel (``protocol.shm``): "frames" in the Step message (any host);
    # "shm" through a shared-memory ring of ``shm_ring_mib`` this client makes and the server maps
    # (same host only: a server that cannot map it, or runs with --no-shm, is refused at Hello and
    # drafting stays off, as for a wire format); "auto": shm when the server maps the ring, else
    # frames for the life of the client (one warning line, the refusal still counted). A step whose
    # rows find no free region in the ring sends them in a frame.
    # "cuda_ipc": rows on this process's GPU (``step()`` then takes torch CUDA tensors) are copied device
    # to device into a buffer of ``cuda_ipc_mib`` this client exports with CUDA IPC, and from there by the
    # server into its own device memory (README "Transports"); a server that cannot import it (no CUDA,
    # --no-cuda-ipc, another host or container), or a process without CUDA, is refused at Hello like
    # shm's. ``cuda_device``: the buffer's device index (-1: the current device of the thread that made
    # the client). A step whose rows find no free region sends them in a frame (one device-to-host copy).
    transport: str = "frames"
    # Early taps (``DraftClient.send_taps``) whose span is larger than this, with rows in frames, are
    # declined (send_taps returns False; the caller sends the single message, accepted rows only): the
    # span carries every verified row, (k + 1) per request against the accepted ones, and over a socket
    # those bytes cost more than the sampling they hide. H200 host, tcp, K3 taps, 7 drafts: early taps
    # won up to 4 sessions (2.3 MB spans) and lost from 16 (9.2 MB): bench/results/early_taps_h200_v3.json
    # and _v2. 0: never decline. Through shm or cuda_ipc the socket carries no rows: never declined. A
    # span the caller marks ``exact`` (only rows the step commits: predicted commits) is never declined.
    early_taps_max_mib: float = 4.0
    shm_ring_mib: int = 64
    cuda_ipc_mib: int = 64
    cuda_device: int = -1
    # A caller waiting in ``step()`` polls the socket without sleeping from this long before its reply
    # is due (its previous wait, as long again; then it sleeps again until the deadline), trading
    # up to about twice this much CPU per step for the wake-up of a sleeping thread (about 0.06 ms
    # per reply on the 2-core VM: bench/results/rpc_client_spin_cpu.json). 0: it sleeps at once.
    wait_spin_ms: float = 0.0

    def __post_init__(self) -> None:
        def positive(name: str, value: float) -> None:
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"ClientConfig.{name} must be a finite number > 0, got {value!r}")

        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(
                f"ClientConfig.endpoint must be a ZeroMQ endpoint like tcp://host:port, got {self.endpoint!r}"
            )
        for name in (
            "budget_ms",
            "connect_timeout_s",
            "breaker_backoff_ms",
            "adaptive_multiplier",
            "adaptive_min_ms",
            "hello_retry_ms",
            "session_idle_s",
            "close_timeout_s",
        ):
            positive(name, getattr(self, name))
        spin = self.wait_spin_ms
        if not (isinstance(spin, int | float) and not isinstance(spin, bool) and math.isfinite(spin) and spin >= 0):
            raise ValueError(f"ClientConfig.wait_spin_ms must be a finite number >= 0, got {self.wait_spin_ms!r}")
        if not (math.isfinite(self.early_taps_max_mib) and self.early_taps_max_mib >= 0):
            raise ValueError(f"ClientConfig.early_taps_max_mib must be >= 0, got {self.early_taps_max_mib}")
        if self.resend_rows_limit < 0:
            raise ValueError(f"ClientConfig.resend_rows_limit must be >= 0, got {self.resend_rows_limit}")
        if not (math.isfinite(self.resend_ratio) and self.resend_ratio >= 0):
            raise ValueError(f"ClientConfig.resend_ratio must be >= 0, got {self.resend_ratio}")
        if self.restart_resend_rows < 0:
            raise ValueError(f"ClientConfig.restart_resend_rows must be >= 0, got {self.restart_resend_rows}")
        if not (math.isfinite(self.breaker_step_probe_ms) and self.breaker_step_probe_ms >= 0):
            raise ValueError(f"ClientConfig.breaker_step_probe_ms must be >= 0, got {self.breaker_step_probe_ms}")
        if self.breaker_failures < 1:
            raise ValueError(f"ClientConfig.breaker_failures must be >= 1, got {self.breaker_failures}")
        if self.adaptive_window < 8:
            raise ValueError(f"ClientConfig.adaptive_window must be >= 8, got {self.adaptive_window}")
        if self.reply_margin_ms < 0:
            raise ValueError(f"ClientConfig.reply_margin_ms must be >= 0, got {self.reply_margin_ms}")
        if self.routing_id is not None and not (0 < len(self.routing_id) <= 255 and self.routing_id[0] != 0):
            raise ValueError("ClientConfig.routing_id must be 1..255 bytes and must not start with a zero byte")
        if (self.curve_public_key is None) != (self.curve_secret_key is None):
            raise ValueError("ClientConfig.curve_public_key and curve_secret_key come together")
        if self.curve_public_key is not None and self.curve_server_key is None:
            raise ValueError("ClientConfig.curve_public_key needs curve_server_key")
        if self.wire_format not in FORMATS:
            raise ValueError(f"ClientConfig.wire_format must be one of {', '.join(FORMATS)}, got {self.wire_format!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"ClientConfig.transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if not (isinstance(self.shm_ring_mib, int) and 1 <= self.shm_ring_mib <= 1 << 16):
            raise ValueError(f"ClientConfig.shm_ring_mib must be an int in [1, 65536], got {self.shm_ring_mib!r}")
        if not (isinstance(self.cuda_ipc_mib, int) and 1 <= self.cuda_ipc_mib <= 1 << 16):
            raise ValueError(f"ClientConfig.cuda_ipc_mib must be an int in [1, 65536], got {self.cuda_ipc_mib!r}")
        if not (isinstance(self.cuda_device, int) and self.cuda_device >= -1):
            raise ValueError(f"ClientConfig.cuda_device must be an int >= -1, got {self.cuda_device!r}")
        if self.wire_format == WireFormat.PROJECTED and not self.projection_id:
            raise ValueError(
                "ClientConfig.wire_format 'projected' needs projection_id (target_client.projection.Projection.id)"
            )


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One request of the target batch for this step.

    ``rows`` committed rows at absolute positions pos..pos+rows-1 (the next ``rows`` rows of the
    step's taps array, in request order), the anchor token at position pos+rows, and ``k`` drafts
    wanted after it (k=0: ingest only).
    """

    session: str
    pos: int
    rows: int
    anchor: int
    k: int
    sampling: Sampling = GREEDY


@dataclass(slots=True)
class DraftReply:
    """The answer for one StepRequest. ``tokens == []`` on any failure (the engine decodes plainly).

    ``status`` is the server's per-entry status, or None when no answer came (timeout, breaker
    open, server unreachable, bad reply). A session skipped locally because the server asked to
    retry later carries ``Status.OVERLOADED`` with the remaining ``retry_after_ms``.
    """

    tokens: list[int]
    status: Status | None = None
    confidence: list[float] = field(default_factory=list)
    probs: np.ndarray | None = None  # [k, n] float32 top-n draft probabilities, when asked for
    prob_ids: np.ndarray | None = None  # [k, n] int32 their token ids
    retry_after_ms: float = 0.0
    message: str = ""
    # the server's context for the session is [start, end of this step's rows): a start past the
    # session's first row means the server restarted it there (eviction, TTL, restart); -1: unknown
    start: int = -1


def empty_replies(n: int, status: Status | None = None) -> list[DraftReply]:
    return [DraftReply([], status) for _ in range(n)]
