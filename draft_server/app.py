"""The composition root: which drafter, and how the server's parts are wired and started.

``build_drafter`` turns a config into a model backend (before anything binds). ``DraftServer``
assembles metrics, the engine, the ROUTER loop, the metrics HTTP endpoint and the watchdog, and
owns health. ``serve`` is the whole ``draft-server serve`` process: load, warm up, bind, print
READY, run until SIGINT/SIGTERM. A tool that needs a different drafter (a fault-injecting
wrapper) passes ``wrap``; nothing else in the runtime knows about it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable

from draft_server.config import ServerConfig
from draft_server.drafters import Drafter, warm_up
from draft_server.engine import Engine
from draft_server.io.router import Router
from draft_server.metrics import MetricsHTTPServer, ServerMetrics
from protocol import ServerLimits

log = logging.getLogger("draft_server")


def build_drafter(cfg: ServerConfig) -> Drafter:
    """The model backend the config names (fails before anything binds)."""
    if cfg.drafter == "checksum":
        from draft_server.drafters.checksum import ChecksumDrafter

        return ChecksumDrafter(delay_ms=cfg.checksum_delay_ms)
    from draft_server.models import load_drafter, load_preset

    kv_bytes = cfg.kv_budget_mib * (1 << 20) or None
    if cfg.model.startswith("random:"):
        return load_preset(cfg.model.split(":", 1)[1], cfg.device, cfg.dtype, kv_bytes, attention=cfg.attention)
    return load_drafter(
        cfg.model, cfg.target_model or None, cfg.device, cfg.dtype, kv_budget_bytes=kv_bytes, attention=cfg.attention
    )


class DraftServer:
    def __init__(self, cfg: ServerConfig, drafter: Drafter) -> None:
        self.cfg = cfg
        self.drafter = drafter
        self.contract = drafter.contract
        self.contract_id = self.contract.fingerprint()
        self.epoch = f"{uuid.uuid4().hex[:12]}-{os.getpid()}"
        self.limits = ServerLimits(
            max_entries_per_step=cfg.max_entries_per_step,
            max_rows_per_step=cfg.max_rows_per_step,
            max_sessions=cfg.max_sessions,
            max_queue_rows=cfg.max_queue_rows,
            max_message_bytes=cfg.max_message_mib << 20,
            max_position=cfg.max_position,
            max_session_id_bytes=256,
            prefill_chunk_rows=cfg.prefill_chunk_rows,
            max_budget_ms=cfg.max_budget_ms,
        )
        self.metrics = m = ServerMetrics()
        m.info.info({"epoch": self.epoch, "model": self.contract.model_name, "contract": self.contract_id})
        m.kv_capacity.set(drafter.capacity_tokens())
        m.healthy.set(1)
        m.max_sessions.set(cfg.max_sessions)
        m.max_queue_rows.set(cfg.max_queue_rows)
        if (gpu := drafter.cuda_device()) is not None:
            m.watch_gpu(gpu)
        self.engine = Engine(
            drafter,
            m,
            self._queue_reply,
            self.epoch,
            self.contract_id,
            max_sessions=cfg.max_sessions,
            max_queue_rows=cfg.max_queue_rows,
            max_batch_rows=cfg.max_batch_rows,
            max_batch_sessions=cfg.max_batch_sessions,
            prefill_chunk_rows=cfg.prefill_chunk_rows,
            batch_window_ms=cfg.batch_window_ms,
            session_ttl_s=cfg.session_ttl_s,
        )
        self.router = Router(
            cfg, self.engine, m, epoch=self.epoch, contract=self.contract, limits=self.limits, healthy=self._healthy
        )
        self.endpoint = self.router.endpoint
        self._running = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="draft-watchdog", daemon=True)
        self._overrun = False
        self.http: MetricsHTTPServer | None = None
        if cfg.metrics_port >= 0:
            self.http = MetricsHTTPServer(m, self.health, cfg.metrics_host, cfg.metrics_port)

    def _queue_reply(self, ident: bytes, msg: object) -> None:
        self.router.queue_reply(ident, msg)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._running.set()
        self.engine.start()
        self.router.start()
        self._watchdog.start()
        if self.http:
            self.http.start()
        log.info(
            "draft server %s serving %s on %s (contract %s, metrics port %s)",
            self.epoch,
            self.contract.model_name,
            self.endpoint,
            self.contract_id,
            self.http.port if self.http else "off",
        )

    def stop(self) -> None:
        self._running.clear()
        self.engine.stop()
        self.router.stop()
        self._watchdog.join(2.0)
        if self.http:
            self.http.stop()
        self.drafter.close()

    def _healthy(self) -> bool:
        return self.router.alive() and self.engine.alive() and not self._overrun

    def health(self) -> dict:
        return {
            "healthy": self._healthy(),
            "epoch": self.epoch,
            "model": self.contract.model_name,
            "sessions": len(self.engine.sessions),
            "queue_rows": self.engine.admission.queued_rows,
        }

    # ------------------------------------------------------------------ watchdog

    def _watch(self) -> None:
        fired_for: float | None = None
        while self._running.is_set():
            time.sleep(0.05)
            busy = self.engine.busy_since
            overrun = busy is not None and time.monotonic() - busy > self.cfg.watchdog_s
            if overrun and fired_for != busy:
                fired_for = busy
                self.metrics.watchdog_fired.inc()
                log.error("engine iteration running for over %.1f s: health red", self.cfg.watchdog_s)
                if self.cfg.watchdog_exit:
                    logging.shutdown()
                    os._exit(3)
            self._overrun = overrun
            self.metrics.healthy.set(1 if self._healthy() else 0)


def serve(cfg: ServerConfig, wrap: Callable[[Drafter], Drafter] | None = None) -> int:
    """Run ``draft-server serve`` until SIGINT/SIGTERM; 2 when the drafter cannot be loaded."""
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        drafter = build_drafter(cfg)
    except (ValueError, OSError) as e:
        print(f"draft-server: cannot load the drafter: {e}", file=sys.stderr)
        return 2
    if cfg.drafter != "checksum":  # a model: its first steps after a (re)start must not miss their budgets
        t0 = time.perf_counter()
        try:
            p = drafter.prepare(cfg.max_batch_sessions, cfg.max_batch_rows)
        except RuntimeError as e:  # a CUDA graph that drafts differently from eager: refuse to serve
            print(f"draft-server: start-up self-test failed: {e}", file=sys.stderr)
            return 2
        if p:
            log.info("prepared in %.2f s: %s", time.perf_counter() - t0, p)
        w = warm_up(drafter, cfg.max_batch_sessions, cfg.prefill_chunk_rows)
        log.info("warm-up: batches up to %d sessions and one prefill chunk in %.2f s", w["largest_batch"], w["seconds"])
    if wrap is not None:
        drafter = wrap(drafter)
    server = DraftServer(cfg, drafter)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    # one parseable line for supervisors and tests
    port = server.http.port if server.http else -1
    print(f"READY endpoint={server.endpoint} metrics_port={port} epoch={server.epoch}", flush=True)
    while not stop.wait(0.5):
        pass
    server.stop()
    return 0
