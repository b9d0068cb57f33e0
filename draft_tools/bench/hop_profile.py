"""Where a remote K3 step's time goes: client wait, server compute and each thread's Python.

Starts ``draft-server`` on ``random:k3`` (this GPU), drives it with one ``DraftClient`` at
1 and 64 sessions (256 context rows, 3 new rows + 7 drafts per session, bf16 taps over tcp), and
writes the medians. Run it under ``py-spy record --subprocesses -f raw`` to
see which thread holds the GIL when (the JSON names the raw file if one is given).

    py-spy record --subprocesses -r 1000 -f raw -o OUT.txt -- \\
        python3 -m draft_tools.bench.hop_profile --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

NEW_ROWS, K, CTX = 3, 7, 256


def bf16_rows(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    return (rng.standard_normal((rows, width), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def main() -> int:
    from draft_tools.common import free_port
    from target_client import ClientConfig, DraftClient, StepRequest

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "draft_server", "serve", "--model", "random:k3", "--device", "cuda"]
    cmd += ["--kv-budget-mib", "16384", "--max-batch-sessions", "64", "--bind", f"tcp://127.0.0.1:{port}"]
    cmd += ["--metrics-port", "-1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: dict[str, Any] = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY"):
                break
        else:
            raise RuntimeError("draft-server exited before READY")
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        client = DraftClient(ClientConfig(endpoint=f"tcp://127.0.0.1:{port}", budget_ms=3000.0))
        w = client.connect(wait=True)
        assert w is not None
        W = w.contract.tap_width
        rng = np.random.default_rng(3)
        pool = [bf16_rows(rng, 64 * NEW_ROWS, W) for _ in range(4)]
        for n in (1, 64):
            sids = [f"s{n}-{i}" for i in range(n)]
            for i0 in range(0, n, 16):
                part = sids[i0 : i0 + 16]
                client.step([StepRequest(sid, 0, CTX, 1, 0) for sid in part], bf16_rows(rng, CTX * len(part), W))
            pos, waits, comp, server = CTX, [], [], []
            for it in range(args.steps):
                reqs = [StepRequest(sid, pos, NEW_ROWS, 5, K) for sid in sids]
                t1 = time.perf_counter()
                reps = client.step(reqs, pool[it % 4][: n * NEW_ROWS])
                waits.append((time.perf_counter() - t1) * 1e3)
                assert all(len(r.tokens) == K for r in reps), [r.status for r in reps][:3]
                tm = client.last_timing
                comp.append(tm.compute_ms)
                server.append(tm.server_ms)
                pos += NEW_ROWS
            row = {
                "client_wait_ms": statistics.median(waits[5:]),
                "server_ms": statistics.median(server[5:]),
                "server_compute_ms": statistics.median(comp[5:]),
            }
            row["overhead_ms"] = row["client_wait_ms"] - row["server_compute_ms"]
            out[str(n)] = row
            print(f"B={n}: {json.dumps({k: round(v, 3) for k, v in row.items()})}", flush=True)
            client.free(sids)
        client.close()
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
