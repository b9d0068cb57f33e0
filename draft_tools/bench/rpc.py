"""Same-host round trip of a Step, side by side per transport: the product path against the bare ZeroMQ floor.

For 1, 4, 16, 64 sessions and two payloads — "empty" (no rows, k drafts wanted) and "k3"
(3 committed rows x 5 taps x 7168 BF16 per session, as Kimi-K3 DSpark sends) — measure in the
same run, against one server process bound to tcp and ipc at once:

* floor: a bare DEALER -> ROUTER echo of the same bytes (another process), no protocol, over
  loopback tcp and over ipc;
* product: DraftClient.step() against the draft server (checksum drafter with a K3-sized
  contract) over ``tcp`` (loopback), ``ipc``, and ``ipc+shm`` (rows through the client's shared-
  memory ring, the Step carries only where they are; "k3" only) and ``ipc+shm in place`` (the
  caller writes each step's rows into a region of the ring it claims, untimed as a target's
  device-to-host copy, and the client sends them where they lie), reporting the client's wait,
  the server's own receive-to-reply time and the drafter's compute time; overhead = wait - compute.
* with grpcio installed: a gRPC unary echo of the same bytes ("k3" only; ``grpc_echo``),
  the design issue 12 measures us against, beside each product row as ``grpc_over_product``;
* with ``--ray-python`` (an interpreter with ``ray[serve]``): a Ray Serve deployment handle echo of
  the same bytes ("k3" only; ``ray_echo``, in a child under that interpreter, before the rest), beside
  each product row as ``ray_over_product`` (issue 12: >= 20x at one session);
* with CUDA: ``ipc+cuda_ipc`` too ("k3" only): the rows on the GPU, copied device to device through
  the client's CUDA IPC buffer (the checksum server declares the GPU; its digests then include a
  device-to-host copy, which is compute, not overhead), set beside its own floor: the same bytes
  through the same CUDA IPC buffer and a ZeroMQ ipc message, copied device to device by a bare
  importer (``draft_tools.bench.cuda_ipc``; that script measures cuda_ipc against a real K3 drafter).

Each session's steps append their rows as a target's committed tokens do (positions 0, 3, 6, ...;
new sessions every ``POS_WINDOW`` positions: ``appending``); runs before 2026-12-07 overwrote
positions [0, 3) every step, the client's and the server's overwrite paths rather than the steady state.

Writes JSON (machine, command, numbers) and prints a short table.
Usage: draft-bench [--iters 300] [--out bench/results/rpc_loopback.json]   (or python -m draft_tools.bench.rpc)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import zmq

from draft_tools.bench import grpc_echo, ray_echo
from draft_tools.common import free_port
from protocol import DType, ModelContract

K3 = ModelContract(
    model_name="checksum-k3",
    tap_layer_ids=(3, 24, 48, 72, 90),
    target_hidden_size=7168,
    vocab_size=163840,
    block_size=7,
    mask_token_id=163837,
    tap_dtype=DType.BF16,
)
SESSIONS = (1, 4, 16, 64)
ROWS = {"empty": 0, "k3": 3}
POS_WINDOW = 255  # positions a benchmark session appends over before it ends (``positions``)


def appending(client: Any, n: int, rows: int, k: int) -> Iterator[list]:
    """Each step's requests of ``n`` benchmark sessions that append ``rows`` a step, as a target's
    committed tokens do: a session ends at ``POS_WINDOW`` positions and the next generation starts at
    0 (requests come and go; the old ones freed between steps, untimed), so the context, and with it
    the checksum drafter's compute, stays small. Closing the generator frees the last ones."""
    from target_client import StepRequest

    per_gen = max(1, POS_WINDOW // max(rows, 1))
    gen, sids = 0, [f"s{i}.0" for i in range(n)]
    try:
        for it in itertools.count():
            g, j = divmod(it, per_gen)
            if g != gen:
                client.free(sids)
                gen, sids = g, [f"s{i}.{g}" for i in range(n)]
            yield [StepRequest(sid, j * rows, rows, 1, k) for sid in sids]
    finally:
        client.free(sids)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def serve_checksum(endpoint: str, idle_spin_ms: float = 0.0, metrics_port: int = -1, noop: bool = False) -> None:
    """A server of the checksum drafter with K3's contract; ``noop``: one whose batches do no drafter work
    (``NoopDrafter``), so what is left is the hop's and the server's own host work."""
    from draft_server.app import DraftServer, settle_heap
    from draft_server.config import ServerConfig
    from draft_server.drafters.checksum import ChecksumDrafter

    kind = noop_drafter() if noop else ChecksumDrafter
    drafter = kind(K3, device="cuda" if cuda_available() else None)  # a GPU: cuda_ipc is offered
    cfg = ServerConfig(bind=endpoint, metrics_port=metrics_port, drafter="checksum", idle_spin_ms=idle_spin_ms)
    srv = DraftServer(cfg, drafter)
    settle_heap()  # as ``draft-server serve`` does
    srv.start()
    print("READY", flush=True)
    sys.stdin.read()  # until the parent closes stdin
    srv.stop()


def noop_drafter() -> type:
    """The checksum drafter's sessions and KV accounting, with a step that does no work (fixed drafts)."""
    from draft_server.drafters.base import DraftOut
    from draft_server.drafters.checksum import ChecksumDrafter

    class NoopDrafter(ChecksumDrafter):
        def step(self, ingest: Any, drafts: Any) -> list[DraftOut]:
            return [DraftOut([1] * it.k) for it in drafts]

    return NoopDrafter


def serve_echo(endpoint: str) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(endpoint)
    print("READY", flush=True)
    while True:
        frames = s.recv_multipart(copy=False)
        s.send_multipart([frames[0], frames[1]], copy=False)  # header only back, like a reply


def cuda_floor_server(endpoint: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-m", "draft_tools.bench.cuda_ipc", "--floor-server", endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().startswith("READY")
    return p


def spawn(mode: str, endpoint: str, *extra: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-m", "draft_tools.bench.rpc", f"--{mode}", endpoint, *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().startswith("READY")
    return p


def pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(xs), q)), 4)


