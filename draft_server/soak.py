"""`draft-soak`: drive a draft server with synthetic target engines while injecting faults.

Owns the soak command: it starts and supervises a draft server (or attaches to a running one),
starts several synthetic target engines (``soak_engine``, one process and one DraftClient
each), optionally a fault-injecting proxy between them and the server (``chaos_proxy``) and
rogue clients (``chaos_rogue``), runs the chaos schedule, samples the server (RSS, GPU memory,
live sessions), and then writes a JSON report, PNG plots and a one-screen summary. The exit
code is 1 when an invariant breaks, 2 when the soak itself could not run.

Chaos modes (``--chaos``, each with its own rate flags):

  kill    SIGKILL the server, restart it on the same port        (--kill-every-s, --down-ms)
  pause   SIGSTOP, then SIGCONT                                    (--pause-every-s, --pause-ms)
  drop    the proxy drops a fraction of requests and of replies   (--drop-request-p, --drop-reply-p)
  delay   the proxy holds back a fraction of engine steps          (--delay-p, --delay-ms)
  slow    the server sleeps in a fraction of engine iterations     (--slow-p, --slow-ms)
  rogue   bursts of malformed and oversized frames                  (--rogue-every-s, --rogue-messages)
  vanish  a client opens sessions and disconnects without Free     (--vanish-every-s, --vanish-sessions)
  flood   one Step with more sessions than the server's capacity   (--flood-every-s, --flood-sessions)
  fuzz    a steady stream of hostile messages (the decoder fuzz)   (--fuzz-messages)

Invariants (all must hold for exit code 0):

  wait_within_budget     every step() returned within its budget + 5 ms, net of the time the
                         host did not run the engine (run-queue wait, steal); every call over the
                         bound that this does not explain gets forensics (GC, page faults, the
                         other threads' CPU, the canary, and every thread's stack at the bound)
  drafts_valid           every reply carried k valid token ids when OK, none otherwise
  resume_after_restart   after each restart, drafting is back within --resume-steps engine
                         steps counted from the first step that started after READY
  zero_sessions_at_end   the server holds no session once the engines finished (Free, TTL)
  memory_flat            server RSS grows less than --rss-tolerance-mib and GPU memory (nvidia-smi,
                         and bytes held by tensors) less than --gpu-tolerance-mib after warm-up,
                         within each server process
  untouched_equal_reference  sessions no fault touched drafted exactly what a fault-free run
                         drafts (checksum: computed in process; a model: a second fault-free pass;
                         --reference-min-agreement below 1 for drafters that are not batch-invariant)
  server_healthy         no unexpected server exit, no engine/I/O errors in its metrics
  engines_completed      every engine process ran to the end
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from draft_server.soak_engine import EngineSpec, engine_main

SLACK_MS = 5.0
ALL_MODES = ("kill", "pause", "drop", "delay", "slow", "rogue", "vanish", "flood", "fuzz")
TOUCHING = ("kill", "pause", "flood")  # windows that can change a session's drafts without a failed call


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, timeout: float = 0.5) -> dict[str, float] | None:
    """The server's /metrics as {name{labels}: value}, or None when it does not answer in time."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout).read().decode()
    except Exception:
        return None
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# ------------------------------------------------------------------------------------ server


