"""Transport cuda_ipc against tcp, ipc and shm, and against its own floor, side by side in one run.

A ``draft-server`` with ``random:k3`` (full-size Kimi-K3 DSpark dims, random weights) runs on
``--peer-device`` (default: the producer's own GPU), bound to tcp and ipc at once. This process is
the producer (a target engine) on ``--device``: per step B sessions x 3 rows of K3 taps (5 x 7168
bf16 = 71.7 KB per row, 13.8 MB at B = 64) that live on its GPU, as a target's taps do, and k =
block_size drafts wanted. For every B (default 1, 2, 4, ..., 64), in the same run:

* **product**, per transport, ``DraftClient.step``: ``tcp`` and ``ipc`` (rows in the Step's frame)
  and ``shm`` (ipc + the shared-memory ring) take host rows, so the device-to-host copy a target
  needs first is timed apart (``prep``); ``cuda_ipc`` (ipc + the CUDA IPC buffer) takes the device
  rows themselves and copies them device to device. Reported: the client's wait, the server's
  compute (``Timing.compute_ms``), overhead = wait - compute (p50, p99), and prep, two ways each
  step: ``prep`` into a fresh pageable tensor (``.cpu()``), ``prep_pinned`` into page-locked memory
  (``target_client.vllm.wire.PinnedRows``, what the vLLM plugin does; these rows are the ones sent).
* **floor**: the same bytes through the same CUDA IPC primitives without the protocol, server or
  scheduler: the producer copies them into its exported buffer (``target_client.cuda.ipc.CudaRing``)
  and sends a small message over a ZeroMQ ipc socket; a second process on the server's GPU
  (``draft_server.io.cuda_ipc.TorchImporter``) waits on the buffer's event, copies the bytes device
  to device into its own memory (a peer copy when the GPUs differ), synchronizes and answers.
  cuda_ipc's overhead minus this is what the protocol and server cost on top of the hop itself.

Works with both processes on one GPU (``--peer-device`` = ``--device``, the default) and across two.
Writes JSON (machine, command, numbers) and prints a table::

    python3 -m draft_tools.bench.cuda_ipc --out bench/results/cuda_ipc_h200.json [--peer-device 1]
    python -m draft_tools.bench.cuda_ipc --plot bench/results/cuda_ipc_h200.json --out cuda_ipc_h200.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import msgspec
import numpy as np
import zmq

from draft_tools.common import free_port, write_report
from target_client.vllm.wire import PinnedRows

ROWS = 3
SESSIONS = (1, 2, 4, 8, 16, 32, 64)
TRANSPORTS = ("tcp", "ipc", "shm", "cuda_ipc")
MIB = 1 << 20


def pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(xs), q)), 4)


# ------------------------------------------------------------------------------ the floor


def serve_floor(endpoint: str, device: int) -> None:
    """The floor's server side: import the producer's buffer, then per message wait on the region's
    event, copy it device to device, synchronize, answer (64 bytes)."""
    import torch

    from draft_server.io.cuda_ipc import TorchImporter
    from protocol import CudaIpcAnnounce, RowsAt, TensorSpec
    from protocol.messages import DType

    torch.cuda.set_device(device)
    imp = TorchImporter(torch.device("cuda", device))
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    print("READY", flush=True)
    handle: Any = None
    reply = b"\0" * 64
    while True:
        ident, msg = sock.recv_multipart()
        if msg[:1] == b"A":
            handle = imp.open(msgspec.msgpack.decode(msg[1:], type=CudaIpcAnnounce))
            sock.send_multipart([ident, b"ok"])
            continue
        at = msgspec.msgpack.decode(msg[1:], type=RowsAt)
        _rows, done = imp.copy(handle, at, TensorSpec(DType.U8, (at.nbytes,), -1))
        done.synchronize()
        sock.send_multipart([ident, reply])


def floor_rtt(endpoint: str, device: int, n: int, width: int, iters: int, warmup: int) -> dict[str, float]:
    """Round trips of the floor (see the module docstring) for n sessions x ROWS rows."""
    import torch

    from protocol import RingAck
    from target_client.cuda.ipc import CudaRing, record_ready

    ring = CudaRing(device, 64 * MIB)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(b"A" + msgspec.msgpack.encode(ring.announce))
        assert sock.recv() == b"ok"
        ring.confirm()
        taps = torch.randn(n * ROWS, width, device=f"cuda:{device}").to(torch.bfloat16)
        ts = []
        for _ in range(warmup + iters):
            t = time.perf_counter()
            at = ring.put([taps], record_ready(taps))
            assert at is not None
            sock.send(b"R" + msgspec.msgpack.encode(at))
            sock.recv()
            ts.append((time.perf_counter() - t) * 1000)
            ring.ack(RingAck(ring.name, at.generation, ()))  # copied and synchronized there
        ts = ts[warmup:]
        return {"p50_ms": pct(ts, 50), "p99_ms": pct(ts, 99)}
    finally:
        sock.close()
        ring.close()


# ------------------------------------------------------------------------------ the product


def product(
    endpoint: str, transport: str, n: int, device: int, iters: int, warmup: int, width: int, k: int
) -> dict[str, Any]:
    import torch
    from prometheus_client import CollectorRegistry

    from target_client import ClientConfig, DraftClient, StepRequest

    reg = CollectorRegistry()
    mode = "frames" if transport in ("tcp", "ipc") else transport
    cfg = ClientConfig(
        endpoint=endpoint,
        budget_ms=3000.0,
        name=f"bench-{transport}-{n}",
        transport=mode,
        shm_ring_mib=64,
        cuda_ipc_mib=64,
        cuda_device=device,
        registry=reg,
    )
    client = DraftClient(cfg)
    client.connect(wait=True)
    taps_dev = torch.randn(n * ROWS, width, device=f"cuda:{device}").to(torch.bfloat16)
    # every step overwrites positions [0, ROWS): context stays small, so compute stays flat
    reqs = [StepRequest(f"{transport}-{n}-{i}", 0, ROWS, 1, k) for i in range(n)]
    pinned = PinnedRows(256 << 20)
    waits, compute, server, prep, prep_pinned = [], [], [], [], []
    try:
        for it in range(warmup + iters):
            t0 = time.perf_counter()
            if transport == "cuda_ipc":
                taps: Any = taps_dev  # stays on the GPU
            else:  # the device-to-host copy a target needs before a host transport, both ways
                taps_dev.view(torch.int16).cpu().numpy().view(np.uint16)
                t0p = time.perf_counter()
                taps = pinned.host_rows(taps_dev)
                if it >= warmup:
                    prep_pinned.append((time.perf_counter() - t0p) * 1000)
                    prep.append((t0p - t0) * 1000)
            t1 = time.perf_counter()
            replies = client.step(reqs, taps)
            t2 = time.perf_counter()
            assert all(len(r.tokens) == k for r in replies), [(r.status, r.message) for r in replies]
            timing = client.last_timing
            assert timing is not None
            del taps  # the client alone holds host rows now (PinnedRows reuses them once it lets go)
            if it >= warmup:
                waits.append((t2 - t1) * 1000)
                compute.append(timing.compute_ms)
                server.append(timing.server_ms)
        over = [w - c for w, c in zip(waits, compute, strict=True)]
        out = {
            "wait_p50_ms": pct(waits, 50),
            "wait_p99_ms": pct(waits, 99),
            "compute_p50_ms": pct(compute, 50),
            "server_p50_ms": pct(server, 50),
            "overhead_p50_ms": pct(over, 50),
            "overhead_p99_ms": pct(over, 99),
        }
        if prep:
            out |= {"prep_p50_ms": pct(prep, 50), "prep_pinned_p50_ms": pct(prep_pinned, 50)}
            out["pinned_steps"], out["pinned_fallbacks"] = pinned.taken, pinned.fallbacks
        if transport == "shm":
            out["steps_in_ring"] = reg.get_sample_value("draft_client_shm_steps_total")
        if transport == "cuda_ipc":
            out["steps_in_buffer"] = reg.get_sample_value("draft_client_cuda_ipc_steps_total")
            out["fallbacks"] = reg.get_sample_value("draft_client_cuda_ipc_fallbacks_total", {"reason": "buffer_full"})
        return out
    finally:
        client.free([r.session for r in reqs])
        client.close()


# ------------------------------------------------------------------------------ main


def _spawn(cmd: list[str]) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout is not None
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("READY"):
            threading.Thread(target=p.stdout.read, daemon=True).start()
            return p
    raise RuntimeError(f"{' '.join(cmd[:5])} exited before READY:\n" + "".join(lines[-20:]))


def _machine(device: int, peer: int) -> dict[str, Any]:
    import torch

    m: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "producer_gpu": f"cuda:{device} {torch.cuda.get_device_name(device)}",
        "server_gpu": f"cuda:{peer} {torch.cuda.get_device_name(peer)}",
        "peer_access": device == peer or torch.cuda.can_device_access_peer(device, peer),
    }
    try:
        m["nvidia_smi_topo"] = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return m


def plot(report: dict[str, Any], out: str) -> None:
    """Client-observed overhead (wait - compute, p50) against sessions per transport, beside the floor
    (the same bytes through the same CUDA IPC primitives) and the floor + 0.05 ms (issue 18's bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    b = [r["sessions"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for t in ("tcp", "ipc", "shm", "cuda_ipc"):
        if all(t in r for r in rows):
            ax.plot(b, [r[t]["overhead_p50_ms"] for r in rows], "o-", label=f"{t}: wait - compute")
    floor = [r["floor"]["p50_ms"] for r in rows]
    ax.plot(b, floor, "k--", label="floor: CUDA IPC copy + pipe round trip")
    ax.plot(b, [f + 0.05 for f in floor], "k:", label="floor + 0.05 ms")
    m = report["machine"]
    same = m.get("producer_gpu", "").split()[0] == m.get("server_gpu", "").split()[0]
    where = "producer and server on one GPU" if same else "producer and server on two GPUs"
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"sessions per step ({report['settings']['rows_per_session']} rows of K3 taps each)")
    ax.set_ylabel("ms, p50")
    ax.set_title(f"{report['settings']['model']}: the hop per transport ({where})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--out", default="bench/results/cuda_ipc.json", help="JSON file for the results")
    ap.add_argument("--device", type=int, default=0, help="the producer's GPU (this process)")
    ap.add_argument("--peer-device", type=int, default=None, help="the server's GPU (default: --device)")
    ap.add_argument("--iters", type=int, default=200, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--sessions", default=",".join(map(str, SESSIONS)), help="values of B, comma-separated")
    ap.add_argument("--transports", default=",".join(TRANSPORTS), help="from tcp, ipc, shm, cuda_ipc")
    ap.add_argument("--model", default="random:k3", help="the server's --model")
    ap.add_argument("--kv-budget-mib", type=int, default=8192, help="the server's KV (leaves room on a shared GPU)")
    ap.add_argument("--server-args", default="", help="more draft-server flags")
    ap.add_argument("--floor-server", help=argparse.SUPPRESS)
    ap.add_argument("--plot", default="", metavar="JSON", help="only plot this report into --out (a .png; matplotlib)")
    args = ap.parse_args(argv)
    if args.plot:
        plot(json.load(open(args.plot)), args.out)
        return 0
    peer = args.device if args.peer_device is None else args.peer_device
    if args.floor_server:
        serve_floor(args.floor_server, peer)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("draft_tools.bench.cuda_ipc: needs CUDA (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    torch.cuda.set_device(args.device)
    sessions = [int(s) for s in args.sessions.split(",") if s.strip()]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    tmp = tempfile.mkdtemp(prefix="bench-cuda-ipc-")
    ep_tcp, ep_ipc, ep_floor = f"tcp://127.0.0.1:{free_port()}", f"ipc://{tmp}/srv.sock", f"ipc://{tmp}/floor.sock"
    endpoints = {"tcp": ep_tcp, "ipc": ep_ipc, "shm": ep_ipc, "cuda_ipc": ep_ipc}
    procs: list[subprocess.Popen] = []
    t_start = time.time()
    try:
        server = [sys.executable, "-m", "draft_server", "serve", "--bind", f"{ep_tcp},{ep_ipc}", "--metrics-port", "-1"]
        server += ["--model", args.model, "--device", f"cuda:{peer}", "--max-batch-sessions", str(max(64, *sessions))]
        server += ["--kv-budget-mib", str(args.kv_budget_mib), "--log-level", "WARNING", *args.server_args.split()]
        procs.append(_spawn(server))
        floor = [sys.executable, "-m", "draft_tools.bench.cuda_ipc", "--floor-server", ep_floor]
        floor += ["--device", str(args.device), "--peer-device", str(peer)]
        procs.append(_spawn(floor))
        from target_client import ClientConfig, DraftClient

        probe = DraftClient(ClientConfig(endpoint=ep_ipc, name="bench-probe"))
        w = probe.connect(wait=True)
        probe.close()
        assert w is not None
        width, k = w.contract.tap_width, w.contract.block_size
        if "cuda_ipc" not in w.transports:
            raise SystemExit(f"the server does not offer cuda_ipc (it offers {', '.join(w.transports)})")
        rows_out = []
        print(
            f"producer cuda:{args.device}, server cuda:{peer} ({'same GPU' if peer == args.device else 'peer GPUs'}); "
            f"{w.contract.model_name}, {width} tap values per row, k = {k}; ms, p50 (overhead = wait - compute)",
            flush=True,
        )
        for n in sessions:
            row: dict[str, Any] = {"sessions": n, "mb_per_step": round(n * ROWS * width * 2 / 1e6, 3)}
            row["floor"] = floor_rtt(ep_floor, args.device, n, width, args.iters, args.warmup)
            for t in transports:
                row[t] = product(endpoints[t], t, n, args.device, args.iters, args.warmup, width, k)
            if "cuda_ipc" in row:
                c = row["cuda_ipc"]
                c["overhead_minus_floor_p50_ms"] = round(c["overhead_p50_ms"] - row["floor"]["p50_ms"], 4)
            rows_out.append(row)
            parts = [f"B={n:3d} {row['mb_per_step']:6.2f} MB | floor {row['floor']['p50_ms']:6.3f}"]
            for t in transports:
                r = row[t]
                prep = ""
                if "prep_p50_ms" in r:
                    prep = f" prep {r['prep_p50_ms']:5.3f} pinned {r['prep_pinned_p50_ms']:5.3f}"
                parts.append(
                    f"{t} wait {r['wait_p50_ms']:6.3f} compute {r['compute_p50_ms']:6.3f} "
                    f"over {r['overhead_p50_ms']:6.3f}" + prep
                )
            print(" | ".join(parts), flush=True)
    finally:
        for p in procs:
            p.kill()
    out = {
        "benchmark": "cuda_ipc",
        "command": "python3 -m draft_tools.bench.cuda_ipc " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": _machine(args.device, peer),
        "settings": {
            "model": args.model,
            "rows_per_session": ROWS,
            "tap_width": width,
            "k": k,
            "iters": args.iters,
            "warmup": args.warmup,
            "kv_budget_mib": args.kv_budget_mib,
            "server_args": args.server_args,
            "endpoints": {
                "tcp": "loopback tcp",
                "ipc": "unix socket",
                "shm": "ipc + shm ring",
                "cuda_ipc": "ipc + CUDA IPC buffer",
            },
        },
        "notes": (
            "overhead = client wait - server compute (Timing.compute_ms); prep = the device-to-host copy "
            "a host transport needs before step() (not in wait), into a fresh pageable tensor; prep_pinned = the "
            "same into PinnedRows (page-locked, the rows sent); floor = CudaRing.put + a ZeroMQ ipc message + "
            "the importer's event wait, device-to-device copy and synchronize + a 64-byte answer"
        ),
        "seconds": round(time.time() - t_start, 1),
        "results": rows_out,
    }
    write_report(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
