"""One soak pass: the server, the engine processes, the proxy, the chaos schedule and the samplers.

``run_pass`` starts everything, lets it run for the configured duration and returns the raw
``RunResult`` (per-engine call tables, server incarnations, chaos events, samples).
"""

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from draft_tools.common import free_port, scrape
from draft_tools.soak.engine import EngineSpec, engine_main
from draft_tools.soak.supervisor import AttachedServer, ServerSupervisor

SLACK_MS = 5.0
ALL_MODES = (
    "kill", "pause", "drop", "delay", "slow", "rogue", "vanish", "flood", "fuzz",
    # noisy neighbours: clients that hurt others without breaking the protocol
    "sflood", "rflood", "nan", "hijack", "stale",
)  # fmt: skip
# Named explicitly only ("all" keeps the single message): early taps, engines send taps then commits
# and the proxy drops some of both (one server: a FleetClient sends the single message).
EXTRA_MODES = ("taps",)
TOUCHING = ("kill", "pause", "flood")  # windows that can change a session's drafts without a failed call


def _try_scrape(port: int, timeout: float = 0.5) -> dict[str, float] | None:
    """The server's /metrics, or None when it does not answer in time."""
    try:
        return scrape(port, timeout)
    except Exception:
        return None


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
    """Every ``period_s``: server RSS, GPU memory of the server pid, live sessions and queue from /metrics.

    One per server of the soak; ``index`` is that server's number among them."""

    def __init__(self, server: Any, metrics_port: int, period_s: float, index: int = 0) -> None:
        super().__init__(name=f"soak-sampler-{index}", daemon=True)
        self.server, self.metrics_port, self.period_s, self.index = server, metrics_port, period_s, index
        # [t, incarnation, rss_mib, gpu_mib (nvidia-smi), sessions, queue_rows, gpu_allocated_mib,
        #  gpu_reserved_mib, server]; the incarnation is this server's until ``merge_servers`` renumbers it
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
            m = _try_scrape(self.metrics_port) if self.metrics_port > 0 else None
            sessions = queue = alloc = reserved = None
            if m is not None:
                self.last_metrics[inc] = m
                sessions = m.get("draft_server_sessions")
                queue = m.get("draft_server_queue_rows")
                if "draft_server_gpu_memory_allocated_bytes" in m:
                    alloc = m["draft_server_gpu_memory_allocated_bytes"] / 2**20
                    reserved = m["draft_server_gpu_memory_reserved_bytes"] / 2**20
            self.samples.append([t, inc, rss, gpu, sessions, queue, alloc, reserved, self.index])


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
    """Runs the discrete chaos modes one at a time, each on its own seeded period. With several
    servers each event picks one of them (seeded; ``detail["server"]``)."""

    def __init__(
        self, args: argparse.Namespace, servers: list[Any], endpoints: list[str], t_start: float, t_stop: float
    ) -> None:
        super().__init__(name="soak-chaos", daemon=True)
        self.args, self.servers, self.endpoints = args, servers, endpoints
        self.server, self.endpoint = servers[0], endpoints[0]  # the target of the event being fired
        self.t_start, self.t_stop = t_start, t_stop
        self.events: list[ChaosEvent] = []
        self.errors: list[str] = []
        self.stop_evt = threading.Event()
        self.rng = np.random.default_rng([args.seed, 99])
        self.server_rng = np.random.default_rng([args.seed, 98])  # which server an event hits
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
            "sflood": a.neighbour_every_s,
            "rflood": a.neighbour_every_s,
            "nan": a.neighbour_every_s,
            "hijack": a.neighbour_every_s,
            "stale": a.neighbour_every_s,
        }
        return {k: v for k, v in p.items() if k in modes and v > 0}

    def run(self) -> None:
        periods = self._periods()
        if not periods:
            return
        first = self.t_start + self.args.warmup_s
        # staggered first firings so that modes do not bunch up at the start
        spread = min(5.0, 30.0 / len(periods))  # every mode fires once within the first ~30 s
        due = {k: first + (i + self.rng.random()) * min(v, spread) for i, (k, v) in enumerate(sorted(periods.items()))}
        fired: set[str] = set()
        while not self.stop_evt.is_set():
            kind = min(due, key=due.__getitem__)
            # a mode that never fired goes before another one's repeat once both are due: every
            # mode fires at least once even when the repeats of the frequent ones fill the run
            waiting = [k for k in due if k not in fired and due[k] <= time.monotonic()]
            if waiting and kind in fired:
                kind = min(waiting, key=due.__getitem__)
            wait = due[kind] - time.monotonic()
            if wait > 0:
                if self.stop_evt.wait(min(wait, 0.2)):
                    return
                continue
            if time.monotonic() >= self.t_stop:
                return
            fired.add(kind)
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
        which = int(self.server_rng.integers(0, len(self.servers)))
        self.server, self.endpoint = self.servers[which], self.endpoints[which]
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
            from draft_tools.chaos.rogue import malformed_burst, oversized

            detail = malformed_burst(self.endpoint, a.rogue_messages, int(self.rng.integers(1 << 30)), self.width)
            detail.update(oversized(self.endpoint, a.max_message_mib << 20, self.limits, self.width))
        elif kind == "vanish":
            from draft_tools.chaos.rogue import vanish

            detail = vanish(self.endpoint, a.vanish_sessions)
        elif kind == "flood":
            from draft_tools.chaos.rogue import flood

            detail = flood(self.endpoint, a.flood_sessions or a.max_sessions + 64)
        elif kind == "sflood":
            from draft_tools.chaos.rogue import session_flood

            detail = session_flood(self.endpoint, 2 * a.max_sessions)
        elif kind == "rflood":
            from draft_tools.chaos.rogue import row_flood

            detail = row_flood(self.endpoint, steps=16, rows=a.rflood_rows)
        elif kind == "nan":
            from draft_tools.chaos.rogue import nan_taps

            detail = nan_taps(self.endpoint, 8)
        elif kind == "hijack":
            from draft_tools.chaos.rogue import hijack

            victim = int(self.rng.integers(0, a.engines))  # the soak engines' routing ids are soak-e<i>
            detail = hijack(self.endpoint, f"soak-e{victim}".encode(), f"e{victim}-s", 64)
            detail["victim"] = victim
        elif kind == "stale":
            from draft_tools.chaos.rogue import stale_storm

            detail = stale_storm(self.endpoint, 20)
        if len(self.servers) > 1:
            detail["server"] = which
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
    slow_events_by_server: list[list[float]] = field(default_factory=list)  # slow_events, per server
    ring_names_left: list[str] = field(default_factory=list)  # /dev/shm rings of the engines left after them


