"""The supervised draft server of a soak: a subprocess started, killed, paused and resumed on fixed
ports (``ServerSupervisor``), or a running server it only attaches to (``AttachedServer``)."""

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections import deque
from typing import Any

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
