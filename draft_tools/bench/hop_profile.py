"""Server compute against the in-process step, with the receive arena on and off (issue 10/12).

The remote half of ``draft_step_gpu`` (``server_vs_inprocess``: ``draft-server`` on ``random:k3``
on this GPU, one ``DraftClient`` at 1 and 64 sessions, 256 context rows, 3 new rows + 7 drafts
per session, bf16 taps over tcp) beside the same step in this process, one JSON:

1. in process, 256 context rows, B = 1 and 64: rows in ordinary memory (staged: one host copy
   into pinned memory, then to the device) and rows already in registered memory (the path of
   the shm ring and of the server's receive arena); the drafter is freed before the servers start;
2. the server with its receive arena (``--arena-mib``, default size: tap frames land in
   registered memory) and without it (``--arena-mib 0``: frames staged as before): client wait,
   server compute (the reply's timing), and server compute / in-process step per B, plus the
   server's arena counters (frames into the arena, fallbacks).

``--tiny`` runs all of it on the CPU with a tiny random K3-shaped checkpoint (no GPU: checks
the script end to end; its numbers say nothing about a GPU). Under ``py-spy record
--subprocesses -f raw`` it shows which thread holds the GIL when:

    python3 -m draft_tools.bench.hop_profile --out bench/results/hop_profile_arena_h200.json
    py-spy record --subprocesses -r 1000 -f raw -o OUT.txt -- \\
        python3 -m draft_tools.bench.hop_profile --out OUT.json --arena on
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from draft_tools.bench.draft_step_gpu import K3_SERVER, NEW_ROWS, Sessions, bf16_rows, log, server_vs_inprocess, timed

CTX = 256  # context rows per session, as server_vs_inprocess prefills
SIZES = (1, 64)


def inprocess(d: Any, steps: int) -> dict[str, dict[str, float]]:
    """The step in process at B = 1 and 64: rows staged from ordinary memory, and rows in a
    registered host buffer (``register_host``; absent where the drafter cannot register)."""
    rng = np.random.default_rng(3)
    S = Sessions(d, rng, 0)
    n_max = max(SIZES)
    keys = S.open(n_max, CTX)
    W = d.contract.tap_width
    buf = bytearray(n_max * NEW_ROWS * W * 2)
    registered = d.register_host(memoryview(buf))
    slab = np.frombuffer(buf, dtype=np.uint16).reshape(n_max, NEW_ROWS, W)
    slab[:] = bf16_rows(rng, n_max * NEW_ROWS, W).reshape(n_max, NEW_ROWS, W)
    plain = slab.copy()  # the same rows in ordinary memory: the staged path
    out: dict[str, dict[str, float]] = {}
    for n in SIZES:
        row: dict[str, float] = {}
        for name, rows in (("step_ms", plain), ("registered_step_ms", slab)):
            if rows is slab and not registered:
                continue
            S.rewind(keys[:n], CTX)
            S.host_ingest_ms.clear()
            row[name] = timed(lambda n=n, rows=rows: S.step(keys[:n], rows[:n]), steps)["median_ms"]
            row[name.replace("step_ms", "host_ingest_ms")] = statistics.median(S.host_ingest_ms)
        out[str(n)] = row
        log(f"in process B={n}: {json.dumps({k: round(v, 3) for k, v in row.items()})}")
    if registered:
        d.unregister_host(memoryview(buf))
    S.close(keys)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per batch size (remote: the first 5 dropped)")
    ap.add_argument(
        "--arena",
        choices=("both", "on", "off"),
        default="both",
        help="servers to run: with the receive arena (its default size), without (--arena-mib 0), or both",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU, a tiny random checkpoint: checks the script, no GPU")
    args = ap.parse_args()
    out: dict[str, Any] = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    tmp = tempfile.TemporaryDirectory(prefix="hop-profile-")
    import torch

    from draft_server.models import load_drafter, load_preset
    from draft_server.models.tiny import make_tiny

    if args.tiny:
        paths = make_tiny("k3", tmp.name, seed=0)
        server_args: tuple[str, ...] = ("--model", paths.draft, "--target-model", paths.target, "--device", "cpu")
        server_args += ("--dtype", "float32", "--kv-budget-mib", "256")
        d = load_drafter(paths.draft, paths.target, "cpu", "float32", 256 << 20)
    else:
        server_args = K3_SERVER
        d = load_preset("k3", "cuda", "auto", 16384 << 20)
        out["gpu"] = torch.cuda.get_device_name()
    d.prepare(64, 4096)  # as the server prepares (--max-batch-sessions 64, --max-batch-rows 4096)
    out["inprocess"] = ip = inprocess(d, args.steps)
    d.close()
    del d
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    staged = {n: r["step_ms"] for n, r in ip.items()}
    runs = {"on": (), "off": ("--arena-mib", "0")}
    for name in ("on", "off") if args.arena == "both" else (args.arena,):
        log(f"server, receive arena {name}")
        res = server_vs_inprocess(staged, steps=args.steps, server_args=(*server_args, *runs[name]))
        for n, r in ip.items():
            if n in res and "registered_step_ms" in r:
                res[n]["inprocess_registered_ms"] = r["registered_step_ms"]
                res[n]["server_over_inprocess_registered"] = res[n]["server_compute_ms"] / r["registered_step_ms"]
        out[f"server_arena_{name}"] = res
    summary = []
    for n in ip:
        line = f"B={n}: in process {ip[n]['step_ms']:.2f} ms"
        if "registered_step_ms" in ip[n]:
            line += f" (rows registered {ip[n]['registered_step_ms']:.2f})"
        for name in ("on", "off"):
            r = out.get(f"server_arena_{name}", {}).get(n)
            if r:
                line += f"; server compute, arena {name}: {r['server_compute_ms']:.2f} ms"
                line += f" ({r['server_over_inprocess']:.2f}x), client wait {r['client_wait_ms']:.2f} ms"
        summary.append(line)
        log(line)
    out["summary"] = summary
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