def _rings_of(pids: set[int]) -> list[str]:
    """The shared-memory ring names in /dev/shm that processes ``pids`` made (``protocol.shm``: a
    client unlinks its ring's name once the server mapped it, and when it closes)."""
    from protocol.shm import PREFIX, SHM_DIR

    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(PREFIX) and n[len(PREFIX) :].split("-")[0] in {str(p) for p in pids})


def _server_cmd(args: argparse.Namespace, port: int, mport: int, chaos: bool) -> list[str]:
    slow = chaos and "slow" in args.modes  # the real server with its drafter wrapped in SlowDrafter
    cmd = [
        sys.executable,
        "-m",
        "draft_tools.chaos.serve" if slow else "draft_server",
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
    if slow:
        cmd += ["--slow-p", str(args.slow_p), "--slow-ms", str(args.slow_ms)]
    return cmd + list(args.server_arg)


def _wait_proc(p: mp.process.BaseProcess, timeout: float) -> None:
    p.join(timeout)
    if p.is_alive():
        p.terminate()
        p.join(5)
    if p.is_alive():
        p.kill()
        p.join(5)


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


def run_proxies(cfgs: list[Any], stats_path: str, ready: Any = None) -> None:
    """Process entry: one ChaosProxy per server (threads of one process, so that a fleet soak adds
    one process, not one per server) until SIGTERM; then their stats, summed, to ``stats_path``."""
    import signal

    from draft_tools.chaos.proxy import ChaosProxy

    proxies = [ChaosProxy(c) for c in cfgs]
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: [p.stop() for p in proxies])
    threads = [threading.Thread(target=p.run, name=f"soak-proxy-{i}", daemon=True) for i, p in enumerate(proxies)]
    for t in threads:
        t.start()
    if ready is not None:
        ready.set()
    try:
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(0.2)
    finally:
        stats: dict[str, Any] = {}
        for i, p in enumerate(proxies):
            d = p.stats.as_dict()
            d["events"] = [[*e, i] for e in d["events"]]  # (t, kind, routing id, server)
            for k, v in d.items():
                stats[k] = stats.get(k, [] if isinstance(v, list) else 0) + v
        stats["events"] = sorted(stats.get("events", []))
        tmp = stats_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(stats, f)
        os.replace(tmp, stats_path)


