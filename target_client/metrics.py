"""Prometheus metrics of the target-side draft client (``draft_client_*``, base units).

Owns the metric objects. They are created once per CollectorRegistry and shared by every
DraftClient (and every ``FleetClient``: ``draft_client_fleet_*``) that uses that registry
(label-free apart from small fixed enums), so two clients in one process never collide;
``draft_client_breaker_open`` then counts the clients whose breaker is open. No per-request or
per-session labels.

The updates every step makes (its duration and outcome, drafts, the RTT, entries by status, shm
and CUDA IPC steps) go through ``later`` (``protocol.telemetry.Deferred``): the caller applies them
once its next Step is out (waiting for the reply anyway), the I/O thread once a second, and every
scrape of the registry applies what is still queued first, so it never lags.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from protocol import Status
from protocol.telemetry import LATENCY_BUCKETS, Deferred

OUTCOMES = ("ok", "timeout", "breaker_open", "not_ready", "error", "overloaded", "closed", "catching_up")
ENTRY_STATUSES = (*(s.name.lower() for s in Status), "skipped")


class ClientMetrics:
    """The draft_client_* metric family on one registry."""

    def __init__(self, registry: Any) -> None:
        kw = {"registry": registry}
        self.later = Deferred()  # registered first: a scrape applies the queued updates before reading any
        registry.register(self.later)
        self.step_duration = Histogram(
            "draft_client_step_duration_seconds",
            "Time step()/astep() blocked the caller, whatever the outcome",
            buckets=LATENCY_BUCKETS,
            **kw,
        )
        self.rtt = Histogram(
            "draft_client_rtt_seconds",
            "Send to reply of Step messages as the I/O thread sees it (late replies included)",
            buckets=LATENCY_BUCKETS,
            **kw,
        )
        self.steps = Counter("draft_client_steps", "step() calls by outcome", ["outcome"], **kw)
        self.entries = Counter(
            "draft_client_entries", "Per-request results by status (skipped = held back locally)", ["status"], **kw
        )
        self.drafts = Counter("draft_client_drafts", "Draft tokens handed to the engine", **kw)
        self.late_replies = Counter("draft_client_late_replies", "Replies that came after their caller gave up", **kw)
        self.bad_replies = Counter(
            "draft_client_bad_replies", "Replies that could not be used (garbage, wrong shape, unknown call)", **kw
        )
        self.resent_rows = Counter("draft_client_resent_rows", "Unacknowledged rows sent again", **kw)
        self.dropped_rows = Counter(
            "draft_client_dropped_rows", "Unacknowledged rows given up (resend bound, gaps, frees)", **kw
        )
        self.epoch_changes = Counter("draft_client_epoch_changes", "Server restarts seen (new epoch)", **kw)
        self.contract_changes = Counter(
            "draft_client_contract_changes", "Replies whose contract_id differed from the verified one", **kw
        )
        self.breaker_opens = Counter("draft_client_breaker_opens", "Times the circuit breaker opened", **kw)
        self.refusals = Counter(
            "draft_client_handshake_refusals",
            "Handshakes refused, drafting off: another model contract or protocol version (contract), a wire "
            "format or projection the server does not accept (wire_format), or a transport it does not offer or a "
            "shm ring or CUDA IPC buffer it cannot map (transport; with transport auto the client goes on with frames)",
            ["reason"],
            **kw,
        )
        # multiprocess_mode only matters under PROMETHEUS_MULTIPROC_DIR (vLLM's API server export).
        self.breaker_open = Gauge(
            "draft_client_breaker_open",
            "Clients (of this registry) whose circuit breaker is open now",
            multiprocess_mode="livesum",
            **kw,
        )
        self.budget = Gauge(
            "draft_client_budget_seconds",
            "Current default step budget (adaptive or fixed)",
            multiprocess_mode="livemax",
            **kw,
        )
        for o in OUTCOMES:
            self.steps.labels(o)
        for s in ENTRY_STATUSES:
            self.entries.labels(s)
        self.shm_steps = Counter(
            "draft_client_shm_steps", "Steps whose rows went through the shared-memory ring (transport shm)", **kw
        )
        self.shm_fallbacks = Counter(
            "draft_client_shm_fallbacks",
            "Steps of a shm client whose rows went in a frame: no free region in the ring (ring_full)",
            ["reason"],
            **kw,
        )
        self.cuda_ipc_steps = Counter(
            "draft_client_cuda_ipc_steps",
            "Steps whose rows went through the client's CUDA IPC buffer, device to device (transport cuda_ipc)",
            **kw,
        )
        self.cuda_ipc_fallbacks = Counter(
            "draft_client_cuda_ipc_fallbacks",
            "Steps of a cuda_ipc client whose rows went in a frame (one device-to-host copy): no free region in "
            "the buffer (buffer_full)",
            ["reason"],
            **kw,
        )
        for r in ("contract", "wire_format", "transport"):
            self.refusals.labels(r)
        self.shm_fallbacks.labels("ring_full")
        self.cuda_ipc_fallbacks.labels("buffer_full")


VERIFY_STAGES = ("received", "sent", "accepted")
MAX_POSITION_LABEL = 16  # draft positions past this share the label "16+"


def position_label(j: int) -> str:
    """Label of 1-based draft position j (a small fixed set)."""
    return str(j) if j < MAX_POSITION_LABEL else f"{MAX_POSITION_LABEL}+"


class VerifyMetrics:
    """The draft_client_verify_* metrics of load-aware verification (``target_client.trim``,
    fed by the vLLM proposer) on one registry."""

    def __init__(self, registry: Any) -> None:
        kw = {"registry": registry}
        self.drafts = Counter(
            "draft_client_verify_drafts",
            "Drafts by 1-based position: received from the server, sent to the target for verification "
            "(after trimming), accepted by the target",
            ["stage", "position"],
            **kw,
        )
        self.trimmed = Counter(
            "draft_client_verify_trimmed_drafts", "Drafts received but not verified: load-aware trimming", **kw
        )
        self.trimmed_requests = Counter(
            "draft_client_verify_trimmed_requests", "Request-steps that had at least one draft trimmed", **kw
        )
        self.advice_capped = Counter(
            "draft_client_verify_advice_capped_requests",
            "Request-steps that asked the server for fewer drafts because it advised a smaller k",
            **kw,
        )
        self.cost = Gauge(
            "draft_client_verify_cost_seconds",
            "Fitted target step time: base (per step) and per_token (per verified token); -1 until fitted",
            ["term"],
            multiprocess_mode="livemax",
            **kw,
        )
        for stage in VERIFY_STAGES:
            for j in range(1, MAX_POSITION_LABEL + 1):
                self.drafts.labels(stage, position_label(j))
        for term in ("base", "per_token"):
            self.cost.labels(term).set(-1)


class FleetMetrics:
    """The draft_client_fleet_* metrics of ``target_client.fleet`` on one registry (its member
    clients count their own calls in the draft_client_* family on the same registry)."""

    def __init__(self, registry: Any) -> None:
        kw = {"registry": registry}
        self.step_duration = Histogram(
            "draft_client_fleet_step_duration_seconds",
            "Time a fleet step() blocked the caller (every server of the step together)",
            buckets=LATENCY_BUCKETS,
            **kw,
        )
        self.servers = Gauge(
            "draft_client_fleet_servers",
            "Servers known to the fleet clients of this registry, by whether they take sessions now",
            ["state"],
            multiprocess_mode="livesum",
            **kw,
        )
        self.moves = Counter(
            "draft_client_fleet_moves", "Sessions moved off a server that was dead, paused, refused or gone", **kw
        )
        self.sheds = Counter(
            "draft_client_fleet_sheds", "New sessions moved on because their server answered overloaded", **kw
        )
        self.resolve_failures = Counter(
            "draft_client_fleet_resolve_failures", "DNS lookups of the fleet's names that failed", **kw
        )
        for state in ("usable", "down"):
            self.servers.labels(state)


_lock = threading.Lock()
_by_registry: dict[tuple[type, int], tuple[Any, Any]] = {}


def _shared(cls: type, registry: Any) -> Any:
    reg = REGISTRY if registry is None else registry
    with _lock:
        hit = _by_registry.get((cls, id(reg)))
        if hit is not None and hit[0] is reg:
            return hit[1]
        m = cls(reg)
        _by_registry[(cls, id(reg))] = (reg, m)
        return m


def metrics_for(registry: Any = None) -> ClientMetrics:
    """The shared ClientMetrics of ``registry`` (default REGISTRY), created on first use."""
    return _shared(ClientMetrics, registry)


def verify_metrics_for(registry: Any = None) -> VerifyMetrics:
    """The shared VerifyMetrics of ``registry`` (default REGISTRY), created on first use."""
    return _shared(VerifyMetrics, registry)


def fleet_metrics_for(registry: Any = None) -> FleetMetrics:
    """The shared FleetMetrics of ``registry`` (default REGISTRY), created on first use."""
    return _shared(FleetMetrics, registry)
