"""The composition root: which drafter, and how the server's parts are wired and started.

``build_drafter`` turns a config into a model backend (before anything binds). ``DraftServer``
assembles metrics, the engine, the ROUTER loop, the metrics HTTP endpoint and the watchdog, and
owns health. ``serve`` is the whole ``draft-server serve`` process: load, warm up, bind, print
READY, run until SIGINT/SIGTERM. A tool that needs a different drafter (a fault-injecting
wrapper) passes ``wrap``; nothing else in the runtime knows about it.

Start-up failures an operator can fix (no torch, no GPU, a port in use, a bad address) are one
line on stderr and exit code 2. Under systemd (``Type=notify``) the server says READY=1 once it
serves and pings WATCHDOG=1 from its watchdog thread while healthy (``sd_notify``).
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable

import msgspec
import zmq

from draft_server.config import ServerConfig, StartupError
from draft_server.drafters import Drafter, warm_up
from draft_server.engine import Engine
from draft_server.io.router import Router
from draft_server.metrics import MetricsHTTPServer, ServerMetrics
from protocol import ModelContract, ServerLimits, Weights, WireOffer
from protocol.wire import row_layout

log = logging.getLogger("draft_server")


def build_drafter(cfg: ServerConfig) -> Drafter:
    """The model backend the config names (fails before anything binds)."""
    if cfg.drafter == "checksum":
        from draft_server.drafters.checksum import ChecksumDrafter

        device = cfg.device if cfg.device.startswith("cuda") else None  # rows may come over cuda_ipc then
        return ChecksumDrafter(delay_ms=cfg.checksum_delay_ms, device=device)
    try:
        from draft_server.models import load_drafter, load_preset
    except ImportError as e:  # a base install: the client's dependencies only
        raise StartupError(f"the dspark drafter needs torch and safetensors ({e}); {INSTALL_SERVER}") from None

    kv_bytes = cfg.kv_budget_mib * (1 << 20) or None
    if cfg.model.startswith("random:"):
        return load_preset(cfg.model.split(":", 1)[1], cfg.device, cfg.dtype, kv_bytes, cfg.attention, cfg.block_width)
    return load_drafter(
        cfg.model,
        cfg.target_model or None,
        cfg.device,
        cfg.dtype,
        kv_budget_bytes=kv_bytes,
        attention=cfg.attention,
        block_width=cfg.block_width,
    )


def wire_offer(cfg: ServerConfig, drafter: Drafter) -> WireOffer:
    """The wire formats the drafter takes, narrowed to ``cfg.wire_formats`` when it names some
    (StartupError for one the drafter cannot take)."""
    offer = drafter.wire_offer()
    want = tuple(dict.fromkeys(f.strip() for f in cfg.wire_formats.split(",") if f.strip()))
    if not want:
        return offer
    missing = [f for f in want if f not in offer.formats]
    if missing:
        raise StartupError(
            f"--wire-formats {cfg.wire_formats}: the {cfg.drafter} drafter does not take {', '.join(missing)} "
            f"(it takes {', '.join(offer.formats)})"
        )
    return msgspec.structs.replace(offer, formats=want)


def largest_step_bytes(cfg: ServerConfig, contract: ModelContract, offer: WireOffer | None = None) -> int:
    """The largest valid Step: a full row frame of max_rows_per_step rows (in the widest format
    offered) plus a header of max_entries_per_step entries (session ids up to 256 bytes), with
    64 KiB to spare."""
    offer = offer or WireOffer()
    row = max(w * d.itemsize for d, w in (row_layout(f, contract, offer) for f in offer.formats))
    return cfg.max_rows_per_step * row + cfg.max_entries_per_step * (256 + 64) + (64 << 10)


class DraftServer:
    def __init__(self, cfg: ServerConfig, drafter: Drafter) -> None:
        self.cfg = cfg
        self.drafter = drafter
        self.contract = drafter.contract
        self.contract_id = self.contract.fingerprint()
        self.offer = wire_offer(cfg, drafter)
        self.epoch = f"{uuid.uuid4().hex[:12]}-{os.getpid()}"
        self.limits = ServerLimits(
            max_entries_per_step=cfg.max_entries_per_step,
            max_rows_per_step=cfg.max_rows_per_step,
            max_sessions=cfg.max_sessions,
            max_queue_rows=cfg.max_queue_rows,
            max_message_bytes=cfg.max_message_mib << 20 or largest_step_bytes(cfg, self.contract, self.offer),
            max_position=cfg.max_position,
            max_session_id_bytes=256,
            prefill_chunk_rows=cfg.prefill_chunk_rows,
            max_budget_ms=cfg.max_budget_ms,
        )
        self.metrics = m = ServerMetrics()
        m.info.info({"epoch": self.epoch, "model": self.contract.model_name, "contract": self.contract_id})
        m.set_weights(describe(drafter))
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
            idle_spin_ms=cfg.idle_spin_ms,
        )
        self.router = Router(
            cfg,
            self.engine,
            m,
            epoch=self.epoch,
            contract=self.contract,
            limits=self.limits,
            healthy=self._healthy,
            offer=self.offer,
            weights=_weights(drafter),
        )
        self.endpoint = self.router.endpoint
        r = self.router
        self.engine.attach_socket(r.engine_fds, r.engine_take, r.engine_serve, r.engine_leave)
        self._running = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="draft-watchdog", daemon=True)
        self._overrun = False
        self._started = False  # start() has started every thread (until then none can have died)
        self._sd_every, self._sd_last = sd_watchdog_interval(), 0.0
        self.http: MetricsHTTPServer | None = None
        if cfg.metrics_port >= 0:
            self.http = MetricsHTTPServer(m, self.health, cfg.metrics_host, cfg.metrics_port)

    def _queue_reply(self, ident: bytes, msg: object, payloads: list | None = None) -> None:
        self.router.queue_reply(ident, msg, payloads)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._running.set()
        self.engine.start()
        self.router.start()
        self._watchdog.start()
        self._started = True
        if self.http:
            self.http.start()
        log.info(
            "draft server %s serving %s on %s (contract %s, wire formats %s, projection %s, transports %s, "
            "metrics port %s)",
            self.epoch,
            self.contract.model_name,
            self.endpoint,
            self.contract_id,
            ", ".join(self.offer.formats),
            self.offer.projection_id or "-",
            ", ".join(self.router.transports),
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
        if not self._started:
            # start() is still starting the threads, and the first of them already answers Pings
            # (the idle engine serves the socket; a client's probe queued there during start-up is
            # read at once): the threads not started yet are not dead. Saying unhealthy here left a
            # just restarted server's first Pong unhealthy, and its clients' breakers open a while.
            return not self._overrun
        watching = self._watchdog.is_alive() or not self._running.is_set()
        return self.router.alive() and self.engine.alive() and watching and not self._overrun

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
            self._sd_ping()
            try:
                fired_for = self._watch_once(fired_for)
            except Exception:  # the watchdog must outlive anything it looks at
                log.exception("watchdog check failed")
                self.metrics.io_errors.inc()

    def _watch_once(self, fired_for: float | None) -> float | None:
        busy = self.engine.busy_since
        overrun = busy is not None and time.monotonic() - busy > self.cfg.watchdog_s
        if overrun and fired_for != busy:
            fired_for = busy
            self.metrics.watchdog_fired.inc()
            log.error("engine iteration running for over %.1f s: health red", self.cfg.watchdog_s)
            if self.cfg.watchdog_exit:
                self._exit_after_scrape()
        self._overrun = overrun
        self.metrics.healthy.set(1 if self._healthy() else 0)
        return fired_for

    def _sd_ping(self) -> None:
        """WATCHDOG=1 to systemd (WatchdogSec) every half period, only while healthy: a hung engine
        or a dead thread goes silent and systemd restarts the service."""
        if self._sd_every and self._healthy():
            now = time.monotonic()
            if now - self._sd_last >= self._sd_every:
                sd_notify("WATCHDOG=1")
                self._sd_last = now

    def _exit_after_scrape(self) -> None:
        """Exit with code 3, once Prometheus has scraped the fired watchdog (or after a bound).

        Exiting at once, the process died before any scrape saw draft_server_watchdog_fired_total
        or draft_server_healthy 0, and no alert on them could fire."""
        self._overrun = True
        self.metrics.healthy.set(0)
        seen = self.metrics.renders
        deadline = time.monotonic() + WATCHDOG_EXIT_HOLD_S
        if self.http is not None:
            while self.metrics.renders == seen and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)  # let that scrape's reply leave
        log.error("exiting with code 3 (--watchdog-exit) for the supervisor to restart the server")
        sd_notify("STATUS=watchdog fired: exiting with code 3")
        logging.shutdown()
        os._exit(3)


def settle_heap() -> None:
    """Collect once, then freeze what start-up made (the drafter, its modules, the warm-up's objects:
    about 170,000 tracked objects with the checksum drafter) out of the cyclic collector's reach. A
    full collection walks all of them (30-65 ms with the GIL held, measured during start-up on the
    2-core VM) in whatever step allocates when one falls due. Serving itself hardly collects (1-2
    young collections per 1,000 steps of 64 sessions), so this bounds a rare stall, no more. Objects
    made later are collected as usual; what start-up made is still freed by reference counting."""
    gc.collect()
    gc.freeze()


def serve(cfg: ServerConfig, wrap: Callable[[Drafter], Drafter] | None = None) -> int:
    """Run ``draft-server serve`` until SIGINT/SIGTERM; 2, after one line on stderr, when it cannot start."""
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = _start(cfg, wrap)
    except StartupError as e:
        print(f"draft-server: {e}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    settle_heap()
    server.start()
    # one parseable line for supervisors and tests
    port = server.http.port if server.http else -1
    print(f"READY endpoint={server.endpoint} metrics_port={port} epoch={server.epoch}", flush=True)
    sd_notify(f"READY=1\nSTATUS=serving {server.contract.model_name} on {server.endpoint}\nMAINPID={os.getpid()}")
    while not stop.wait(0.5):
        pass
    sd_notify("STOPPING=1")
    server.stop()
    return 0


def _start(cfg: ServerConfig, wrap: Callable[[Drafter], Drafter] | None) -> DraftServer:
    """Load, prepare and warm up the drafter, then bind; StartupError for what an operator must fix."""
    if cfg.drafter != "checksum" or cfg.device.startswith("cuda"):
        check_device(cfg.device)
    sd_notify("STATUS=loading the drafter")
    drafter = load_with_progress(cfg)
    if cfg.drafter != "checksum":  # a model: its first steps after a (re)start must not miss their budgets
        t0 = time.perf_counter()
        try:
            p = drafter.prepare(cfg.max_batch_sessions, cfg.max_batch_rows)
        except RuntimeError as e:  # a CUDA graph that drafts differently from eager: refuse to serve
            raise StartupError(f"start-up self-test failed: {e}") from None
        if p:
            log.info("prepared in %.2f s: %s", time.perf_counter() - t0, p)
        w = warm_up(drafter, cfg.max_batch_sessions, cfg.prefill_chunk_rows)
        log.info("warm-up: batches up to %d sessions and one prefill chunk in %.2f s", w["largest_batch"], w["seconds"])
    if wrap is not None:
        drafter = wrap(drafter)
    try:
        return DraftServer(cfg, drafter)
    except zmq.ZMQError as e:
        raise StartupError(f"--bind {cfg.bind}: {_bind_reason(e.errno, e.strerror)}") from None
    except OSError as e:  # the Curve key files
        raise StartupError(f"{e.filename or 'start-up'}: {e.strerror or e}") from None


def _bind_reason(code: int | None, text: str) -> str:
    if code == errno.EADDRINUSE:
        return f"the address is in use (another draft-server?): {text}"
    if code in (errno.ENODEV, errno.EADDRNOTAVAIL):
        return f"no such address or interface on this host ({text})"
    return text


# ---------------------------------------------------------------------------- device and loading

INSTALL_SERVER = "pip install 'draft-service[server]'"
LOAD_PROGRESS_S = 5.0


def check_device(device: str) -> None:
    """Refuse a CUDA device that is not there; say so loudly when ``auto`` lands on the CPU."""
    try:
        import torch
    except ImportError as e:
        raise StartupError(f"the dspark drafter needs torch and safetensors ({e}); {INSTALL_SERVER}") from None
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    build = f"torch {torch.__version__} ({cuda})"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise StartupError(f"--device {device}: no CUDA GPU is usable by {build}{_gpu_hint()}")
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise StartupError(f"--device {device}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
    elif device == "auto" and not torch.cuda.is_available():
        log.warning(
            "device auto: no CUDA GPU usable by %s%s; drafting on the CPU (--device cuda refuses to start instead)",
            build,
            _gpu_hint(),
        )


def _gpu_hint() -> str:
    hints = []
    if os.path.exists("/dev/nvidia0"):
        hints.append("/dev/nvidia0 exists: is the driver older than this torch's CUDA?")
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        hints.append(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}")
    return f" ({'; '.join(hints)})" if hints else ""


def load_with_progress(cfg: ServerConfig) -> Drafter:
    """``build_drafter`` with a progress line every few seconds and one final line naming model,
    format, device, dtype and memory."""
    if cfg.drafter == "checksum":
        return build_drafter(cfg)
    if cfg.model.startswith("random:"):
        fmt = "random preset: full size, random weights"
    else:
        fmt = _checkpoint_format(cfg.model)
    log.info("loading %s (%s) on device %s, dtype %s", cfg.model, fmt, cfg.device, cfg.dtype)
    t0 = time.monotonic()
    done = threading.Event()

    def progress() -> None:
        while not done.wait(LOAD_PROGRESS_S):
            log.info("loading %s: %.0f s", cfg.model, time.monotonic() - t0)

    ticker = threading.Thread(target=progress, name="draft-load-progress", daemon=True)
    ticker.start()
    try:
        drafter = build_drafter(cfg)
    except (ValueError, OSError) as e:
        raise StartupError(f"cannot load the drafter: {e}") from None
    finally:
        done.set()
        ticker.join(1.0)  # a progress line it is writing lands before the final one, never after
    d = describe(drafter)
    if d["format"] == "exl3":
        fmt = f"EXL3 {d['bits']:g} bpw ({d['quantized']} quantized linears, {'/'.join(d['codebooks'])})"
    log.info(
        "loaded %s (%s) in %.1f s: device %s, dtype %s, weights %s, KV cache %s (%d tokens)",
        cfg.model,
        fmt,
        time.monotonic() - t0,
        d["device"],
        d["dtype"],
        _bytes(d["weight_bytes"]),
        _bytes(d["kv_bytes"]),
        drafter.capacity_tokens(),
    )
    return drafter


def describe(drafter: Drafter) -> dict:
    """Device, dtype, weight format, bits and bytes, KV bytes of a model drafter.

    Weight bytes are what the format holds (EXL3: the packed tensors plus the dense ones), from
    the loader's ``weight_info``; without it (random presets), what the model's tensors hold."""
    model = getattr(drafter, "model", None)
    weights = [t for t in getattr(model, "w", {}).values() if hasattr(t, "numel")]  # EXL3: routed modules beside
    cache = getattr(getattr(drafter, "cache", None), "data", None)
    info = getattr(model, "weight_info", None)
    dense = sum(t.numel() * t.element_size() for t in weights)
    return {
        "device": str(getattr(model, "device", "?")),
        "dtype": str(getattr(model, "dtype", "?")).replace("torch.", ""),
        "format": info.format if info else ("dense" if model is not None else "none"),
        "bits": info.bits if info else 8.0 * (weights[0].element_size() if weights else 0),
        "quantized": info.quantized if info else 0,
        "codebooks": info.codebooks if info else (),
        "weight_bytes": info.weight_bytes if info else dense,
        "kv_bytes": 0 if cache is None else cache.numel() * cache.element_size(),
    }


def _weights(drafter: Drafter) -> Weights:
    """The Welcome's account of the weights (model drafters; unknown for the checksum drafter)."""
    if getattr(drafter, "model", None) is None:
        return Weights()
    d = describe(drafter)
    return Weights(str(d["format"]), float(d["bits"]), int(d["weight_bytes"]))