def _merge_servers(servers: list[Any], samplers: list[Sampler]) -> dict[str, Any]:
    """The servers' incarnations, samples and last scrapes in one numbering (server 0's first, ...).

    Each incarnation dict gets its ``server``; samples and last scrapes are renumbered to match."""
    offset, incarnations, samples, last = 0, [], [], {}
    for i, srv in enumerate(servers):
        for inc in srv.incarnations:
            inc.setdefault("server", i)
            incarnations.append(inc)
        for smp in samplers[i].samples if i < len(samplers) else []:
            samples.append([smp[0], smp[1] + offset, *smp[2:]])
        for k, m in (samplers[i].last_metrics if i < len(samplers) else {}).items():
            last[k + offset] = m
        offset += len(srv.incarnations)
    samples.sort(key=lambda x: x[0])
    tail = [f"[server {i}] {line}" if len(servers) > 1 else line for i, srv in enumerate(servers) for line in srv.tail]
    return {
        "incarnations": incarnations,
        "samples": samples,
        "last_metrics": last,
        "slow_events": sorted(t for srv in servers for t in srv.slow_events),
        "slow_events_by_server": [list(srv.slow_events) for srv in servers],
        "unexpected_exits": sum(srv.unexpected_exits for srv in servers),
        "server_tail": tail,
    }


