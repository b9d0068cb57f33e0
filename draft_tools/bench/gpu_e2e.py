"""End to end on a GPU: full-size K3 DSpark (random weights) behind the RPC vs in process.

For 1, 4, 16, 64 sessions (256 context rows each, then decode steps of 3 committed rows and
k = 7 drafts), measure in one run:
* remote: DraftClient.step() against `draft-server serve --model random:k3` on the GPU —
  the client's wait and the server's own compute time per step;
* local: the same model in this process (ingest + draft, CUDA-synchronised) — what an
  in-engine drafter would spend.
The difference is the price of the hop. Writes JSON and prints a table.
    python3 -m draft_tools.bench.gpu_e2e --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

from draft_tools.common import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from draft_tools.synthetic import bf16_normal  # noqa: E402
from target_client import ClientConfig, DraftClient, StepRequest  # noqa: E402

SESSIONS = (1, 4, 16, 64)
CTX = 256
ROWS = 3
STEPS = 40


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def p99(xs: list[float]) -> float:
    return round(float(np.percentile(xs, 99)), 3)


def remote(endpoint: str, n: int, rng: np.random.Generator) -> dict:
    c = DraftClient(ClientConfig(endpoint=endpoint, budget_ms=5000.0, name=f"bench{n}"))
    w = c.connect(wait=True)
    assert w is not None
    k, width = w.contract.block_size, w.contract.tap_width
    sids = [f"n{n}-s{i}" for i in range(n)]
    for sid in sids:  # prefill, one session per step
        r = c.step([StepRequest(sid, 0, CTX, 1, 0)], bf16_normal(rng, (CTX, width)))
        assert r[0].status is not None and r[0].status.name == "OK", r[0]
    end = CTX
    waits, compute, server = [], [], []
    for it in range(STEPS + 5):
        reqs = [StepRequest(sid, end, ROWS, int(rng.integers(0, w.contract.vocab_size)), k) for sid in sids]
        taps = bf16_normal(rng, (n * ROWS, width))
        t = time.perf_counter()
        out = c.step(reqs, taps)
        wait = (time.perf_counter() - t) * 1000
        assert all(len(o.tokens) == k for o in out), [o.status for o in out]
        end += ROWS
        if it >= 5:
            waits.append(wait)
            compute.append(c.last_timing.compute_ms)
            server.append(c.last_timing.server_ms)
    c.free(sids)
    c.close()
    return {
        "wait_ms_p50": med(waits),
        "wait_ms_p99": p99(waits),
        "server_ms_p50": med(server),
        "compute_ms_p50": med(compute),
        "hop_ms_p50": med([a - b for a, b in zip(waits, compute, strict=True)]),
    }


def local(n: int, rng: np.random.Generator) -> dict:
    import torch

    from draft_server.drafters.base import DraftItem, IngestItem
    from draft_server.models import load_preset
    from protocol import GREEDY

    d = local.drafter if hasattr(local, "drafter") else load_preset("k3", "cuda", "bf16", 16 << 30)
    local.drafter = d
    c = d.contract
    keys = list(range(n))
    for key in keys:
        assert d.reserve(key, 0, CTX + ROWS * (STEPS + 5) + 8)
        d.ingest([IngestItem(key, 0, 0, bf16_normal(rng, (CTX, c.tap_width)))])
    end = CTX
    steps = []
    for it in range(STEPS + 5):
        taps = [bf16_normal(rng, (ROWS, c.tap_width)) for _ in keys]
        torch.cuda.synchronize()
        t = time.perf_counter()
        d.ingest([IngestItem(key, 0, end, taps[i]) for i, key in enumerate(keys)])
        d.draft([DraftItem(key, 0, end + ROWS, 7, c.block_size, GREEDY) for key in keys])
        torch.cuda.synchronize()
        end += ROWS
        if it >= 5:
            steps.append((time.perf_counter() - t) * 1000)
    for key in keys:
        d.release(key)
    return {"step_ms_p50": med(steps), "step_ms_p99": p99(steps)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/gpu_e2e.json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    port = free_port()
    ep = f"tcp://127.0.0.1:{port}"
    srv = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "draft_server",
            "serve",
            "--model",
            "random:k3",
            "--device",
            "cuda",
            "--kv-budget-mib",
            "16384",
            "--bind",
            ep,
            "--metrics-port",
            "-1",
            "--log-level",
            "WARNING",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert srv.stdout is not None
    line = srv.stdout.readline()
    assert line.startswith("READY"), line
    rows = []
    try:
        for n in SESSIONS:
            rows.append({"sessions": n, "remote": remote(ep, n, rng)})
    finally:
        srv.kill()
        srv.wait()
    for r in rows:
        r["local"] = local(r["sessions"], rng)
        rm, lc = r["remote"], r["local"]
        print(
            f"B={r['sessions']:3d}  local step p50 {lc['step_ms_p50']:7.2f} ms | "
            f"remote wait p50 {rm['wait_ms_p50']:7.2f} p99 {rm['wait_ms_p99']:7.2f} | "
            f"server compute {rm['compute_ms_p50']:7.2f} | hop {rm['hop_ms_p50']:6.2f} ms",
            flush=True,
        )
    import torch

    out = {
        "benchmark": "gpu_e2e",
        "command": "python3 -m draft_tools.bench.gpu_e2e --out " + args.out,
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "model": "random:k3 (Kimi-K3 DSpark dims, bf16, eager)",
        "context_rows": CTX,
        "rows_per_step": ROWS,
        "steps": STEPS,
        "results": rows,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