def _bytes(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _checkpoint_format(model_dir: str) -> str:
    """'safetensors, bf16' (or ', exl3') from the shards' headers (8-byte length + JSON; no tensor is read)."""
    dtypes: set[str] = set()
    exl3 = False
    try:
        for name in sorted(os.listdir(model_dir)):
            if name.endswith(".safetensors"):
                with open(os.path.join(model_dir, name), "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(n))
                dtypes |= {v["dtype"].lower() for k, v in header.items() if k != "__metadata__"}
                exl3 = exl3 or any(k.endswith(".trellis") for k in header)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return "checkpoint"
    if exl3 or os.path.exists(os.path.join(model_dir, "quantization_config.json")):
        return "safetensors, exl3"
    return f"safetensors, {'/'.join(sorted(dtypes))}" if dtypes else "checkpoint"


# ---------------------------------------------------------------------------- systemd

# --watchdog-exit waits this long at most for the scrape that records the fired watchdog (a
# Prometheus scrape interval up to 15 s; compose and the ServiceMonitor scrape every 5 s)
WATCHDOG_EXIT_HOLD_S = 15.0


def sd_notify(state: str) -> bool:
    """Tell systemd (``Type=notify``) our state; a no-op outside systemd. No dependency: one
    datagram to the unix socket in $NOTIFY_SOCKET ('@' is the abstract namespace)."""
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(state.encode(), addr)
    except OSError as e:
        log.warning("sd_notify to %s failed: %s", os.environ.get("NOTIFY_SOCKET"), e)
        return False
    return True


def sd_watchdog_interval() -> float:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), 0 when systemd set no watchdog for us."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return 0.0
    return int(usec) / 2e6
