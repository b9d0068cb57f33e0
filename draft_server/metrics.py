"""Prometheus metrics of the draft server and its HTTP endpoint (/metrics, /healthz).

Names follow Prometheus practice: `draft_server_` prefix, base units, `_total` counters, and
only low-cardinality labels (message kind, status, error code, eviction reason) — never a
session or client id. Latency histograms start at 50 µs: the RPC hop lives below a
millisecond. Each server owns its registry, so tests can run several in one process.

The updates every Step makes (messages, entries by status, the step, queue-wait, iteration and
batch histograms, rows and drafts) go through ``later`` (``protocol.telemetry.Deferred``): the
engine applies them once the iteration's replies are out, and every scrape applies what is still
queued first, so /metrics never lags. Per-entry counts are added up per batch.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from draft_server.config import StartupError
from protocol import EntryResult, ErrorCode, Status
from protocol.telemetry import LATENCY_BUCKETS, Deferred

if TYPE_CHECKING:
    from draft_server.io.arena import Arena

MESSAGE_KINDS = ("hello", "step", "free", "ping")
EVICTION_REASONS = ("free", "ttl", "lru", "error")
RESTART_CAUSES = ("gap", "evicted", "ttl", "freed", "error", "unknown")
DROP_REASONS = ("kv_full", "drafter_error", "released")
ARENA_FALLBACKS = ("full", "too_large")

SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.later = Deferred()  # registered first: a scrape applies the queued updates before reading any
        r.register(self.later)  # type: ignore[arg-type]
        self.renders = 0  # scrapes served (the watchdog exit waits for one)
        self.info = Info("draft_server", "Server identity", registry=r)
        self.messages = Counter("draft_server_messages_total", "Messages received, by kind", ["kind"], registry=r)
        self.bad_messages = Counter(
            "draft_server_bad_messages_total", "Messages refused whole, by error code", ["code"], registry=r
        )
        self.dropped_messages = Counter(
            "draft_server_dropped_messages_total", "Unparseable messages dropped without reply", registry=r
        )
        self.entries = Counter("draft_server_entries_total", "Step entries answered, by status", ["status"], registry=r)
        self.rows_ingested = Counter("draft_server_rows_ingested_total", "Context rows written", registry=r)
        self.drafted_tokens = Counter("draft_server_drafted_tokens_total", "Draft tokens returned", registry=r)
        self.prefill_chunks = Counter("draft_server_prefill_chunks_total", "Prefill chunks ingested", registry=r)
        self.evictions = Counter(
            "draft_server_session_evictions_total", "Sessions released, by reason", ["reason"], registry=r
        )
        self.restarts = Counter(
            "draft_server_session_restarts_total",
            "Sessions whose context restarted at a later position, by cause (gap: rows skipped; evicted, ttl, "
            "freed, error: the server had released it; unknown: the server never had it, e.g. after a restart)",
            ["cause"],
            registry=r,
        )
        self.nonfinite_rows = Counter(
            "draft_server_nonfinite_tap_rows_total",
            "Tap rows received holding NaN or Inf (sampled); they never reach another session's drafts",
            registry=r,
        )
        self.rows_dropped = Counter(
            "draft_server_rows_dropped_total", "Admitted rows never ingested, by reason", ["reason"], registry=r
        )
        self.stale_steps = Counter(
            "draft_server_stale_steps_total",
            "Steps expired unread (they waited past their budget before the server read them), superseded, "
            "or early taps / commits reordered (older than their session's latest step)",
            ["why"],
            registry=r,
        )
        self.replies_dropped = Counter(
            "draft_server_replies_dropped_total", "Replies that could not be sent (peer gone or full)", registry=r
        )
        self.io_errors = Counter(
            "draft_server_io_errors_total", "Unexpected errors of the I/O path (its thread, the NaN sample)", registry=r
        )
        self.engine_errors = Counter("draft_server_engine_errors_total", "Engine batches that raised", registry=r)
        self.watchdog_fired = Counter(
            "draft_server_watchdog_fired_total", "Engine iterations over the watchdog", registry=r
        )
        self.sessions = Gauge("draft_server_sessions", "Live sessions", registry=r)
        self.shm_rings = Gauge(
            "draft_server_shm_rings", "Clients' shared-memory rings mapped now (transport shm)", registry=r
        )
        self.direct_links = Gauge(
            "draft_server_direct_links", "Clients' same-host direct links bound now (transport shm)", registry=r
        )
        self.cuda_ipc_buffers = Gauge(
            "draft_server_cuda_ipc_buffers", "Clients' CUDA IPC buffers imported now (transport cuda_ipc)", registry=r
        )
        self.arena_payloads = Counter(
            "draft_server_arena_payloads_total",
            "Step tap frames received straight into the registered receive arena (tcp/ipc; --arena-mib)",
            registry=r,
        )
        self.arena_fallbacks = Counter(
            "draft_server_arena_fallbacks_total",
            "Step tap frames received as ordinary frames instead (staged on ingest), by reason: full (no room "
            "in the arena now), too_large (larger than the whole arena, e.g. a long prefill)",
            ["reason"],
            registry=r,
        )
        self.queue_rows = Gauge("draft_server_queue_rows", "Rows admitted and waiting for ingest", registry=r)
        self.kv_used = Gauge("draft_server_kv_used_tokens", "Draft KV tokens held", registry=r)
        self.kv_capacity = Gauge("draft_server_kv_capacity_tokens", "Draft KV token capacity", registry=r)
        self.healthy = Gauge("draft_server_healthy", "1 when the engine loop is alive and on time", registry=r)
        self.step_latency = Histogram(
            "draft_server_step_duration_seconds",
            "Step receive to reply queued",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "draft_server_queue_wait_seconds",
            "Step receive to the start of the batch that took its last entry (per Step served by a batch)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.iteration = Histogram(
            "draft_server_engine_iteration_seconds",
            "One engine iteration (ingest + draft)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_hold = Histogram(
            "draft_server_batch_hold_seconds",
            "Time a decode batch was held for clients due back (per held batch)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.commit_wait = Histogram(
            "draft_server_commit_wait_seconds",
            "Time early taps waited for the commits their call said follow at once (predicted commits), per wait",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.commit_wait_timeouts = Counter(
            "draft_server_commit_wait_timeouts_total",
            "Early-taps calls whose announced commits did not come within the wait's bound (lost, or a slow client)",
            registry=r,
        )
        self.batch_sessions = Histogram(
            "draft_server_batch_sessions", "Sessions drafted per engine iteration", buckets=SIZE_BUCKETS, registry=r
        )
        self.batch_rows = Histogram(
            "draft_server_batch_rows", "Rows ingested per engine iteration", buckets=SIZE_BUCKETS, registry=r
        )

        self.max_sessions = Gauge("draft_server_max_sessions", "Configured session capacity", registry=r)
        self.model = Info("draft_server_model", "Drafter weights: format (dense/exl3), bits, codebooks", registry=r)
        self.weight_bytes = Gauge(
            "draft_server_model_weight_bytes",
            "Drafter weight bytes as the format holds them (EXL3: packed)",
            registry=r,
        )
        self.weight_bits = Gauge("draft_server_model_weight_bits", "Average bits per weight of the drafter", registry=r)
        self.max_queue_rows = Gauge("draft_server_max_queue_rows", "Configured ingest queue bound in rows", registry=r)
        ProcessCollector(namespace="draft_server", registry=r)  # RSS, CPU, fds of the server process
        # label children exist from the start, so rate() and increase() see the first event
        # label children exist from the start; the hot ones are kept (labels() is a lock and a lookup)
        self.message_kind = {kind: self.messages.labels(kind) for kind in MESSAGE_KINDS}
        for code in ErrorCode:
            self.bad_messages.labels(code.name.lower())
        self.entry_status = {status: self.entries.labels(status.name.lower()) for status in Status}
        for reason in EVICTION_REASONS:
            self.evictions.labels(reason)
        for cause in RESTART_CAUSES:
            self.restarts.labels(cause)
        for reason in DROP_REASONS:
            self.rows_dropped.labels(reason)
        for why in ("unread", "superseded", "reordered"):
            self.stale_steps.labels(why)
        for reason in ARENA_FALLBACKS:
            self.arena_fallbacks.labels(reason)

    def count_entries(self, results: Sequence[EntryResult]) -> None:
        """A reply's entries by status (queued: one update per status, not per entry)."""
        self.later.count_statuses(self.entry_status, results)

    def set_weights(self, d: dict) -> None:
        """Format, bits and weight bytes of the loaded drafter (``app.describe``)."""
        codebooks = ",".join(d.get("codebooks", ()))
        self.model.info({"format": str(d["format"]), "bits": f"{d['bits']:g}", "codebooks": codebooks})
        self.weight_bytes.set(d["weight_bytes"])
        self.weight_bits.set(d["bits"])

    def watch_arena(self, arena: Arena) -> None:
        """Gauges of the receive arena, read at scrape time."""
        r = self.registry
        Gauge("draft_server_arena_capacity_bytes", "Size of the receive arena", registry=r).set(arena.capacity)
        Gauge(
            "draft_server_arena_held_bytes", "Receive arena bytes held by rows not yet ingested", registry=r
        ).set_function(lambda: arena.held)

    def watch_gpu(self, device: object) -> None:
        """GPU memory gauges, read at scrape time from PyTorch's caching allocator.

        allocated: bytes held by live tensors (model, KV pages, the batch in flight): growth here
        is a leak. reserved: allocated plus the allocator's cache, which grows as it meets new
        batch shapes and levels off; nvidia-smi shows reserved plus the CUDA context."""
        import torch

        r = self.registry
        Gauge("draft_server_gpu_memory_allocated_bytes", "GPU bytes held by live tensors", registry=r).set_function(
            lambda: torch.cuda.memory_allocated(device)
        )
        Gauge(
            "draft_server_gpu_memory_reserved_bytes", "GPU bytes reserved by the caching allocator", registry=r
        ).set_function(lambda: torch.cuda.memory_reserved(device))

    def render(self) -> bytes:
        self.renders += 1
        return generate_latest(self.registry)


class MetricsHTTPServer:
    """Serves /metrics and /healthz on its own threads."""

    def __init__(self, metrics: ServerMetrics, health: Callable[[], dict], host: str, port: int) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = metrics.render(), CONTENT_TYPE_LATEST, 200
                elif path == "/healthz":
                    state = health()
                    body = json.dumps(state).encode()
                    ctype, code = "application/json", 200 if state["healthy"] else 503
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the scraper gave up (its timeout): nothing to answer

            def log_message(self, *args: object) -> None:
                pass

        try:
            self._httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:  # one line naming the culprit, not a traceback
            raise StartupError(_listen_error(host, port, e)) from None
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="draft-metrics-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _listen_error(host: str, port: int, e: OSError) -> str:
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return f"--metrics-host {host}: not an address of this host ({e.strerror})"
    if e.errno == errno.EADDRINUSE:
        return f"--metrics-port {port}: the port is in use on {host} (another draft-server or exporter?)"
    return f"--metrics-host {host} --metrics-port {port}: cannot listen ({e.strerror or e})"
