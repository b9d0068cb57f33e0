"""A step's rows from the target's taps into the shm ring: copied in, or written in place, side by side.

The client side of transport shm at K3 size (5 x 7168 bf16 = 71.7 KB per row), B sessions x 3 rows
per step, B = 1..64, each way timed in the same process and the same rounds (interleaved):

* ``copy``: the vLLM proposer's encoder (``target_client.vllm.wire.WireEncoder``) makes the rows in
  fresh host memory (from a GPU: a device-to-host copy into ``PinnedRows``), then the client's I/O
  thread copies them into a ring region (``ClientRing.put``): what the shm transport did before;
* ``in_place``: the encoder writes them straight into a region it claims (``ClientRing.claim``; from
  a GPU, the ring page-locked once), and the I/O thread sends them where they lie
  (``ClientRing.in_place``): one copy from the taps to the server's view;
* ``floor``: one copy of the same bytes (torch's ``copy_``), the least either way can do: into the
  ring's memory from host taps, or device to host into page-locked memory from a GPU.

No server and no socket: the hop's other costs are measured by ``early_taps_gpu`` and
``cuda_ipc``. Writes JSON (machine, command, numbers) and prints a table::

    python -m draft_tools.bench.ring_rows --out bench/results/ring_rows_cpu.json
    python3 -m draft_tools.bench.ring_rows --device cuda --out bench/results/ring_rows_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from target_client.client.ring import ClientRing
from target_client.vllm.wire import PinnedRows, WireEncoder, pin_cuda

K3_TAP_WIDTH = 5 * 7168
ROWS_PER_SESSION = 3


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(b: int, dev: torch.device, ring: ClientRing, rounds: int) -> dict[str, Any]:
    taps = torch.randn(b * ROWS_PER_SESSION, K3_TAP_WIDTH, device=dev).to(torch.bfloat16)
    nbytes = taps.numel() * 2
    host_enc = WireEncoder("bf16", pinned_mib=512 if dev.type == "cuda" else 0)
    ring_enc = WireEncoder("bf16")
    floor_dst = (
        PinnedRows(nbytes * 4)._slab[:nbytes].view(torch.bfloat16).view(taps.shape)
        if dev.type == "cuda"
        else torch.from_numpy(np.frombuffer(ring._mm, np.uint8, nbytes, ring.size - nbytes))
        .view(torch.bfloat16)
        .view(taps.shape)
    )

    def copy_way() -> None:
        rows = host_enc(taps)
        at = ring.put([rows])
        assert at is not None, "the ring is too small for the step"
        ring.cancel(at.generation)

    def in_place_way() -> None:
        rows = ring_enc(taps, claim=ring.claim)
        at = ring.in_place(rows)
        assert at is not None, "the ring gave no region"
        ring.cancel(at.generation)

    def floor_way() -> None:
        floor_dst.copy_(taps, non_blocking=dev.type == "cuda")
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    ways: dict[str, Callable[[], None]] = {"copy": copy_way, "in_place": in_place_way, "floor": floor_way}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(rounds + 3):
        for name, fn in ways.items():
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if r >= 3:  # warm-up rounds: allocations, page-locking, first touches
                times[name].append(dt)
    out: dict[str, Any] = {"B": b, "rows": b * ROWS_PER_SESSION, "mib": round(nbytes / 2**20, 3)}
    for name, ts in times.items():
        med = float(np.median(ts))
        out[f"{name}_ms_p50"] = round(med * 1e3, 4)
        out[f"{name}_ms_p90"] = round(float(np.percentile(ts, 90)) * 1e3, 4)
        out[f"{name}_gb_s"] = round(nbytes / med / 1e9, 2)
    out["speedup"] = round(out["copy_ms_p50"] / out["in_place_ms_p50"], 2)
    out["in_place_over_floor"] = round(out["in_place_ms_p50"] / out["floor_ms_p50"], 2)
    out["claimed"] = ring_enc.claimed
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--device", default="cpu", help="where the taps live: cpu, or cuda (the target's GPU)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default="bench/results/ring_rows_cpu.json")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    ring = ClientRing(256 << 20)
    machine: dict[str, Any] = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if dev.type == "cuda":
        from draft_tools.bench.draft_step_gpu import gpu_machine

        machine.update(gpu_machine(dev))
        ring.claim(1, pin_cuda)  # page-lock the ring now (once), as the first claim of a GPU client does
        assert ring.pin_error is None, ring.pin_error
    rows = []
    try:
        print(f"{'B':>3} {'MiB':>7} {'copy ms':>9} {'in place':>9} {'floor':>9} {'speedup':>8} {'/floor':>7}")
        for b in (int(x) for x in a.batches.split(",")):
            r = measure(b, dev, ring, a.rounds)
            rows.append(r)
            print(
                f"{b:3d} {r['mib']:7.2f} {r['copy_ms_p50']:9.3f} {r['in_place_ms_p50']:9.3f} "
                f"{r['floor_ms_p50']:9.3f} {r['speedup']:7.2f}x {r['in_place_over_floor']:6.2f}x",
                flush=True,
            )
    finally:
        ring.close()
    report = {
        "command": "python -m draft_tools.bench.ring_rows " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine,
        "setup": {"tap_width": K3_TAP_WIDTH, "rows_per_session": ROWS_PER_SESSION, "rounds": a.rounds},
        "rows": rows,
    }
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
