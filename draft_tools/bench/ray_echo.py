"""A Ray Serve deployment handle echo: the last peer issue 12 measures our Step against (>= 20x at B=1).

Ray is heavy (hundreds of MB, its own pins of fastapi, pydantic, grpcio) and need not share the
project's environment: the measurement runs in a child process under any Python that has
``ray[serve]`` (``--ray-python``; by default this interpreter), with nothing of this project
imported there. The parent writes each payload (a Step's frames joined into one ``bytes``, as
gRPC's echo sends them) to a file; the child starts Ray (no dashboard, no HTTP proxy), deploys one
replica that answers every call with a 64-byte reply (as small as ours), and times
``handle.remote(payload).result()`` from the driver: the path a Python target engine calling a
Ray Serve drafter would take.

    python draft_tools/bench/ray_echo.py --measure PAYLOAD_FILE... --iters N   (prints one JSON line)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

REPLY = b"\0" * 64


def available(python: str = sys.executable) -> bool:
    """Whether ``python`` can import ``ray.serve``."""
    try:
        r = subprocess.run([python, "-c", "import ray.serve"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def echo_ms(payloads: Sequence[bytes], iters: int, python: str = sys.executable, timeout_s: float = 600.0) -> dict:
    """Median ms of one handle call per payload (after 20 untimed), each payload in its own run of
    ``iters`` calls, from one Ray instance; with Ray's version and the child's start-up seconds."""
    with tempfile.TemporaryDirectory(prefix="ray-echo-") as tmp:
        files = []
        for i, p in enumerate(payloads):
            path = os.path.join(tmp, f"payload{i}")
            with open(path, "wb") as f:
                f.write(p)
            files.append(path)
        r = subprocess.run(
            [python, os.path.abspath(__file__), "--measure", *files, "--iters", str(iters)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"ray echo failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def _measure(files: Sequence[str], iters: int) -> dict[str, Any]:
    """In the child: Ray up, one echo replica, each payload timed through its deployment handle."""
    import statistics
    import time

    import ray
    from ray import serve

    t0 = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    serve.start(http_options={"location": "NoServer"})

    @serve.deployment(num_replicas=1, max_ongoing_requests=16)
    class Echo:
        async def __call__(self, data: bytes) -> bytes:  # async: Ray Serve runs it on the replica's event loop
            return REPLY

    handle = serve.run(Echo.bind(), name="echo", route_prefix=None)
    started = time.perf_counter() - t0
    out: dict[str, Any] = {"ray": ray.__version__, "startup_s": round(started, 2), "ms": []}
    try:
        for path in files:
            with open(path, "rb") as f:
                data = f.read()
            for _ in range(20):
                assert handle.remote(data).result() == REPLY
            ts = []
            for _ in range(iters):
                t = time.perf_counter()
                handle.remote(data).result()
                ts.append((time.perf_counter() - t) * 1000)
            out["ms"].append(round(statistics.median(ts), 4))
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] != "--measure" or "--iters" not in args:
        sys.exit(__doc__)
    i = args.index("--iters")
    print(json.dumps(_measure(args[1:i], int(args[i + 1]))), flush=True)