def run_pass(args: argparse.Namespace, workdir: str, chaos: bool, max_steps: list[int] | None = None) -> RunResult:
    """One soak pass: servers, proxy, rogues, engines, chaos; everything cleaned up on the way out.

    With ``--servers N`` (N > 1) N supervised servers run side by side and every engine's client
    is a FleetClient over all of them (through the proxy when drop/delay is on); each discrete
    chaos event picks one server."""
    ctx = mp.get_context("spawn")
    modes = set(args.modes) if chaos else set()
    attached = bool(args.endpoint)
    servers: list[Any] = []
    endpoints: list[str] = []
    mports: list[int] = []
    if attached:
        servers.append(AttachedServer(args.server_pid))
        endpoints.append(args.endpoint)
        mports.append(args.metrics_port)
    else:
        for _ in range(max(1, getattr(args, "servers", 1))):
            port, mport = free_port(), free_port()
            servers.append(ServerSupervisor(_server_cmd(args, port, mport, chaos)))
            endpoints.append(f"tcp://127.0.0.1:{port}")
            mports.append(mport)
    endpoint = endpoints[0]
    procs: list[mp.process.BaseProcess] = []
    proxy_proc = fuzz_proc = None
    proxy_stats_path = os.path.join(workdir, f"proxy-{int(chaos)}.json")
    fuzz_stats_path = os.path.join(workdir, f"fuzz-{int(chaos)}.json")
    samplers: list[Sampler] = []
    scheduler = None
    canary_stop = ctx.Event()
    canary_path = os.path.join(workdir, f"canary-{int(chaos)}.json")
    canary = ctx.Process(target=run_canary, args=(canary_stop, canary_path), name="soak-canary")
    canary.start()
    engines_out: list[dict[str, Any]] = []
    end_sessions: dict[str, Any] = {}
    try:
        if not attached:
            for srv in servers:
                srv.start()
        from draft_tools.chaos.rogue import Peer

        welcome = None
        for ep in endpoints:
            peer = Peer(ep, "soak-probe")
            try:
                welcome = peer.hello(timeout_s=30.0)
            finally:
                peer.close()
            if welcome is None:
                raise RuntimeError(f"no Welcome from the draft server at {ep}")
        assert welcome is not None
        width = welcome.contract.tap_width
        engine_endpoints = list(endpoints)
        if modes & {"drop", "delay", "taps"}:
            from draft_tools.chaos.proxy import ProxyConfig

            pcfgs = [
                ProxyConfig(
                    frontend=f"tcp://127.0.0.1:{free_port()}",
                    backend=ep,
                    drop_request_p=args.drop_request_p if "drop" in modes else 0.0,
                    drop_reply_p=args.drop_reply_p if "drop" in modes else 0.0,
                    delay_p=args.delay_p if "delay" in modes else 0.0,
                    delay_ms=args.delay_ms,
                    seed=args.seed + 1000 * i,
                    phases=("taps", "commit"),
                    phase_drop_p=args.taps_drop_p if "taps" in modes else 0.0,
                )
                for i, ep in enumerate(endpoints)
            ]
            ready = ctx.Event()
            proxy_proc = ctx.Process(target=run_proxies, args=(pcfgs, proxy_stats_path, ready), name="soak-proxy")
            proxy_proc.start()
            if not ready.wait(30):
                raise RuntimeError("chaos proxy did not start")
            engine_endpoints = [c.frontend for c in pcfgs]
        for i, (srv, mport) in enumerate(zip(servers, mports, strict=True)):
            samplers.append(Sampler(srv, mport, args.sample_s, i))
            samplers[-1].start()
        stop, go = ctx.Event(), ctx.Event()
        readies = []
        specs = []
        for i in range(args.engines):
            spec = EngineSpec(
                index=i,
                endpoint=",".join(engine_endpoints),
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
                transport=args.transport,
                early_taps="taps" in args.modes,  # in the fault-free pass too: the same drafts
                mispredict_p=0.25 if "taps" in args.modes else -1.0,  # predicted commits, a quarter wrong
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
            from draft_tools.chaos.rogue import run_fuzz

            rate = args.fuzz_messages / max(1.0, duration - args.cooldown_s - args.warmup_s)
            fuzz_proc = ctx.Process(
                target=run_fuzz,
                args=(endpoint, args.fuzz_messages, rate, args.seed + 7, width, fuzz_stats_path),
                name="soak-fuzz",
            )
            fuzz_proc.start()
        if modes:
            scheduler = ChaosScheduler(args, servers, endpoints, t_start, t_stop_chaos)
            scheduler.limits = welcome.limits
            scheduler.width = width
            scheduler.start()
        # supervise until the duration is over (or, for a reference pass, the engines are done)
        while time.monotonic() < t_start + duration:
            for srv in servers:
                if not srv.check_alive():
                    with contextlib.suppress(RuntimeError):
                        srv.start()  # keep the soak going; the unexpected exit is reported
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
        rings_left = _rings_of({p.pid for p in procs if p.pid is not None})
        # every engine freed its sessions; vanished clients' sessions age out by TTL
        deadline = time.monotonic() + args.session_ttl_s + args.end_grace_s
        live = None
        while time.monotonic() < deadline:
            counts = []
            for mport in mports:
                m = _try_scrape(mport, timeout=2.0) if mport > 0 else None
                counts.append(m.get("draft_server_sessions") if m else None)
            live = None if None in counts else sum(counts)  # type: ignore[arg-type]
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
        for sampler in samplers:
            sampler.stop_evt.set()
            sampler.join(10)
        canary_stop.set()
        _wait_proc(canary, 10)
        for srv in servers:
            srv.stop()

    def _load(path: str) -> dict[str, Any] | None:
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    merged = _merge_servers(servers, samplers)
    return RunResult(
        engines=engines_out,
        events=scheduler.events if scheduler else [],
        chaos_errors=scheduler.errors if scheduler else [],
        samples=merged["samples"],
        incarnations=merged["incarnations"],
        slow_events=merged["slow_events"],
        proxy=_load(proxy_stats_path) if proxy_proc is not None else None,
        fuzz=_load(fuzz_stats_path) if fuzz_proc is not None else None,
        last_metrics=merged["last_metrics"],
        end_sessions=end_sessions,
        unexpected_exits=merged["unexpected_exits"],
        t_start=t_start,
        t_end=t_end,
        server_tail=merged["server_tail"],
        host_stalls=[tuple(x) for x in (_load(canary_path) or [])],  # type: ignore[misc]
        slow_events_by_server=merged["slow_events_by_server"],
        ring_names_left=rings_left,
    )
