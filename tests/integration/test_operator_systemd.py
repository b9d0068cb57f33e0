"""What a supervisor sees: sd_notify READY and WATCHDOG pings (systemd Type=notify, WatchdogSec),
the watchdog exit that waits for one scrape, and model loading that says what it loaded."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from draft_server import app
from draft_server.config import ServerConfig
from protocol import StepEntry
from tests.conftest import ROOT, RawPeer, ServerProc, random_taps, wait_for


class NotifySocket:
    """A fake $NOTIFY_SOCKET: the unix datagram socket systemd listens on."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.got: list[tuple[float, str]] = []

    def drain(self, seconds: float) -> list[str]:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                self.got.append((time.monotonic(), self.sock.recv(4096).decode()))
            except TimeoutError:
                pass
        return [m for _, m in self.got]

    def close(self) -> None:
        self.sock.close()


def start_notified(tmp_path: Path, *extra: str, watchdog_usec: int = 200_000) -> tuple[ServerProc, NotifySocket]:
    ns = NotifySocket(tmp_path / "notify.sock")
    env = {"NOTIFY_SOCKET": ns.path, "WATCHDOG_USEC": str(watchdog_usec)}
    srv = ServerProc("--log-level", "INFO", *extra)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # ServerProc inherits the environment
    try:
        srv.start()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return srv, ns


def test_ready_and_watchdog_pings_arrive(tmp_path: Path) -> None:
    srv, ns = start_notified(tmp_path)
    try:
        msgs = ns.drain(1.0)
        ready = [m for m in msgs if "READY=1" in m]
        assert len(ready) == 1 and f"MAINPID={srv.pid}" in ready[0] and "STATUS=serving" in ready[0]
        pings = [t for t, m in ns.got if m == "WATCHDOG=1"]
        assert len(pings) >= 5, msgs  # every 0.1 s (half of WATCHDOG_USEC)
        srv.stop()
        assert any("STOPPING=1" in m for m in ns.drain(0.3))
    finally:
        srv.kill()
        ns.close()


def test_no_watchdog_pings_while_the_engine_overruns(tmp_path: Path) -> None:
    batch_s = 3.0
    srv, ns = start_notified(tmp_path, "--checksum-delay-ms", str(int(batch_s * 1000)), "--watchdog-s", "0.3")
    peer = RawPeer(srv.endpoint)
    try:
        ns.drain(0.5)
        t0 = time.monotonic()
        peer.step([StepEntry("w", 0, 1, 1, 1)], random_taps(np.random.default_rng(1), 1), timeout_ms=1)
        assert wait_for(lambda: srv.healthz()[0] == 503, 10)  # the watchdog saw the overrun (0.3 s in)
        ns.drain(0.1)  # pings sent before it, read (and stamped) now
        quiet_from = time.monotonic()
        quiet_to = min(quiet_from + 1.0, t0 + batch_s - 0.05)  # the batch ends no earlier than t0 + batch_s
        assert quiet_to - quiet_from > 0.5, "the overrun was seen too late to test the silence"
        ns.drain(quiet_to - quiet_from)
        silent = [t for t, m in ns.got if m == "WATCHDOG=1" and t > quiet_from]
        assert silent == [], "pinged systemd while the engine was hung"
        ns.drain(max(0.0, t0 + batch_s - time.monotonic()) + 1.0)  # the batch ended: healthy, pings resume
        assert any(m == "WATCHDOG=1" and t > t0 + batch_s for t, m in ns.got)
    finally:
        peer.close()
        srv.kill()
        ns.close()


def test_watchdog_exit_waits_for_a_scrape_then_exits_3(tmp_path: Path) -> None:
    srv = ServerProc("--checksum-delay-ms", "5000", "--watchdog-s", "0.3", "--watchdog-exit").start()
    peer = RawPeer(srv.endpoint)
    try:
        peer.step([StepEntry("w", 0, 1, 1, 1)], random_taps(np.random.default_rng(1), 1), timeout_ms=1)

        def fired_and_seen() -> bool:
            assert srv.proc is not None and srv.proc.poll() is None  # it holds its exit until a scrape saw it
            text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read().decode()
            return "draft_server_watchdog_fired_total 1.0" in text and "draft_server_healthy 0.0" in text

        assert wait_for(fired_and_seen, 10)  # fired (0.3 s into the 5 s batch), and this scrape saw it
        assert srv.proc is not None and srv.proc.wait(5) == 3
    finally:
        peer.close()
        srv.kill()


def test_sd_notify_is_a_no_op_outside_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert app.sd_notify("READY=1") is False
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert app.sd_watchdog_interval() == 0.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert app.sd_watchdog_interval() == 15.0


def test_loading_reports_progress_then_what_it_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from draft_server.models.tiny import make_tiny

    monkeypatch.setattr(app, "LOAD_PROGRESS_S", 0.05)
    real = app.build_drafter

    def slow(cfg: ServerConfig):  # a load long enough for progress lines
        time.sleep(0.3)
        return real(cfg)

    monkeypatch.setattr(app, "build_drafter", slow)
    paths = make_tiny("qwen3", str(tmp_path / "tiny"))
    cfg = ServerConfig(model=paths.draft, target_model=paths.target, device="cpu", kv_budget_mib=4)
    with caplog.at_level(logging.INFO, logger="draft_server"):
        drafter = app.load_with_progress(cfg)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(f"loading {paths.draft} (safetensors, ") and "on device cpu" in lines[0]
    assert any(m.startswith(f"loading {paths.draft}: ") and m.endswith(" s") for m in lines[1:-1])
    final = lines[-1]
    assert final.startswith(f"loaded {paths.draft} (safetensors")
    for part in (
        "device cpu",
        "dtype float32",
        "weights ",
        "KV cache 4.0 MiB",
        f"({drafter.capacity_tokens()} tokens)",
    ):
        assert part in final, (part, final)


def test_device_auto_on_cpu_says_so(tmp_path: Path) -> None:
    """`device=auto` with no usable GPU starts on the CPU, but never silently."""
    code = (
        "import logging, sys; from draft_server import app; "
        "logging.basicConfig(level='INFO', stream=sys.stderr); app.check_device('auto')"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert res.returncode == 0, res.stderr
    assert "device auto: no CUDA GPU usable by torch" in res.stderr and "drafting on the CPU" in res.stderr