class ServerSupervisor:
    """A `draft-server serve` subprocess on fixed ports: start, kill, pause, resume, stop.

    A reader thread drains its output, timestamps READY lines and the server's chaos-delay
    log lines, and keeps the last lines for diagnostics. An exit that this class did not cause
    is counted as unexpected.
    """

    def __init__(self, cmd: list[str]) -> None:
        self.cmd = cmd
        self.proc: subprocess.Popen | None = None
        self.incarnations: list[dict[str, Any]] = []  # {start, ready, end, pid, epoch, how}
        self.slow_events: list[float] = []
        self.tail: deque[str] = deque(maxlen=50)
        self.unexpected_exits = 0
        self._ready = threading.Event()
        self._expected_exit = False
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        p = self.proc
        return p.pid if p is not None and p.poll() is None else None

    def _reader(self, proc: subprocess.Popen, inc: dict[str, Any]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.monotonic()
            if line.startswith("READY "):
                fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
                inc["ready"] = now
                inc["epoch"] = fields.get("epoch", "")
                self._ready.set()
            elif "chaos delay" in line:
                self.slow_events.append(now)
            else:
                self.tail.append(line.rstrip())

    def start(self, timeout_s: float = 120.0) -> float:
        """Start and wait for READY; returns its time (monotonic). RuntimeError if it never comes."""
        with self._lock:
            self._ready.clear()
            self._expected_exit = False
            inc: dict[str, Any] = {"start": time.monotonic(), "ready": None, "end": None, "epoch": "", "how": ""}
            self.proc = subprocess.Popen(
                self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
            )
            inc["pid"] = self.proc.pid
            self.incarnations.append(inc)
            threading.Thread(target=self._reader, args=(self.proc, inc), daemon=True).start()
        if not self._ready.wait(timeout_s) or inc["ready"] is None:
            self.kill("failed start")
            raise RuntimeError("draft server did not print READY:\n" + "\n".join(self.tail))
        return inc["ready"]

    def _end(self, how: str) -> None:
        if self.incarnations and self.incarnations[-1]["end"] is None:
            self.incarnations[-1]["end"] = time.monotonic()
            self.incarnations[-1]["how"] = how

    def kill(self, how: str = "kill") -> None:
        with self._lock:
            p = self.proc
            if p is None:
                return
            self._expected_exit = True
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
            self._end(how)

    def pause(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        with self._lock:
            p = self.proc
            if p is None:
                return
            self._expected_exit = True
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                    p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
            self._end("stop")

    def check_alive(self) -> bool:
        """False (and counted) when the server exited without being told to."""
        with self._lock:
            p = self.proc
            if p is None or self._expected_exit or p.poll() is None:
                return True
            self.unexpected_exits += 1
            self._expected_exit = True
            self._end(f"unexpected exit {p.returncode}")
            return False


class AttachedServer:
    """A server this soak did not start: it can be paused (with --server-pid), never restarted."""

    def __init__(self, pid: int | None) -> None:
        self._pid = pid
        self.incarnations: list[dict[str, Any]] = [
            {"start": time.monotonic(), "ready": time.monotonic(), "end": None, "epoch": "", "how": "", "pid": pid}
        ]
        self.slow_events: list[float] = []
        self.tail: deque[str] = deque()
        self.unexpected_exits = 0

    @property
    def pid(self) -> int | None:
        return self._pid

    def pause(self) -> None:
        if self._pid:
            os.kill(self._pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._pid:
            os.kill(self._pid, signal.SIGCONT)

    def check_alive(self) -> bool:
        return True

    def stop(self) -> None:
        self.incarnations[-1]["end"] = time.monotonic()


# ------------------------------------------------------------------------------------ sampling


def _gpu_mib_by_pid() -> dict[int, float] | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    res: dict[int, float] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            with contextlib.suppress(ValueError):
                res[int(parts[0])] = res.get(int(parts[0]), 0.0) + float(parts[1])
    return res


class Sampler(threading.Thread):
    """Every ``period_s``: server RSS, GPU memory of the server pid, live sessions and queue from /metrics."""

    def __init__(self, server: Any, metrics_port: int, period_s: float) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.server, self.metrics_port, self.period_s = server, metrics_port, period_s
        # [t, incarnation, rss_mib, gpu_mib (nvidia-smi), sessions, queue_rows, gpu_allocated_mib, gpu_reserved_mib]
        self.samples: list[list[Any]] = []
        self.last_metrics: dict[int, dict[str, float]] = {}  # per incarnation, the last scrape
        self.stop_evt = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.stop_evt.wait(self.period_s):
            t = time.monotonic()
            inc = len(self.server.incarnations) - 1
            pid = self.server.pid
            rss = gpu = None
            if pid is not None:
                with contextlib.suppress(psutil.Error):
                    rss = psutil.Process(pid).memory_info().rss / 2**20
                g = _gpu_mib_by_pid()
                if g is not None:
                    gpu = g.get(pid, 0.0)
            m = scrape(self.metrics_port) if self.metrics_port > 0 else None
            sessions = queue = alloc = reserved = None
            if m is not None:
                self.last_metrics[inc] = m
                sessions = m.get("draft_server_sessions")
                queue = m.get("draft_server_queue_rows")
                if "draft_server_gpu_memory_allocated_bytes" in m:
                    alloc = m["draft_server_gpu_memory_allocated_bytes"] / 2**20
                    reserved = m["draft_server_gpu_memory_reserved_bytes"] / 2**20
            self.samples.append([t, inc, rss, gpu, sessions, queue, alloc, reserved])


def run_canary(stop: Any, path: str, period_s: float = 0.002, threshold_s: float = 0.003) -> None:
    """Process entry: sleep ``period_s`` in a loop and log every wake-up later than ``threshold_s``.

    A separate process with no other work, so what it sees is the host's scheduling delay (other
    processes on the machine), never our own GIL. The soak uses it to tell a wait over budget
    that the client caused from one where the operating system did not run anybody on time.
    """
    stalls: list[tuple[float, float]] = []
    parent = os.getppid()
    while not stop.is_set() and os.getppid() == parent:
        t = time.monotonic()
        time.sleep(period_s)
        late = time.monotonic() - t - period_s
        if late > threshold_s:
            stalls.append((t + period_s, late))
    with open(path, "w") as f:
        json.dump(stalls, f)


# ------------------------------------------------------------------------------------ chaos


@dataclass
class ChaosEvent:
    kind: str
    t0: float
    t1: float
    detail: dict[str, Any] = field(default_factory=dict)


class ChaosScheduler(threading.Thread):
    """Runs the discrete chaos modes one at a time, each on its own seeded period."""

    def __init__(self, args: argparse.Namespace, server: Any, endpoint: str, t_start: float, t_stop: float) -> None:
        super().__init__(name="soak-chaos", daemon=True)
        self.args, self.server, self.endpoint = args, server, endpoint
        self.t_start, self.t_stop = t_start, t_stop
        self.events: list[ChaosEvent] = []
        self.errors: list[str] = []
        self.stop_evt = threading.Event()
        self.rng = np.random.default_rng([args.seed, 99])
        self.limits: Any = None
        self.width = 128

    def _periods(self) -> dict[str, float]:
        a, modes = self.args, self.args.modes
        p = {
            "kill": a.kill_every_s,
            "pause": a.pause_every_s,
            "rogue": a.rogue_every_s,
            "vanish": a.vanish_every_s,
            "flood": a.flood_every_s,
        }
        return {k: v for k, v in p.items() if k in modes and v > 0}

    def run(self) -> None:
        periods = self._periods()
        if not periods:
            return
        first = self.t_start + self.args.warmup_s
        # staggered first firings so that modes do not bunch up at the start
        due = {k: first + (i + self.rng.random()) * min(v, 5.0) for i, (k, v) in enumerate(sorted(periods.items()))}
        while not self.stop_evt.is_set():
            kind = min(due, key=due.__getitem__)
            wait = due[kind] - time.monotonic()
            if wait > 0:
                if self.stop_evt.wait(min(wait, 0.2)):
                    return
                continue
            if time.monotonic() >= self.t_stop:
                return
            try:
                self._fire(kind)
            except Exception as e:  # recorded; a soak keeps going
                self.errors.append(f"{kind}: {type(e).__name__}: {e}")
            due[kind] = time.monotonic() + periods[kind] * float(self.rng.uniform(0.75, 1.25))
            # one disruption at a time, with room between them to see recovery
            for k in due:
                due[k] = max(due[k], time.monotonic() + self.args.chaos_gap_s)

    def _fire(self, kind: str) -> None:
        a = self.args
        t0 = time.monotonic()
        detail: dict[str, Any] = {}
        if kind == "kill":
            self.server.kill("chaos kill")
            time.sleep(a.down_ms / 1000.0)
            detail["ready"] = self.server.start()
        elif kind == "pause":
            self.server.pause()
            time.sleep(a.pause_ms / 1000.0)
            self.server.resume()
        elif kind == "rogue":
            from draft_server.chaos_rogue import malformed_burst, oversized

            detail = malformed_burst(self.endpoint, a.rogue_messages, int(self.rng.integers(1 << 30)), self.width)
            detail.update(oversized(self.endpoint, a.max_message_mib << 20, self.limits, self.width))
        elif kind == "vanish":
            from draft_server.chaos_rogue import vanish

            detail = vanish(self.endpoint, a.vanish_sessions)
        elif kind == "flood":
            from draft_server.chaos_rogue import flood

            detail = flood(self.endpoint, a.flood_sessions or a.max_sessions + 64)
        self.events.append(ChaosEvent(kind, t0, time.monotonic(), detail))


# ------------------------------------------------------------------------------------ the run


@dataclass
class RunResult:
    engines: list[dict[str, Any]]
    events: list[ChaosEvent]
    chaos_errors: list[str]
    samples: list[list[Any]]
    incarnations: list[dict[str, Any]]
    slow_events: list[float]
    proxy: dict[str, Any] | None
    fuzz: dict[str, Any] | None
    last_metrics: dict[int, dict[str, float]]
    end_sessions: dict[str, Any]
    unexpected_exits: int
    t_start: float
    t_end: float
    server_tail: list[str]
    host_stalls: list[tuple[float, float]]  # (time the canary should have woken, seconds late)


def _server_cmd(args: argparse.Namespace, port: int, mport: int, chaos: bool) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "draft_server",
        "serve",
        "--drafter",
        args.drafter,
        "--bind",
        f"tcp://127.0.0.1:{port}",
        "--metrics-port",
        str(mport),
        "--log-level",
        "WARNING",
        "--session-ttl-s",
        str(args.session_ttl_s),
        "--max-sessions",
        str(args.max_sessions),
        "--max-message-mib",
        str(args.max_message_mib),
    ]
    if args.model:
        cmd += ["--model", args.model]
    if args.target_model:
        cmd += ["--target-model", args.target_model]
    if args.device:
        cmd += ["--device", args.device]
    if chaos and "slow" in args.modes:
        cmd += ["--chaos-delay-p", str(args.slow_p), "--chaos-delay-ms", str(args.slow_ms)]
    return cmd + list(args.server_arg)


def _wait_proc(p: mp.process.BaseProcess, timeout: float) -> None:
    p.join(timeout)
    if p.is_alive():
        p.terminate()
        p.join(5)
    if p.is_alive():
        p.kill()
        p.join(5)


def run_pass(args: argparse.Namespace, workdir: str, chaos: bool, max_steps: list[int] | None = None) -> RunResult:
    """One soak pass: server, proxy, rogues, engines, chaos; everything cleaned up on the way out."""
    ctx = mp.get_context("spawn")
    modes = set(args.modes) if chaos else set()
    attached = bool(args.endpoint)
    server: Any
    if attached:
        server = AttachedServer(args.server_pid)
        endpoint, mport = args.endpoint, args.metrics_port
    else:
        port, mport = _free_port(), _free_port()
        server = ServerSupervisor(_server_cmd(args, port, mport, chaos))
        endpoint = f"tcp://127.0.0.1:{port}"
    procs: list[mp.process.BaseProcess] = []
    proxy_proc = fuzz_proc = None
    proxy_stats_path = os.path.join(workdir, f"proxy-{int(chaos)}.json")
    fuzz_stats_path = os.path.join(workdir, f"fuzz-{int(chaos)}.json")
    sampler = scheduler = None
    canary_stop = ctx.Event()
    canary_path = os.path.join(workdir, f"canary-{int(chaos)}.json")
    canary = ctx.Process(target=run_canary, args=(canary_stop, canary_path), name="soak-canary")
    canary.start()
    engines_out: list[dict[str, Any]] = []
    end_sessions: dict[str, Any] = {}
    try:
        if not attached:
            server.start()
        from draft_server.chaos_rogue import Peer

        peer = Peer(endpoint, "soak-probe")
        try:
            welcome = peer.hello(timeout_s=30.0)
        finally:
            peer.close()
        if welcome is None:
            raise RuntimeError(f"no Welcome from the draft server at {endpoint}")
        width = welcome.contract.tap_width
        engine_endpoint = endpoint
        if modes & {"drop", "delay"}:
            from draft_server.chaos_proxy import ProxyConfig, run_proxy

            pport = _free_port()
            pcfg = ProxyConfig(
                frontend=f"tcp://127.0.0.1:{pport}",
                backend=endpoint,
                drop_request_p=args.drop_request_p if "drop" in modes else 0.0,
                drop_reply_p=args.drop_reply_p if "drop" in modes else 0.0,
                delay_p=args.delay_p if "delay" in modes else 0.0,
                delay_ms=args.delay_ms,
                seed=args.seed,
            )
            ready = ctx.Event()
            proxy_proc = ctx.Process(target=run_proxy, args=(pcfg, proxy_stats_path, ready), name="soak-proxy")
            proxy_proc.start()
            if not ready.wait(30):
                raise RuntimeError("chaos proxy did not start")
            engine_endpoint = pcfg.frontend
        sampler = Sampler(server, mport, args.sample_s)
        sampler.start()
        stop, go = ctx.Event(), ctx.Event()
        readies = []
        specs = []
        for i in range(args.engines):
            spec = EngineSpec(
                index=i,
                endpoint=engine_endpoint,
                out_path=os.path.join(workdir, f"engine-{i}-{int(chaos)}.json"),
                seed=args.seed,
                sessions=args.sessions,
                budget_ms=args.budget_ms,
                step_ms=args.step_ms,
                k=args.k,
                long_prefill_rows=args.long_prefill_rows,
                prefill_rows=tuple(int(x) for x in args.prefill_rows.split(",")),  # type: ignore[arg-type]
                checksum=args.drafter == "checksum",
                max_steps=max_steps[i] if max_steps else 0,
                reconnect_ivl_ms=args.reconnect_ivl_ms,
            )
            specs.append(spec)
            ready = ctx.Event()
            readies.append(ready)
            p = ctx.Process(target=engine_main, args=(spec, stop, ready, go), name=f"soak-engine-{i}")
            p.start()
            procs.append(p)
        deadline = time.monotonic() + 180.0
        for ready, p in zip(readies, procs, strict=True):
            while not ready.wait(0.2):
                if not p.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"engine {p.name} did not connect")
        time.sleep(0.5)  # let the processes settle after their imports
        go.set()
        t_start = time.monotonic()
        duration = args.duration_s if max_steps is None else 10 * args.duration_s + 600
        t_stop_chaos = t_start + max(0.0, duration - args.cooldown_s)
        if "fuzz" in modes and args.fuzz_messages > 0:
            from draft_server.chaos_rogue import run_fuzz

            rate = args.fuzz_messages / max(1.0, duration - args.cooldown_s - args.warmup_s)
            fuzz_proc = ctx.Process(
                target=run_fuzz,
                args=(endpoint, args.fuzz_messages, rate, args.seed + 7, width, fuzz_stats_path),
                name="soak-fuzz",
            )
            fuzz_proc.start()
        if modes:
            scheduler = ChaosScheduler(args, server, endpoint, t_start, t_stop_chaos)
            scheduler.limits = welcome.limits
            scheduler.width = width
            scheduler.start()
        # supervise until the duration is over (or, for a reference pass, the engines are done)
        while time.monotonic() < t_start + duration:
            if not server.check_alive():
                with contextlib.suppress(RuntimeError):
                    server.start()  # keep the soak going; the unexpected exit is reported
            if max_steps is not None and not any(p.is_alive() for p in procs):
                break
            if max_steps is None and not all(p.is_alive() for p in procs):
                break  # an engine died early: stop and report
            time.sleep(0.1)
        if scheduler is not None:
            scheduler.stop_evt.set()
            scheduler.join(60)
        if fuzz_proc is not None and fuzz_proc.is_alive():
            fuzz_proc.terminate()
        stop.set()
        for p in procs:
            _wait_proc(p, 60)
        t_end = time.monotonic()
        # every engine freed its sessions; vanished clients' sessions age out by TTL
        deadline = time.monotonic() + args.session_ttl_s + args.end_grace_s
        live = None
        while time.monotonic() < deadline:
            m = scrape(mport, timeout=2.0) if mport > 0 else None
            live = m.get("draft_server_sessions") if m else None
            if live == 0:
                break
            time.sleep(0.2)
        end_sessions = {"live_at_end": live, "seconds_to_zero": round(time.monotonic() - t_end, 2)}
        for spec in specs:
            try:
                with open(spec.out_path) as f:
                    engines_out.append(json.load(f))
                engines_out[-1]["late_stacks"] = _late_stacks(spec.out_path + ".stacks")
            except (OSError, ValueError) as e:
                engines_out.append({"spec": asdict(spec), "error": f"no result file: {e}", "calls": [], "sessions": []})
    finally:
        if scheduler is not None:
            scheduler.stop_evt.set()
        for p in procs:
            if p.is_alive():
                _wait_proc(p, 5)
        if fuzz_proc is not None:
            _wait_proc(fuzz_proc, 10)
        if proxy_proc is not None:
            if proxy_proc.is_alive():
                proxy_proc.terminate()
            _wait_proc(proxy_proc, 10)
        if sampler is not None:
            sampler.stop_evt.set()
            sampler.join(10)
        canary_stop.set()
        _wait_proc(canary, 10)
        server.stop()

    def _load(path: str) -> dict[str, Any] | None:
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    return RunResult(
        engines=engines_out,
        events=scheduler.events if scheduler else [],
        chaos_errors=scheduler.errors if scheduler else [],
        samples=sampler.samples if sampler else [],
        incarnations=server.incarnations,
        slow_events=list(server.slow_events),
        proxy=_load(proxy_stats_path) if proxy_proc is not None else None,
        fuzz=_load(fuzz_stats_path) if fuzz_proc is not None else None,
        last_metrics=sampler.last_metrics if sampler else {},
        end_sessions=end_sessions,
        unexpected_exits=server.unexpected_exits,
        t_start=t_start,
        t_end=t_end,
        server_tail=list(server.tail),
        host_stalls=[tuple(x) for x in (_load(canary_path) or [])],  # type: ignore[misc]
    )


# ------------------------------------------------------------------------------------ analysis


def _calls(engine: dict[str, Any]) -> np.ndarray:
    cols = engine.get("call_columns") or []
    arr = np.array(engine.get("calls") or [], dtype=np.float64)
    return arr.reshape(-1, len(cols)) if cols else np.zeros((0, 1))


def _col(engine: dict[str, Any], name: str) -> int:
    return engine["call_columns"].index(name)


def _sessions(engine: dict[str, Any]) -> list[dict[str, Any]]:
    cols = engine.get("session_columns") or []
    return [dict(zip(cols, row, strict=True)) for row in engine.get("sessions") or []]


def _overlaps(a0: float, a1: float, windows: list[tuple[float, float]]) -> bool:
    return any(a0 <= w1 and w0 <= a1 for w0, w1 in windows)


def _pct(x: np.ndarray, q: float) -> float | None:
    return float(np.percentile(x, q)) if len(x) else None


def _touching_windows(res: RunResult, margin_s: float) -> list[tuple[float, float]]:
    out = []
    for e in res.events:
        if e.kind in TOUCHING:
            out.append((e.t0 - margin_s, e.t1 + margin_s))
    return out


def _resume(args: argparse.Namespace, res: RunResult, kind: str = "kill") -> list[dict[str, Any]]:
    """Steps until drafting was back, per engine, after each restart's READY (kind "kill") or
    after each SIGCONT (kind "pause"), with the reason when a measurement is excluded."""
    budget_s = args.budget_ms / 1000.0
    proxy_events = [(t, kind, ident) for t, kind, ident in (res.proxy or {}).get("events", [])]
    out = []
    if kind == "kill":
        marks = [(e, e.detail["ready"]) for e in res.events if e.kind == "kill" and e.detail.get("ready")]
    else:
        marks = [(e, e.t1) for e in res.events if e.kind == kind]
    for ev, ready in marks:
        others = [(e.t0, e.t1) for e in res.events if e.kind in ("kill", "pause", "flood") and e is not ev]
        row: dict[str, Any] = {"t_ready": round(ready - res.t_start, 3), "engines": []}
        for eng in res.engines:
            idx = eng["spec"]["index"]
            calls = _calls(eng)
            if not len(calls):
                continue
            t0c, waitc, dr = _col(eng, "t0"), _col(eng, "wait_ms"), _col(eng, "drafted")
            after = calls[calls[:, t0c] >= ready]
            got = np.nonzero(after[:, dr] > 0)[0]
            if not len(after) or not len(got):
                row["engines"].append({"engine": idx, "steps": None, "excluded": "run ended before drafting"})
                continue
            n = int(got[0])
            t_back = after[n, t0c] + after[n, waitc] / 1000.0
            reason = None
            ident = f"soak-e{idx}"
            if any(ready - budget_s - 0.05 <= t <= t_back and i == ident for t, _, i in proxy_events):
                reason = "proxy dropped or delayed this engine's message meanwhile"
            elif any(ready <= t <= t_back for t in res.slow_events):
                reason = "an injected slow server iteration meanwhile"
            elif _overlaps(ready, t_back, others):
                reason = "another chaos event meanwhile"
            elif any(due <= t_back and due + late >= ready and late >= 0.010 for due, late in res.host_stalls):
                reason = "the host stalled a process for >= 10 ms meanwhile (canary)"
            entry: dict[str, Any] = {"engine": idx, "steps": n, "seconds": round(t_back - ready, 4), "excluded": reason}
            if n:  # the steps without drafts: when they started, how long they waited, what they got
                entry["steps_without_drafts"] = [
                    {
                        "t_ms": round((c[t0c] - ready) * 1000.0, 1),
                        "wait_ms": round(float(c[waitc]), 1),
                        **{k: int(c[_col(eng, k)]) for k in ("ok", "none", "expired", "overloaded") if c[_col(eng, k)]},
                    }
                    for c in after[: min(n, 8)]
                ]
            row["engines"].append(entry)
        out.append(row)
    return out


def _memory(args: argparse.Namespace, res: RunResult) -> dict[str, Any]:
    per_inc = []
    samples = res.samples
    for i, inc in enumerate(res.incarnations):
        start = inc.get("ready") or inc["start"]
        rows = [s for s in samples if s[1] == i and s[0] >= start + args.mem_warmup_s]
        out: dict[str, Any] = {"incarnation": i, "samples": len(rows), "checked": False}
        w = max(2, args.mem_window)
        for key, col in (("rss", 2), ("gpu", 3), ("gpu_allocated", 6), ("gpu_reserved", 7)):
            vals = [s[col] for s in rows if len(s) > col and s[col] is not None]
            if len(vals) >= 2 * w:
                base, last = float(np.median(vals[:w])), float(np.median(vals[-w:]))
                out[f"{key}_base_mib"] = round(base, 2)
                out[f"{key}_end_mib"] = round(last, 2)
                out[f"{key}_growth_mib"] = round(last - base, 2)
                out[f"{key}_max_mib"] = round(max(vals), 2)
                out["checked"] = True
        per_inc.append(out)
    growths = [v for inc in per_inc for k, v in inc.items() if k.endswith("_growth_mib")]
    return {
        "tolerance_mib": args.rss_tolerance_mib,
        "warmup_s": args.mem_warmup_s,
        "incarnations": per_inc,
        "max_growth_mib": max(growths) if growths else None,
        "checked": any(inc["checked"] for inc in per_inc),
    }


def _reference(args: argparse.Namespace, res: RunResult, ref: RunResult | None) -> dict[str, Any]:
    windows = _touching_windows(res, args.budget_ms / 1000.0 + 0.05)
    untouched = touched = mism = checked = compared = differ = 0
    examples: list[str] = []
    ref_crc: dict[tuple[int, int], tuple[int, int, list[int]]] = {}
    same_tokens = total_tokens = 0
    min_agree: float | None = None
    if ref is not None:
        for eng in ref.engines:
            for s in _sessions(eng):
                if s["finished"] and s["all_ok"]:
                    ref_crc[(eng["spec"]["index"], s["number"])] = (s["steps"], s["draft_crc"], s.get("tokens") or [])
    prefix_mism = 0
    for eng in res.engines:
        idx = eng["spec"]["index"]
        for s in _sessions(eng):
            t = (not s["all_ok"]) or s["epochs"] > 1 or _overlaps(s["first_t0"], s["last_t1"], windows)
            if t:
                touched += 1
                prefix_mism += 0
                continue
            untouched += 1
            checked += s["checked"]
            if s["mismatched"]:
                mism += 1
                if len(examples) < 5:
                    examples.append(f"engine {idx} session {s['number']}: {s['mismatched']}/{s['checked']} differ")
            if ref is not None and s["finished"]:
                r = ref_crc.get((idx, s["number"]))
                if r is not None and r[0] == s["steps"]:
                    compared += 1
                    mine = s.get("tokens") or []
                    if len(mine) == len(r[2]) and mine:
                        same = sum(a == b for a, b in zip(mine, r[2], strict=True))
                        same_tokens += same
                        total_tokens += len(mine)
                        min_agree = min(same / len(mine), 1.0 if min_agree is None else min_agree)
                    if r[1] != s["draft_crc"]:
                        differ += 1
                        if len(examples) < 5:
                            examples.append(f"engine {idx} session {s['number']}: drafts differ from the reference")
    how = "in-process checksum expectation" if args.drafter == "checksum" else "second fault-free pass"
    return {
        "method": how,
        "sessions_touched": touched,
        "sessions_untouched": untouched,
        "untouched_entries_checked": checked,
        "untouched_sessions_mismatched": mism,
        "reference_sessions_compared": compared,
        "reference_sessions_differing": differ,
        "reference_token_agreement": round(same_tokens / total_tokens, 5) if total_tokens else None,
        "reference_min_session_agreement": None if min_agree is None else round(min_agree, 5),
        "reference_min_agreement": args.reference_min_agreement,
        "examples": examples,
    }


def _late_stacks(path: str, frames: int = 6) -> list[tuple[float, str]]:
    """The stack dumps an engine wrote for its calls still waiting at budget + 5 ms, per call t0.

    Each dump is cut to the innermost ``frames`` frames per thread, leaving out the import
    machinery's and threading's own frames; "Current thread" is the one that held the GIL then."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    out: list[tuple[float, str]] = []
    block: list[str] = []
    kept = 0
    for line in text.splitlines():
        if line.startswith("@@ call t0="):
            t0 = float(line.split()[2].split("=", 1)[1])
            out.append((t0, "\n".join(block)))
            block, kept = [], 0
        elif line.startswith(("Thread 0x", "Current thread 0x")):
            block.append(line.split(" (most recent")[0] + ":")
            kept = 0
        elif line.startswith("  File ") and kept < frames and "<frozen " not in line and "/threading.py" not in line:
            block.append(line.replace("  File ", "  ", 1))
            kept += 1
    return out


def _overrun_forensics(
    res: RunResult, all_calls: list[tuple[dict[str, Any], np.ndarray]], delays: np.ndarray
) -> dict[str, Any]:
    """Where the time of each call over the bound that run-queue wait and steal do not explain went.

    Per call the engine records its own on-CPU time, the on-CPU time of all its threads, its
    time in the cyclic GC, host-wide steal time and major page faults; the canary adds host
    stalls. The likely cause is the first of these that covers the unexplained part: steal (the
    hypervisor ran another guest), gc (the engine's own collector held the GIL), page faults,
    another thread of the engine on the CPU (held the GIL), a host stall the canary saw, or
    unknown. A cause here is evidence, not proof; the invariant itself subtracts only run-queue
    wait and the per-vCPU share of steal time.
    """
    rows: list[dict[str, Any]] = []
    off = 0
    for e, c in all_calls:
        cols = e["call_columns"]
        n = len(c)
        d = delays[off : off + n]
        off += n

        def col(name: str, c: np.ndarray = c, cols: list[str] = cols) -> np.ndarray:
            return c[:, cols.index(name)] if name in cols else np.full(len(c), np.nan)

        stacks = {float(t): text for t, text in e.get("late_stacks") or []}
        wait, budget = col("wait_ms"), col("budget_ms")
        rest = wait - budget - d
        for i in np.nonzero((wait - budget > SLACK_MS) & (rest > SLACK_MS))[0]:
            t0, w = float(col("t0")[i]), float(wait[i]) / 1000.0
            # the canary's stalls are [due, due + late]: the longest part of one inside the call
            stall = max([0.0, *(min(t0 + w, due + late) - max(t0, due) for due, late in res.host_stalls)])
            r = {
                "engine": e["spec"]["index"],
                "t_s": round(t0 - res.t_start, 3),
                "wait_ms": round(float(wait[i]), 2),
                "unexplained_ms": round(float(rest[i]), 2),
                "run_queue_and_steal_ms": round(float(d[i]), 2),
                "statuses": {k: int(col(k)[i]) for k in ("ok", "none", "expired", "overloaded") if col(k)[i] > 0},
                "cpu_ms": round(float(col("cpu_ms")[i]), 2),
                # threads that exit during a call take their counters along: clamp at 0
                "other_threads_cpu_ms": round(max(0.0, float(col("proc_cpu_ms")[i] - col("cpu_ms")[i])), 2),
                "gc_ms": round(float(col("gc_ms")[i]), 2),
                "steal_ms": round(float(col("steal_ms")[i]), 2),
                "majflt": float(col("majflt")[i]),
                "canary_stall_ms": round(stall * 1000.0, 2),
            }
            if (st := stacks.get(t0)) is not None:
                r["stacks_at_budget_plus_5ms"] = st
            need = float(rest[i])
            cause = "unknown"
            for name, v in (
                ("steal", r["steal_ms"]),
                ("gc", r["gc_ms"]),
                ("page faults", 1e9 if r["majflt"] > 0 else 0.0),
                ("another engine thread held the GIL", r["other_threads_cpu_ms"]),
                ("host stall (canary)", r["canary_stall_ms"]),
            ):
                if np.isfinite(v) and v >= need - SLACK_MS:
                    cause = name
                    break
            r["likely_cause"] = cause
            rows.append(r)
    by: dict[str, int] = {}
    for r in rows:
        by[r["likely_cause"]] = by.get(r["likely_cause"], 0) + 1
    rows.sort(key=lambda r: -r["unexplained_ms"])
    return {"by_cause": by, "calls": rows[:50]}


def analyze(args: argparse.Namespace, res: RunResult, ref: RunResult | None) -> dict[str, Any]:
    inv: dict[str, dict[str, Any]] = {}
    all_calls = [(e, _calls(e)) for e in res.engines]
    waits = np.concatenate([c[:, _col(e, "wait_ms")] for e, c in all_calls if len(c)] or [np.zeros(0)])
    budgets = np.concatenate([c[:, _col(e, "budget_ms")] for e, c in all_calls if len(c)] or [np.zeros(0)])
    over = waits - budgets
    worst = float(over.max()) if len(over) else 0.0

    # The client controls a call's wait except the time the host did not run the engine process:
    # (1) its threads sat runnable on the run queue (other processes had the CPUs; a preempted
    # GIL holder keeps the caller waiting too), read per call from /proc/self/task/*/schedstat;
    # (2) steal time, when the hypervisor ran another guest on our vCPUs (a thread that is
    # "running" in the guest then runs nowhere; schedstat cannot see it). Steal is read
    # host-wide from /proc/stat and summed over vCPUs, so the share counted for one call is the
    # mean over vCPUs: what any one vCPU lost. Both are the host's doing, not the client's.
    def _delay_col(e: dict[str, Any], c: np.ndarray) -> np.ndarray:
        cols = e["call_columns"]
        if "proc_run_delay_ms" in cols:  # every thread of the engine process (GIL holder included)
            return np.maximum(c[:, cols.index("proc_run_delay_ms")], c[:, cols.index("run_delay_ms")])
        return c[:, cols.index("run_delay_ms")] if "run_delay_ms" in cols else np.zeros(len(c))

    def _steal_col(e: dict[str, Any], c: np.ndarray) -> np.ndarray:
        cols = e["call_columns"]
        if "steal_ms" not in cols:
            return np.zeros(len(c))
        return c[:, cols.index("steal_ms")] / float(e.get("cpus") or os.cpu_count() or 1)

    delays = np.concatenate([_delay_col(e, c) for e, c in all_calls if len(c)] or [np.zeros(0)])
    steal = np.concatenate([_steal_col(e, c) for e, c in all_calls if len(c)] or [np.zeros(0)])
    if len(delays) != len(waits):
        delays = np.zeros(len(waits))
    if len(steal) != len(waits):
        steal = np.zeros(len(waits))
    stalls = res.host_stalls
    by_queue = by_steal = unexplained = 0
    worst_unexplained = 0.0
    for i in np.nonzero(over > SLACK_MS)[0]:
        if over[i] - delays[i] <= SLACK_MS:
            by_queue += 1
        elif over[i] - delays[i] - steal[i] <= SLACK_MS:
            by_steal += 1
        else:
            unexplained += 1
            worst_unexplained = max(worst_unexplained, float(over[i] - delays[i] - steal[i]))
    forensics = _overrun_forensics(res, all_calls, delays + steal)
    inv["wait_within_budget"] = {
        "ok": bool(len(waits) > 0 and unexplained == 0),
        "calls": len(waits),
        "calls_over": int((over > SLACK_MS).sum()),
        "calls_over_explained_by_run_queue_wait": by_queue,
        "calls_over_explained_by_steal": by_steal,
        "worst_over_budget_ms": round(worst, 3),
        "worst_unexplained_over_ms": round(worst_unexplained, 3),
        "max_wait_ms": round(float(waits.max()), 3) if len(waits) else None,
        "host_stalls_seen": len(stalls),
        "host_stall_max_ms": round(max((x[1] for x in stalls), default=0.0) * 1000, 2),
        "max_run_queue_wait_ms": round(float(delays.max()), 3) if len(delays) else None,
        "max_steal_share_ms": round(float(steal.max()), 3) if len(steal) else None,
        "rule": "wait - (run-queue wait of the engine process's threads + host steal time per vCPU, "
        "during the call) <= budget + 5 ms",
        "unexplained_by_likely_cause": forensics["by_cause"],
        "unexplained_calls": forensics["calls"],
    }

    def total(name: str) -> int:
        return int(sum(c[:, _col(e, name)].sum() for e, c in all_calls if len(c)))

    bad = total("bad_drafts")
    inv["drafts_valid"] = {"ok": bad == 0 and total("drafted") > 0, "invalid_replies": bad, "drafted": total("drafted")}
    resume = _resume(args, res)
    counted = [e for r in resume for e in r["engines"] if e["excluded"] is None]
    late = [e for e in counted if e["steps"] >= args.resume_steps]
    inv["resume_after_restart"] = {
        "ok": not late,
        "restarts": len(resume),
        "engine_restarts_counted": len(counted),
        "engine_restarts_excluded": sum(1 for r in resume for e in r["engines"] if e["excluded"] is not None),
        "max_steps_to_resume": max((e["steps"] for e in counted), default=None),
        "rule": f"drafts on one of the first {args.resume_steps} steps that start after READY",
        "late": late[:10],
    }
    live = res.end_sessions.get("live_at_end")
    inv["zero_sessions_at_end"] = {"ok": live == 0, **res.end_sessions}
    mem = _memory(args, res)
    rss_g = [i["rss_growth_mib"] for i in mem["incarnations"] if "rss_growth_mib" in i]
    gpu_g = [i["gpu_growth_mib"] for i in mem["incarnations"] if "gpu_growth_mib" in i]
    alloc_g = [i["gpu_allocated_growth_mib"] for i in mem["incarnations"] if "gpu_allocated_growth_mib" in i]
    inv["memory_flat"] = {
        "ok": all(g <= args.rss_tolerance_mib for g in rss_g)
        and all(g <= args.gpu_tolerance_mib for g in gpu_g + alloc_g),
        "checked": mem["checked"],
        "max_rss_growth_mib": max(rss_g, default=None),
        "rss_tolerance_mib": args.rss_tolerance_mib,
        "max_gpu_growth_mib": max(gpu_g, default=None),
        "max_gpu_allocated_growth_mib": max(alloc_g, default=None),
        "gpu_tolerance_mib": args.gpu_tolerance_mib,
    }
    refd = _reference(args, res, ref)
    ref_ok = refd["untouched_sessions_mismatched"] == 0 and refd["sessions_untouched"] > 0
    if args.drafter == "checksum":
        ref_ok = ref_ok and refd["untouched_entries_checked"] > 0
    if ref is not None:
        ref_ok = ref_ok and refd["reference_sessions_compared"] > 0
        if args.reference_min_agreement >= 1.0:  # exact: every compared session drafted the same tokens
            ref_ok = ref_ok and refd["reference_sessions_differing"] == 0
        else:  # a drafter whose numerics depend on the batch (bf16 on a GPU): token agreement floor
            agree = refd["reference_min_session_agreement"]
            ref_ok = ref_ok and agree is not None and agree >= args.reference_min_agreement
    inv["untouched_equal_reference"] = {"ok": ref_ok, **refd}
    errs = {}
    for i, m in res.last_metrics.items():
        e = m.get("draft_server_engine_errors_total", 0.0) + m.get("draft_server_io_errors_total", 0.0)
        if e:
            errs[str(i)] = e
    inv["server_healthy"] = {
        "ok": res.unexpected_exits == 0 and not errs,
        "unexpected_exits": res.unexpected_exits,
        "engine_or_io_errors_by_incarnation": errs,
    }
    broken = [e["spec"]["index"] for e in res.engines if e.get("error")]
    inv["engines_completed"] = {
        "ok": not broken and len(res.engines) == args.engines,
        "broken": broken,
        "errors": [e["error"][-2000:] for e in res.engines if e.get("error")],
    }
    counts: dict[str, int] = {}
    for ev in res.events:
        counts[ev.kind] = counts.get(ev.kind, 0) + 1
    if res.proxy:
        counts["drop"] = res.proxy.get("dropped_requests", 0) + res.proxy.get("dropped_replies", 0)
        counts["delay"] = res.proxy.get("delayed_requests", 0)
    if "slow" in args.modes:
        counts["slow"] = len(res.slow_events)
    if res.fuzz:
        counts["fuzz"] = res.fuzz.get("sent", 0)
    server_bad = 0.0
    for m in res.last_metrics.values():
        server_bad += sum(v for k, v in m.items() if k.startswith("draft_server_bad_messages_total{"))
        server_bad += m.get("draft_server_dropped_messages_total", 0.0)

    per_engine = []
    for e, c in all_calls:
        if not len(c):
            per_engine.append({"engine": e["spec"]["index"], "calls": 0, "error": bool(e.get("error"))})
            continue
        w = c[:, _col(e, "wait_ms")]
        per_engine.append(
            {
                "engine": e["spec"]["index"],
                "calls": len(c),
                "entries": int(c[:, _col(e, "entries")].sum()),
                "drafted_entries": int(c[:, _col(e, "drafted")].sum()),
                "fallback_entries": int((c[:, _col(e, "want")] - c[:, _col(e, "drafted")]).clip(0).sum()),
                "wait_ms_p50": round(_pct(w, 50) or 0, 3),
                "wait_ms_p99": round(_pct(w, 99) or 0, 3),
                "wait_ms_max": round(float(w.max()), 3),
                "epochs_seen": int(c[:, _col(e, "epoch_idx")].max()) + 1,
                "sessions": len(e.get("sessions") or []),
                "client": e.get("client_stats", {}),
            }
        )
    statuses = {k: total(k) for k in ("ok", "none", "expired", "overloaded", "bad_entry", "internal")}
    sess = [s for e in res.engines for s in _sessions(e)]
    return {
        "ok": all(v["ok"] for v in inv.values()),
        "invariants": inv,
        "totals": {
            "calls": len(waits),
            "entries": total("entries"),
            "drafted_entries": total("drafted"),
            "wanted_entries": total("want"),
            "statuses": statuses,
            "wait_ms_p50": _pct(waits, 50),
            "wait_ms_p99": _pct(waits, 99),
            "wait_ms_p999": _pct(waits, 99.9),
            "wait_ms_max": float(waits.max()) if len(waits) else None,
            "sessions": len(sess),
            "long_prefill_sessions": sum(s["long_prefill"] for s in sess),
            "k0_then_draft_checked": sum(s["k0_then_draft"] for s in sess),
            "server_incarnations": len(res.incarnations),
            "server_rejected_messages": server_bad,
        },
        "engines": per_engine,
        "chaos": {
            "modes": sorted(args.modes),
            "counts": counts,
            "events": [
                {
                    "kind": e.kind,
                    "t0": round(e.t0 - res.t_start, 3),
                    "t1": round(e.t1 - res.t_start, 3),
                    **_jsonable(e.detail),
                }
                for e in res.events
            ],
            "errors": res.chaos_errors,
            "proxy": {k: v for k, v in (res.proxy or {}).items() if k != "events"} or None,
            "fuzz": res.fuzz,
            "slow_iterations": len(res.slow_events),
        },
        "restarts": resume,
        "pauses": _resume(args, res, "pause"),
        "memory": mem,
        "server_tail": res.server_tail[-20:],
    }


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items() if k != "ready"}


# ------------------------------------------------------------------------------------ plots


def make_plots(args: argparse.Namespace, res: RunResult, out_dir: str, prefix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = res.t_start
    span = max(1.0, res.t_end - t0)
    bin_s = max(1.0, math.ceil(span / 400))
    edges = np.arange(0.0, span + bin_s, bin_s)
    rows = [(e, _calls(e)) for e in res.engines]
    rows = [(e, c) for e, c in rows if len(c)]
    files = []

    def shade(ax: Any) -> None:
        colors = {"kill": "red", "pause": "orange", "flood": "purple", "rogue": "gray", "vanish": "green"}
        for ev in res.events:
            ax.axvspan(
                ev.t0 - t0, max(ev.t1 - t0, ev.t0 - t0 + bin_s / 4), color=colors.get(ev.kind, "k"), alpha=0.2, lw=0
            )

    def save(fig: Any, name: str) -> None:
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=72)
        plt.close(fig)
        files.append(path)

    def binned(values: np.ndarray, ts: np.ndarray, fn: Any) -> np.ndarray:
        idx = np.digitize(ts, edges) - 1
        out = np.full(len(edges) - 1, np.nan)
        for b in range(len(out)):
            v = values[idx == b]
            if len(v):
                out[b] = fn(v)
        return out

    mid = (edges[:-1] + edges[1:]) / 2
    if rows:
        ts = np.concatenate([c[:, _col(e, "t0")] for e, c in rows]) - t0
        waits = np.concatenate([c[:, _col(e, "wait_ms")] for e, c in rows])
        fig, ax = plt.subplots(figsize=(9, 3.2))
        for q, style in ((50, "-"), (99, "-"), (100, ":")):
            ax.plot(
                mid,
                binned(waits, ts, lambda v, q=q: np.percentile(v, q)),
                style,
                lw=1,
                label=f"p{q}" if q < 100 else "max",
            )
        ax.axhline(args.budget_ms + SLACK_MS, color="r", lw=0.8, ls="--", label="budget + 5 ms")
        shade(ax)
        ax.set(xlabel="s", ylabel="step() wait, ms", title=f"wait per {bin_s:.0f} s bin (all engines)")
        ax.legend(fontsize=7, loc="upper right")
        save(fig, f"{prefix}_wait.png")

        drafted = np.concatenate([c[:, _col(e, "drafted")] for e, c in rows])
        fallback = np.concatenate([(c[:, _col(e, "want")] - c[:, _col(e, "drafted")]).clip(0) for e, c in rows])
        fig, ax = plt.subplots(figsize=(9, 3.2))
        ax.plot(mid, binned(drafted, ts, np.sum) / bin_s, lw=1, label="entries with drafts /s")
        ax.plot(mid, binned(fallback, ts, np.sum) / bin_s, lw=1, label="fallbacks (no drafts) /s")
        shade(ax)
        ax.set(xlabel="s", ylabel="entries / s", title="drafts vs fallbacks")
        ax.legend(fontsize=7, loc="upper right")
        save(fig, f"{prefix}_drafts.png")

        fig, ax = plt.subplots(figsize=(9, 2.8))
        for e, c in rows:
            ax.step(
                c[:, _col(e, "t0")] - t0,
                c[:, _col(e, "epoch_idx")],
                where="post",
                lw=1,
                label=f"engine {e['spec']['index']}",
            )
        for inc in res.incarnations[1:]:
            if inc.get("ready"):
                ax.axvline(inc["ready"] - t0, color="r", lw=0.5, alpha=0.5)
        ax.set(xlabel="s", ylabel="server epoch #", title="epochs seen by each engine (red: READY after a restart)")
        ax.legend(fontsize=7, loc="upper left")
        save(fig, f"{prefix}_epochs.png")

    s = res.samples
    if s:
        st = np.array([x[0] - t0 for x in s])
        fig, ax = plt.subplots(figsize=(9, 2.8))
        ax.plot(st, [np.nan if x[4] is None else x[4] for x in s], lw=1, color="C0", label="live sessions")
        ax.set_ylabel("live sessions", color="C0")
        ax2 = ax.twinx()
        ax2.plot(st, [np.nan if x[5] is None else x[5] for x in s], lw=0.6, color="C1", alpha=0.7)
        ax2.set_ylabel("queued rows", color="C1")
        shade(ax)
        ax.set(xlabel="s", title="server live sessions and queued rows (/metrics; gaps: paused or down)")
        save(fig, f"{prefix}_sessions.png")

        fig, ax = plt.subplots(figsize=(9, 2.8))
        ax.plot(st, [np.nan if x[2] is None else x[2] for x in s], lw=1, label="server RSS MiB")
        for col, label in ((3, "server GPU MiB (nvidia-smi)"), (6, "GPU allocated by tensors MiB")):
            if any(len(x) > col and x[col] is not None for x in s):
                ax.plot(st, [np.nan if len(x) <= col or x[col] is None else x[col] for x in s], lw=1, label=label)
        shade(ax)
        ax.set(xlabel="s", ylabel="MiB", title="server memory (per process; restarts reset it)")
        ax.legend(fontsize=7, loc="upper right")
        save(fig, f"{prefix}_memory.png")
    return files


# ------------------------------------------------------------------------------------ summary


def summary_text(report: dict[str, Any]) -> str:
    t = report["totals"]
    lines = [
        f"draft-soak: {report['config']['engines']} engines x {report['config']['sessions']} sessions, "
        f"{report['duration_s']:.0f} s, drafter {report['config']['drafter']}, "
        f"chaos {','.join(report['chaos']['modes']) or 'none'}",
        f"  calls {t['calls']}  entries {t['entries']}  drafted {t['drafted_entries']}/{t['wanted_entries']}  "
        f"sessions {t['sessions']}  server processes {t['server_incarnations']}",
        f"  wait ms p50 {t['wait_ms_p50'] or 0:.2f}  p99 {t['wait_ms_p99'] or 0:.2f}  "
        f"p99.9 {t['wait_ms_p999'] or 0:.2f}  max {t['wait_ms_max'] or 0:.2f}  "
        f"(budget {report['config']['budget_ms']} ms)",
        f"  statuses {t['statuses']}",
        f"  chaos {report['chaos']['counts']}",
    ]
    for key, what in (("restarts", "after READY"), ("pauses", "after SIGCONT")):
        ms = [e for r in report.get(key, []) for e in r["engines"] if e.get("steps") is not None]
        steps = [e["steps"] for e in ms if e["excluded"] is None]
        if steps:
            lines.append(
                f"  drafting back {what}: {len(steps)} measured ({len(ms) - len(steps)} excluded), "
                f"steps without drafts max {max(steps)}, median {float(np.median(steps)):.0f}"
            )
    w = report["invariants"]["wait_within_budget"]
    if w.get("unexplained_by_likely_cause"):
        causes = w["unexplained_by_likely_cause"]
        lines.append(f"  over budget + 5 ms, not run-queue wait or steal, by likely cause: {causes}")
    if report["chaos"]["errors"]:
        lines.append(f"  chaos errors: {report['chaos']['errors'][:3]}")
    lines.append("  invariants:")
    for name, v in report["invariants"].items():
        detail = {k: v[k] for k in list(v)[1:6] if not isinstance(v[k], list | dict)}
        lines.append(f"    {'PASS' if v['ok'] else 'FAIL'}  {name:28s} {detail}")
    lines.append(f"  result: {'OK' if report['ok'] else 'INVARIANT BROKEN'}; report {report['report_path']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="draft-soak",
        description="Soak a draft server with synthetic target engines under fault injection.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = ap.add_argument_group("run")
    g.add_argument("--duration-s", type=float, default=60.0, help="length of the chaos pass")
    g.add_argument("--engines", type=int, default=2, help="synthetic target engines (one process and client each)")
    g.add_argument("--sessions", type=int, default=16, help="concurrent sessions per engine")
    g.add_argument("--budget-ms", type=float, default=20.0, help="draft budget per step")
    g.add_argument("--step-ms", type=float, default=25.0, help="the target's own time per step (sleep between calls)")
    g.add_argument("--k", type=int, default=4, help="drafts per step")
    g.add_argument("--long-prefill-rows", type=int, default=2048, help="rows of the occasional long prompt")
    g.add_argument("--prefill-rows", default="16,128", help="LO,HI rows of an ordinary prompt")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", default="soak-out", help="directory for the JSON report and the PNG plots")
    g.add_argument("--report-name", default="soak.json", help="file name of the JSON report in --out")
    g.add_argument("--raw-dir", default="", help="keep the raw records of the run here (default: a temp dir)")
    g.add_argument("--from-raw", default="", help="analyse the raw records a run kept in --raw-dir again")
    g.add_argument("--warmup-s", type=float, default=3.0, help="no chaos before this")
    g.add_argument("--cooldown-s", type=float, default=3.0, help="no chaos in the last seconds")
    g.add_argument("--chaos-gap-s", type=float, default=1.0, help="least time between two discrete chaos events")
    g.add_argument("--sample-s", type=float, default=0.5, help="server sampling period (RSS, GPU, /metrics)")
    g.add_argument("--end-grace-s", type=float, default=10.0, help="extra wait beyond the TTL for zero sessions")
    g.add_argument("--reconnect-ivl-ms", type=int, default=10, help="engines' ZeroMQ reconnect interval")
    g.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run a second fault-free pass and compare drafts (default: on for models, off for checksum)",
    )
    g.add_argument(
        "--reference-min-agreement",
        type=float,
        default=1.0,
        help="1.0: untouched sessions must draft exactly what the reference pass drafted. Below 1: the share "
        "of each one's draft tokens that must agree, for drafters that are not batch-invariant (bf16 on a GPU)",
    )
    s = ap.add_argument_group("server (started and supervised by the soak)")
    s.add_argument("--drafter", default="checksum", choices=["checksum", "dspark"])
    s.add_argument("--model", default="", help="DSpark draft checkpoint (with --drafter dspark)")
    s.add_argument("--target-model", default="", help="target head checkpoint")
    s.add_argument("--device", default="", help="server --device")
    s.add_argument("--session-ttl-s", type=float, default=5.0)
    s.add_argument("--max-sessions", type=int, default=256)
    s.add_argument("--max-message-mib", type=int, default=8)
    s.add_argument("--server-arg", action="append", default=[], help="extra `draft-server serve` flag (repeatable)")
    at = ap.add_argument_group("attach to a running server instead")
    at.add_argument("--endpoint", default="", help="the server's endpoint; the soak starts no server")
    at.add_argument("--metrics-port", type=int, default=0, help="its /metrics port (0: no sampling of sessions)")
    at.add_argument("--server-pid", type=int, default=None, help="its pid: enables pause and RSS sampling")
    c = ap.add_argument_group("chaos")
    c.add_argument("--chaos", default="all", help=f"comma list of modes, 'all' or 'none': {','.join(ALL_MODES)}")
    c.add_argument("--kill-every-s", type=float, default=20.0)
    c.add_argument("--down-ms", type=float, default=200.0, help="time between SIGKILL and the restart")
    c.add_argument("--pause-every-s", type=float, default=15.0)
    c.add_argument("--pause-ms", type=float, default=700.0)
    c.add_argument("--drop-request-p", type=float, default=0.005)
    c.add_argument("--drop-reply-p", type=float, default=0.005)
    c.add_argument("--delay-p", type=float, default=0.005)
    c.add_argument("--delay-ms", type=float, default=60.0)
    c.add_argument("--slow-p", type=float, default=0.003)
    c.add_argument("--slow-ms", type=float, default=60.0)
    c.add_argument("--rogue-every-s", type=float, default=10.0)
    c.add_argument("--rogue-messages", type=int, default=300)
    c.add_argument("--vanish-every-s", type=float, default=10.0)
    c.add_argument("--vanish-sessions", type=int, default=8)
    c.add_argument("--flood-every-s", type=float, default=25.0)
    c.add_argument("--flood-sessions", type=int, default=0, help="0: --max-sessions + 64")
    c.add_argument("--fuzz-messages", type=int, default=5000, help="decoder fuzz messages over the run")
    i = ap.add_argument_group("invariants")
    i.add_argument("--resume-steps", type=int, default=2, help="drafting must be back within this many steps")
    i.add_argument("--rss-tolerance-mib", type=float, default=48.0, help="server RSS growth allowed after warm-up")
    i.add_argument("--gpu-tolerance-mib", type=float, default=256.0, help="server GPU memory growth allowed")
    i.add_argument("--mem-warmup-s", type=float, default=5.0, help="per server process, before the baseline")
    i.add_argument("--mem-window", type=int, default=5, help="samples averaged for the baseline and the end")
    return ap


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    with contextlib.suppress(Exception):
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    with contextlib.suppress(Exception):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(Exception):
            info["gpus"] = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                )
                .stdout.strip()
                .splitlines()
            )
    return info


def _save_result(res: RunResult, path: str) -> None:
    with open(path, "w") as f:
        json.dump(asdict(res), f, default=str)


def _load_result(path: str) -> RunResult:
    with open(path) as f:
        d = json.load(f)
    d["events"] = [ChaosEvent(**e) for e in d["events"]]
    d["last_metrics"] = {int(k): v for k, v in d["last_metrics"].items()}
    d["host_stalls"] = [tuple(x) for x in d["host_stalls"]]
    return RunResult(**d)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    modes = [] if args.chaos == "none" else list(ALL_MODES) if args.chaos == "all" else args.chaos.split(",")
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        print(f"draft-soak: unknown chaos modes {unknown} (known: {', '.join(ALL_MODES)})", file=sys.stderr)
        return 2
    if args.endpoint:
        dropped = [m for m in modes if m in ("kill", "slow") or (m == "pause" and args.server_pid is None)]
        if dropped:
            print(f"draft-soak: attached to {args.endpoint}: chaos {dropped} disabled (needs a supervised server)")
            modes = [m for m in modes if m not in dropped]
    if args.drafter == "dspark" and not args.model and not args.endpoint:
        print("draft-soak: --drafter dspark needs --model", file=sys.stderr)
        return 2
    args.modes = modes

    def _terminate(*_: object) -> None:
        raise KeyboardInterrupt  # unwinds through run_pass's cleanup (engines, proxy, server)

    signal.signal(signal.SIGTERM, _terminate)
    reference = args.reference if args.reference is not None else args.drafter != "checksum"
    os.makedirs(args.out, exist_ok=True)
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    machine = _machine()  # before the run: the git commit the run started from
    with contextlib.ExitStack() as stack:
        work = args.raw_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="draft-soak-"))
        os.makedirs(work, exist_ok=True)
        try:
            if args.from_raw:  # analyse a kept run again (report and plots only)
                kept = os.path.join(args.from_raw, "run.json")
                if os.path.exists(kept):  # when, where and from which commit the run was made
                    with open(kept) as f:
                        run = json.load(f)
                    machine, started = run["machine"], run["started_utc"]
                res = _load_result(os.path.join(args.from_raw, "result-1.json"))
                ref_path = os.path.join(args.from_raw, "result-0.json")
                ref = _load_result(ref_path) if os.path.exists(ref_path) else None
            else:
                with open(os.path.join(work, "argv.json"), "w") as f:
                    json.dump(argv, f)
                with open(os.path.join(work, "run.json"), "w") as f:
                    json.dump({"machine": machine, "started_utc": started}, f)
                res = run_pass(args, work, chaos=True)
                _save_result(res, os.path.join(work, "result-1.json"))
                ref = None
                if reference:
                    steps = [int(e.get("steps") or 0) for e in res.engines]
                    ref = run_pass(args, work, chaos=False, max_steps=steps)
                    _save_result(ref, os.path.join(work, "result-0.json"))
        except (RuntimeError, OSError) as e:
            print(f"draft-soak: could not run: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("draft-soak: interrupted; everything it started is stopped", file=sys.stderr)
            return 130
    report = analyze(args, res, ref)
    report_path = os.path.join(args.out, args.report_name)
    cfg = {k: v for k, v in vars(args).items()}
    command = "draft-soak " + " ".join(argv)
    original = os.path.join(args.from_raw, "argv.json") if args.from_raw else ""
    if original and os.path.exists(original):
        with open(original) as f:
            command = "draft-soak " + " ".join(json.load(f))
    report = {
        "tool": "draft-soak",
        "command": command,
        "analysed_with": ("draft-soak " + " ".join(argv)) if args.from_raw else None,
        "started_utc": started,
        "duration_s": round(res.t_end - res.t_start, 2),
        "machine": machine,
        "config": cfg,
        "report_path": report_path,
        **report,
    }
    report["plots"] = [
        os.path.basename(p) for p in make_plots(args, res, args.out, os.path.splitext(args.report_name)[0])
    ]
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(summary_text(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