def step_frames(n: int, rows: int, width: int, call_id: int = 1) -> list:
    """The frames of a Step of ``n`` sessions with ``rows`` rows each (header + rows), encoded by our codec."""
    from protocol import Step, StepEntry, encode, spec_for

    taps = np.ones((n * rows, width), np.uint16) if rows else None
    entries = tuple(StepEntry(f"s{i}", 0, rows, 1, K3.block_size) for i in range(n))
    spec = spec_for(taps, DType.BF16, 0) if taps is not None else None
    return encode(Step(call_id, 1000.0, entries, spec), [taps] if taps is not None else [])


def bench_floor(endpoint: str, n: int, rows: int, iters: int, width: int = K3.tap_width, gap_s: float = 0.0) -> dict:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    waits = []
    for it in range(iters + 20):
        frames = step_frames(n, rows, width, it)
        t = time.perf_counter()
        s.send_multipart(frames, copy=False)
        s.recv_multipart()
        if it >= 20:
            waits.append((time.perf_counter() - t) * 1000)
        if gap_s:
            time.sleep(gap_s)
    s.close()
    return {"p50_ms": pct(waits, 50), "p99_ms": pct(waits, 99)}


def bench_product(
    endpoint: str, n: int, rows: int, iters: int, transport: str = "frames", gap_s: float = 0.0, spin_ms: float = 0.0
) -> dict:
    """``transport`` "shm_in_place": shm, each step's rows written (untimed, as a target's
    device-to-host copy lands) into a region the client claims, which goes out where it lies.
    ``spin_ms``: the client's ``wait_spin_ms``."""
    from target_client import ClientConfig, DraftClient

    in_place = transport == "shm_in_place"
    transport = "shm" if in_place else transport
    cfg = ClientConfig(
        endpoint=endpoint, budget_ms=1000.0, name="bench", transport=transport, shm_ring_mib=64, wait_spin_ms=spin_ms
    )
    client = DraftClient(cfg)
    welcome = client.connect(wait=True)
    contract = welcome.contract if welcome is not None else K3  # a running server: its own contract
    taps: Any = np.ones((n * rows, contract.tap_width), np.uint16) if rows else None
    if transport == "cuda_ipc" and taps is not None:  # the rows live on the GPU, as a target's taps do
        import torch

        taps = torch.ones((n * rows, contract.tap_width), dtype=torch.bfloat16, device="cuda")
    steps = appending(client, n, rows, contract.block_size)
    waits, server, compute = [], [], []
    claimed = 0
    for it in range(iters + 20):
        step_taps = taps
        if in_place and taps is not None:
            buf = client.claim_rows(taps.nbytes)
            if buf is not None:
                step_taps = buf.view(np.uint16).reshape(taps.shape)
                step_taps[:] = taps
                claimed += 1
                del buf
        reqs = next(steps)
        t = time.perf_counter()
        replies = client.step(reqs, step_taps)
        del step_taps
        wait = (time.perf_counter() - t) * 1000
        assert all(len(r.tokens) == contract.block_size for r in replies), "bench step failed"
        timing = client.last_timing
        if it >= 20:
            waits.append(wait)
            server.append(timing.server_ms)
            compute.append(timing.compute_ms)
        if gap_s:
            time.sleep(gap_s)
    steps.close()
    client.close()
    over = [w - c for w, c in zip(waits, compute, strict=True)]
    return {
        "wait_p50_ms": pct(waits, 50),
        "wait_p99_ms": pct(waits, 99),
        "server_p50_ms": pct(server, 50),
        "compute_p50_ms": pct(compute, 50),
        "overhead_p50_ms": pct(over, 50),
        "overhead_p99_ms": pct(over, 99),
        "rows_in_place": claimed,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="draft-bench", description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--iters", type=int, default=300, help="timed calls per configuration")
    ap.add_argument("--out", default="bench/results/rpc_loopback.json", help="JSON file for the results")
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="idle time after each call, floor and product alike (a target's forward between its steps: "
        "threads that sleep meanwhile take time to wake)",
    )
    ap.add_argument("--sessions", default=",".join(map(str, SESSIONS)), help="session counts to run")
    ap.add_argument("--payloads", default=",".join(ROWS), help="empty and/or k3")
    ap.add_argument(
        "--endpoint",
        default="",
        help="measure a running draft server at this endpoint (its own contract) instead of starting a "
        "checksum server; the bare-ZeroMQ echo floor still runs locally",
    )
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument(
        "--idle-spin-ms",
        type=float,
        default=0.0,
        help="the server's --idle-spin-ms (its engine polls, unslept, this long)",
    )
    ap.add_argument(
        "--client-spin-ms",
        type=float,
        default=0.0,
        help="also run 'ipc+shm in place' with the client's wait_spin_ms at this (its caller polls, unslept, "
        "from this long before the reply is due), beside the same run without",
    )
    ap.add_argument(
        "--ray-python",
        default="",
        help="a Python interpreter with ray[serve] installed (may be another virtualenv): also time a Ray Serve "
        "deployment handle echo of the k3 payloads",
    )
    ap.add_argument("--echo", help=argparse.SUPPRESS)
    ap.add_argument("--metrics-port", type=int, default=-1, help=argparse.SUPPRESS)  # with --serve: its metrics
    ap.add_argument("--noop", action="store_true", help=argparse.SUPPRESS)  # with --serve: no drafter work
    args = ap.parse_args(argv)
    if args.serve:
        serve_checksum(args.serve, args.idle_spin_ms, args.metrics_port, args.noop)
        return 0
    if args.echo:
        serve_echo(args.echo)
        return 0
    ray_ms: dict[int, float] = {}
    ray_info: dict[str, Any] = {}
    if args.ray_python and "k3" in args.payloads.split(","):
        if not ray_echo.available(args.ray_python):
            ap.error(f"--ray-python {args.ray_python}: cannot import ray.serve")
        ns = [int(x) for x in args.sessions.split(",")]
        # the k3 payloads of each session count, as gRPC's echo sends them (one message)
        joined = [grpc_echo.one_message(step_frames(n, ROWS["k3"], K3.tap_width)) for n in ns]
        ray_info = ray_echo.echo_ms(joined, args.iters, args.ray_python)
        ray_ms = dict(zip(ns, ray_info["ms"], strict=True))
        print(f"ray serve handle echo (ray {ray_info['ray']}, up in {ray_info['startup_s']} s): {ray_ms}", flush=True)
    tmp = tempfile.mkdtemp(prefix="draft-bench-")
    echo_eps = {"tcp": f"tcp://127.0.0.1:{free_port()}", "ipc": f"ipc://{tmp}/echo.sock"}
    # (name, endpoint, client transport, the floor it is set beside, the client's wait_spin_ms)
    runs = [
        ("tcp", f"tcp://127.0.0.1:{free_port()}", "frames", "tcp", 0.0),
        ("ipc", f"ipc://{tmp}/srv.sock", "frames", "ipc", 0.0),
    ]
    runs.append(("ipc+shm", runs[1][1], "shm", "ipc", 0.0))
    runs.append(("ipc+shm in place", runs[1][1], "shm_in_place", "ipc", 0.0))
    if args.client_spin_ms:
        runs.append(("ipc+shm in place, client spin", runs[1][1], "shm_in_place", "ipc", args.client_spin_ms))
    cuda = cuda_available() and not args.endpoint
    if cuda:
        runs.append(("ipc+cuda_ipc", runs[1][1], "cuda_ipc", "cuda_ipc", 0.0))
    if args.endpoint:
        runs = [("given", args.endpoint, "frames", "tcp", 0.0)]
    echoes = [spawn("echo", ep) for ep in echo_eps.values()]
    if cuda:  # the CUDA IPC floor's importer (on the same GPU as the checksum server)
        echoes.append(cuda_floor_server(f"ipc://{tmp}/floor.sock"))
    gport = 0
    if grpc_echo.available():
        gport = free_port()
        echoes.append(grpc_echo.spawn(gport))
    spin = ["--idle-spin-ms", str(args.idle_spin_ms)]
    srv = None if args.endpoint else spawn("serve", f"{runs[0][1]},{runs[1][1]}", *spin)
    ep_srv = runs[0][1]
    results = []
    width = K3.tap_width
    if args.endpoint:  # the same bytes as the running server's contract asks for
        from target_client import ClientConfig, DraftClient

        probe = DraftClient(ClientConfig(endpoint=ep_srv, name="bench-probe"))
        w = probe.connect(wait=True)
        probe.close()
        width = w.contract.tap_width if w is not None else width
    try:
        gap = args.gap_ms / 1000.0
        for payload, rows in ((p, ROWS[p]) for p in args.payloads.split(",")):
            for n in (int(x) for x in args.sessions.split(",")):
                floors = {k: bench_floor(ep, n, rows, args.iters, width, gap) for k, ep in echo_eps.items()}
                if cuda and rows:
                    from draft_tools.bench.cuda_ipc import floor_rtt

                    floors["cuda_ipc"] = floor_rtt(f"ipc://{tmp}/floor.sock", 0, n, width, args.iters, 20)
                grpc_ms = grpc_echo.echo_ms(gport, step_frames(n, rows, width), args.iters) if gport and rows else None
                mb = n * rows * width * 2 / 1e6
                for name, ep, transport, floor_of, spin_ms in runs:
                    if transport in ("shm", "shm_in_place", "cuda_ipc") and not rows:
                        continue  # no rows: the same message as ipc
                    prod = bench_product(ep, n, rows, args.iters, transport, gap, spin_ms)
                    floor = floors[floor_of]
                    row = {"payload": payload, "sessions": n, "mb_per_step": round(mb, 3), "transport": name}
                    if grpc_ms is not None:
                        row |= {"grpc_echo_p50_ms": round(grpc_ms, 4)}
                        row["grpc_over_product"] = round(grpc_ms / prod["wait_p50_ms"], 3)
                    if rows and n in ray_ms:
                        row["ray_echo_p50_ms"] = ray_ms[n]
                        row["ray_over_product"] = round(ray_ms[n] / prod["wait_p50_ms"], 3)
                    results.append(row | {"floor": floor | {"over": floor_of}, "product": prod})
                    print(
                        f"{payload:5s} B={n:3d} {mb:6.2f} MB {name:29s} floor({floor_of}) p50 {floor['p50_ms']:7.3f} ms"
                        f" | client p50 {prod['wait_p50_ms']:7.3f} p99 {prod['wait_p99_ms']:7.3f} | compute "
                        f"{prod['compute_p50_ms']:6.3f} | overhead p50 {prod['overhead_p50_ms']:7.3f} ms"
                        + (f" | grpc echo {grpc_ms:7.3f} ms" if grpc_ms is not None else "")
                        + (f" | ray echo {ray_ms[n]:7.3f} ms" if rows and n in ray_ms else ""),
                        flush=True,
                    )
    finally:
        for p in (srv, *echoes):
            if p is not None:
                p.kill()
    out = {
        "benchmark": "rpc_loopback",
        "command": "python -m draft_tools.bench.rpc " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "processor": platform.processor(),
            "loadavg_1m_at_end": os.getloadavg()[0],
        },
        "iters": args.iters,
        "gap_ms": args.gap_ms,
        "idle_spin_ms": args.idle_spin_ms,
        "client_spin_ms": args.client_spin_ms,
        "transport": (
            f"running server at {args.endpoint}"
            if args.endpoint
            else "tcp loopback, ipc, ipc+shm, ipc+shm in place" + (", ipc+cuda_ipc (GPU 0)" if cuda else "")
        ),
        "grpc_echo": "grpcio unary echo, the same bytes (k3 payload)" if gport else "not measured: no grpcio",
        "ray_serve_echo": (
            f"Ray Serve {ray_info['ray']} deployment handle echo, the same bytes (k3 payload), one replica, "
            f"timed from the driver before the rest of the run ({args.ray_python})"
            if ray_info
            else "not measured: no --ray-python"
        ),
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
