"""Small helpers every tool shares: a free loopback port, a /metrics scrape, a served subprocess,
a served subprocess's READY, a median timing, a report written."""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import IO, Any

_PORTS_HANDED: set[int] = set()
_PORTS_LOCK = threading.Lock()


def _ephemeral_low() -> int:
    """The lowest port the kernel may give an outgoing connection (``ip_local_port_range``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback TCP port nobody holds, for a server started next to bind.

    Picked below the kernel's ephemeral range: a port from ``bind(("", 0))`` comes from that range,
    so between this call and the server's bind any outgoing connection (a ZeroMQ connect, a scrape)
    may take it as its local port, and the server then fails with "in use" (CI saw it once in ~900
    starts). Ports are not handed out twice by one process; a random pick keeps processes apart.
    """
    low = _ephemeral_low()
    first = max(10000, low - 12000)
    if low - first < 1000:  # an unusual range: fall back to the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    pick = random.Random(int.from_bytes(os.urandom(8), "little"))
    with _PORTS_LOCK:
        if len(_PORTS_HANDED) > (low - first) // 2:
            _PORTS_HANDED.clear()
        for _ in range(1000):
            port = pick.randrange(first, low)
            if port in _PORTS_HANDED:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _PORTS_HANDED.add(port)
            return port
    raise RuntimeError(f"no free loopback port in {first}..{low - 1}")


def scrape(port: int, timeout: float = 5.0) -> dict[str, float]:
    """Every sample of /metrics keyed as Prometheus writes it: ``name{label="v",...}`` (labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def label_values(metrics: dict[str, float], name: str, label: str) -> dict[str, float]:
    """{label value: sample} of one labelled family in a ``scrape`` result."""
    prefix, key = name + "{", f'{label}="'
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if k.startswith(prefix) and key in k:
            out[k.split(key, 1)[1].split('"', 1)[0]] = v
    return out


def spawn_ready(cmd: list[str], **popen: Any) -> subprocess.Popen:
    """``cmd`` in a child process (stdin a pipe unless ``popen`` says otherwise), returned once it printed
    its READY line; what it prints after that is read and dropped. RuntimeError if it exits before."""
    popen.setdefault("stdin", subprocess.PIPE)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, **popen)
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith("READY"):
            threading.Thread(target=p.stdout.read, daemon=True).start()
            return p
    raise RuntimeError(f"{' '.join(cmd[2:4])} exited before READY")


def median_ms(fn: Callable[[], Any], iters: int, warmup: int = 10) -> float:
    """Median wall ms of ``fn()`` over ``iters`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1000)
    return statistics.median(ts)


def start_server(
    extra: list[str], module: str = "draft_server", also_bind: str = "", log_file: str = ""
) -> tuple[subprocess.Popen, str, int]:
    """``python -m MODULE serve`` on free loopback ports (and ``also_bind``, e.g. an ``ipc://`` path);
    waits for its READY line (120 s at most). Returns the process, the tcp endpoint, the metrics port.
    ``log_file``: the server logs at INFO, everything it prints after READY written there."""
    port, mport = free_port(), free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    bind = f"{endpoint},{also_bind}" if also_bind else endpoint
    cmd = [sys.executable, "-m", module, "serve", "--bind", bind, "--metrics-port", str(mport)]
    cmd += ["--log-level", "INFO" if log_file else "WARNING", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("READY"):
            threading.Thread(target=_drain, args=(proc.stdout, log_file), daemon=True).start()
            return proc, endpoint, mport
        print("  server:", line.rstrip())
    proc.kill()
    raise SystemExit("draft server did not start")


def _drain(stream: IO[str], log_file: str) -> None:
    """Keep reading the server's output (a full pipe would block it), into ``log_file`` if named."""
    if not log_file:
        stream.read()
        return
    with open(log_file, "a") as f:
        for line in stream:
            f.write(line)
            f.flush()


def stop_server(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def write_report(path: str, report: Any) -> None:
    """A benchmark's JSON at ``path`` (its folder made), and the line that says where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
