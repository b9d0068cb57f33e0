"""Our Step against the designs it replaces: a gRPC echo and a serialized REQ/REP draft server.

Two comparisons, each side by side in one run on one machine:

1. **Round trip at B = 1..64** (the bytes of a K3 Step: 3 rows x 5 x 7168 bf16 per session):
   our ``DraftClient.step`` against a ``draft-server`` (the drafter ``--model`` names), a bare
   ZeroMQ DEALER/ROUTER echo of the same bytes, and a gRPC (grpcio) unary echo of the same
   bytes. Echoes answer with a 64-byte reply, as small as ours. Ray Serve is not measured here: it is
   not installable on the GPU hosts this runs on (the JSON says so); ``draft-bench --ray-python``
   measures its handle echo where Ray is.
2. **Drafts per second with 16 concurrent callers** (16 processes, one session each, 3 rows + k
   drafts per call): our server, which batches the callers' entries into one drafter call, against a
   REQ/REP server that runs the same drafter on one request per call, one call at a time. With
   ``--transport shm`` both sides take the same-host path: our callers over ``ipc://`` with their
   rows written in place in their shared-memory rings (``DraftClient.claim_rows``, as a target writes
   its taps there), the REQ/REP server over ``ipc://`` too (its rows in frames: it has no ring).

    python -m draft_tools.bench.peers --model checksum --out bench/results/peers_cpu.json
    python -m draft_tools.bench.peers --model random:k3 --device cuda --out bench/results/peers_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import zmq

from draft_tools.bench import grpc_echo
from draft_tools.bench.rpc import spawn as spawn_rpc
from draft_tools.bench.rpc import step_frames
from draft_tools.common import free_port, median_ms, spawn_ready

SESSIONS = (1, 4, 16, 64)
ROWS, K, CALLERS = 3, 7, 16


# ------------------------------------------------------------------------------ servers


def serve_reqrep(endpoint: str, model: str, device: str) -> None:
    """One request per call, one call at a time: decode, ingest, draft, reply (our codec, our drafter)."""
    from draft_server.app import build_drafter
    from draft_server.config import ServerConfig
    from draft_server.drafters.base import DraftItem, IngestItem
    from protocol import GREEDY, Status, decode_request, encode
    from protocol.codec import tensor
    from protocol.messages import EntryResult, StepResult, Timing

    if model == "checksum":  # the K3-size contract draft-bench's checksum server serves
        from draft_server.drafters.checksum import ChecksumDrafter
        from draft_tools.bench.rpc import K3

        drafter: Any = ChecksumDrafter(K3)
    else:
        drafter = build_drafter(ServerConfig(model=model, device=device))
    drafter.prepare(1, 4096)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.bind(endpoint)
    keys: dict[str, int] = {}
    print("READY", flush=True)
    while True:
        frames = sock.recv_multipart(copy=False)
        t0 = time.monotonic()
        msg = decode_request(frames[0].buffer)
        taps = tensor(msg.taps, [f.buffer for f in frames[1:]]) if msg.taps is not None else None
        results, off = [], 0
        for e in msg.entries:
            key = keys.setdefault(e.session, len(keys))
            drafter.reserve(key, 0, e.pos + e.rows + drafter.scratch_rows)
            if e.rows and taps is not None:
                drafter.ingest([IngestItem(key, 0, e.pos, taps[off : off + e.rows])])
                off += e.rows
            out = drafter.draft([DraftItem(key, 0, e.pos + e.rows, e.anchor, e.k, GREEDY)])[0]
            results.append(EntryResult(Status.OK, tuple(out.tokens), e.pos + e.rows))
        dt = (time.monotonic() - t0) * 1000
        reply = StepResult(msg.call_id, "reqrep", "", tuple(results), Timing(0.0, dt, dt))
        sock.send_multipart(encode(reply, []), copy=False)


def spawn(args: list[str]) -> subprocess.Popen:
    return spawn_ready([sys.executable, "-m", "draft_tools.bench.peers", *args])


def spawn_server(endpoint: str, model: str, device: str, extra: list[str], tree: str | None = None) -> subprocess.Popen:
    """A draft server on ``endpoint``; ``tree``: run the ``draft_server`` and ``protocol`` packages of
    that source tree instead (an A/B against another commit: ``python -m`` puts the cwd first)."""
    if model == "checksum":  # K3-size taps, the checksum drafter (draft-bench's server)
        if tree is not None:
            raise ValueError("--baseline-tree needs a --model the draft-server CLI serves (not checksum)")
        return spawn_rpc("serve", endpoint)
    port = free_port()
    cmd = [sys.executable, "-m", "draft_server", "serve", "--bind", endpoint, "--metrics-port", str(port)]
    cmd += ["--model", model, "--device", device, "--max-batch-sessions", "64", *extra]
    p = spawn_ready(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=tree)
    p.metrics_port = port  # type: ignore[attr-defined]
    return p


# ------------------------------------------------------------------------------ clients


def step_bytes(n: int, width: int) -> list[Any]:
    """The frames of a K3-size Step of n sessions (header + ROWS rows each), encoded by our codec."""
    return step_frames(n, ROWS, width)


def zmq_echo_ms(endpoint: str, n: int, width: int, iters: int) -> float:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    frames = step_bytes(n, width)

    def once() -> None:
        s.send_multipart(frames, copy=False)
        s.recv_multipart()

    try:
        return median_ms(once, iters)
    finally:
        s.close()


def ours_ms(endpoint: str, n: int, width: int, iters: int) -> dict[str, float]:
    from target_client import ClientConfig, DraftClient, StepRequest

    client = DraftClient(ClientConfig(endpoint=endpoint, budget_ms=3000.0, name=f"peers-{n}"))
    assert client.connect(wait=True) is not None
    taps = np.ones((n * ROWS, width), np.uint16)
    reqs = [StepRequest(f"p{n}-{i}", 0, ROWS, 1, K) for i in range(n)]
    comp: list[float] = []

    def once() -> None:
        client.step(reqs, taps)
        if client.last_timing is not None:
            comp.append(client.last_timing.compute_ms)

    try:
        wait = median_ms(once, iters)
        return {"wait_ms": wait, "compute_ms": statistics.median(comp), "overhead_ms": wait - statistics.median(comp)}
    finally:
        client.free([r.session for r in reqs])
        client.close()


def _caller(kind: str, endpoint: str, width: int, i: int, seconds: float, barrier: Any, q: Any, transport: str) -> None:
    """One caller process: one session, ROWS rows + K drafts per call, for ``seconds``."""
    call = ours_caller(endpoint, width, i, transport) if kind == "ours" else reqrep_caller(endpoint, width, i)
    barrier.wait()
    n, stop = 0, time.monotonic() + seconds
    while time.monotonic() < stop:
        n += call()
    q.put(n)


def batches(server: subprocess.Popen) -> tuple[float, float, float]:
    """(decode batches, sessions drafted in them, batches held) so far, from the server's /metrics
    (zeros for a server without a metrics port: the checksum bench server)."""
    port = getattr(server, "metrics_port", None)
    if port is None:
        return 0.0, 0.0, 0.0
    from draft_tools.common import scrape

    m = scrape(port)
    names = ("batch_sessions_count", "batch_sessions_sum", "batch_hold_seconds_count")
    return tuple(m.get(f"draft_server_{n}", 0.0) for n in names)  # type: ignore[return-value]


def concurrent_run(
    kind: str, endpoint: str, width: int, seconds: float, server: subprocess.Popen, transport: str = "frames"
) -> dict[str, float]:
    """``concurrent_drafts_per_s`` with the server's batches over the run: sessions per batch, held batches."""
    b0 = batches(server)
    rate = concurrent_drafts_per_s(kind, endpoint, width, seconds, transport)
    n, s, held = (b - a for a, b in zip(b0, batches(server), strict=True))
    return {"drafts_per_s": rate, "batches": n, "sessions_per_batch": s / n if n else 0.0, "held_batches": held}


def concurrent_drafts_per_s(kind: str, endpoint: str, width: int, seconds: float, transport: str = "frames") -> float:
    """CALLERS processes (as separate target engines are), all calling at once for ``seconds``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(CALLERS + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_caller, args=(kind, endpoint, width, i, seconds, barrier, q, transport))
        for i in range(CALLERS)
    ]
    for p in procs:
        p.start()
    barrier.wait(timeout=120)
    t0 = time.monotonic()
    total = sum(q.get(timeout=seconds + 60) for _ in procs)
    dt = time.monotonic() - t0
    for p in procs:
        p.join(10)
    return total / dt


def ours_caller(endpoint: str, width: int, i: int, transport: str = "frames") -> Any:
    from target_client import ClientConfig, DraftClient, StepRequest

    cfg = ClientConfig(endpoint=endpoint, budget_ms=3000.0, name=f"caller-{i}", transport=transport)
    client = DraftClient(cfg)
    assert client.connect(wait=True) is not None
    taps = np.ones((ROWS, width), np.uint16)
    pos = [0]

    def call() -> int:
        rows = taps
        if transport == "shm":  # written in place in the ring, as a target's taps are (the copy is the caller's)
            room = client.claim_rows(taps.nbytes)
            if room is None:
                raise RuntimeError("no room claimed in the shm ring")
            rows = room.view(np.uint16).reshape(taps.shape)
            rows[...] = taps
        r = client.step([StepRequest(f"c{i}", pos[0], ROWS, 1, K)], rows)
        pos[0] = (pos[0] + ROWS) % 240
        return len(r[0].tokens)

    return call


def reqrep_caller(endpoint: str, width: int, i: int) -> Any:
    from protocol import DType, Step, StepEntry, decode_reply, encode, spec_for

    s = zmq.Context.instance().socket(zmq.REQ)
    s.connect(endpoint)
    taps = np.ones((ROWS, width), np.uint16)
    pos = [0]

    def call() -> int:
        msg = Step(1, 1000.0, (StepEntry(f"c{i}", pos[0], ROWS, 1, K),), spec_for(taps, DType.BF16, 0))
        s.send_multipart(encode(msg, [taps]), copy=False)
        rep = decode_reply(s.recv_multipart()[0])
        pos[0] = (pos[0] + ROWS) % 240
        return len(rep.results[0].drafts)  # type: ignore[union-attr]

    return call


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checksum", help="checksum, random:k3, or a checkpoint directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=10.0, help="per side of the concurrency comparison")
    ap.add_argument("--out", default="bench/results/peers.json")
    ap.add_argument("--server-args", default="", help="extra draft-server flags (e.g. --batch-window-ms 1)")
    ap.add_argument("--no-round-trip", action="store_true", help="only the concurrency comparison")
    ap.add_argument(
        "--baseline-tree",
        help="a source tree (draft_server/ and protocol/ of another commit): its server's drafts/s with the "
        "same callers, measured in the same run beside this tree's (the A/B of a scheduler change)",
    )
    ap.add_argument(
        "--transport",
        default="frames",
        choices=["frames", "shm"],
        help="the concurrency comparison's path: frames over tcp, or shm (ours over ipc with rows in place in "
        "the callers' rings, REQ/REP over ipc)",
    )
    ap.add_argument("--reqrep", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.reqrep:
        serve_reqrep(args.reqrep, args.model, args.device)
        return 0
    ep_srv, ep_echo, ep_rr = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    bind, ep_conc = ep_srv, ep_srv  # where the server listens; where the concurrent callers call it
    ipc_dir = ""
    if args.transport == "shm":
        ipc_dir = tempfile.mkdtemp(prefix="peers-")
        ep_conc, ep_rr = f"ipc://{ipc_dir}/srv.sock", f"ipc://{ipc_dir}/reqrep.sock"
        bind = f"{ep_srv},{ep_conc}"
    gport = free_port()
    out: dict[str, Any] = {
        "benchmark": "peers",
        "command": "python -m draft_tools.bench.peers " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "model": args.model,
        "ray_serve": "not measured here: no ray on the GPU hosts (no network); see draft-bench --ray-python",
        "round_trip": [],
    }
    procs = [spawn_rpc("echo", ep_echo), spawn_server(bind, args.model, args.device, args.server_args.split())]
    if not args.no_round_trip:  # the gRPC echo is one of the round trip's sides only
        procs.append(grpc_echo.spawn(gport))
    try:
        from target_client import ClientConfig, DraftClient

        probe = DraftClient(ClientConfig(endpoint=ep_srv, name="peers-probe"))
        w = probe.connect(wait=True)
        probe.close()
        assert w is not None
        width = w.contract.tap_width
        out["server_args"] = args.server_args
        for n in () if args.no_round_trip else SESSIONS:
            row = {"sessions": n, "mb": n * ROWS * width * 2 / 1e6}
            row["zmq_echo_ms"] = zmq_echo_ms(ep_echo, n, width, args.iters)
            row["grpc_echo_ms"] = grpc_echo.echo_ms(gport, step_bytes(n, width), args.iters)
            row.update({f"ours_{k}": v for k, v in ours_ms(ep_srv, n, width, args.iters).items()})
            row["ours_over_zmq_echo"] = row["ours_wait_ms"] / row["zmq_echo_ms"]
            row["grpc_over_ours"] = row["grpc_echo_ms"] / row["ours_wait_ms"]
            out["round_trip"].append(row)
            print(
                f"B={n:3d} {row['mb']:6.2f} MB  zmq echo {row['zmq_echo_ms']:7.3f}  "
                f"grpc echo {row['grpc_echo_ms']:7.3f}  "
                f"ours {row['ours_wait_ms']:7.3f} (compute {row['ours_compute_ms']:.3f}, overhead "
                f"{row['ours_overhead_ms']:.3f}) ms",
                flush=True,
            )
        run = concurrent_run("ours", ep_conc, width, args.seconds, procs[1], args.transport)
        ours = run["drafts_per_s"]
        conc: dict[str, Any] = {"callers": CALLERS, "transport": args.transport, "ours_drafts_per_s": ours, "ours": run}
        print(f"{CALLERS} callers: ours {json.dumps({k: round(v, 2) for k, v in run.items()})}", flush=True)
        if args.baseline_tree:  # interleaved: this tree, the baseline, this tree again
            ep_base = f"tcp://127.0.0.1:{free_port()}"
            bind_base = ep_base
            if args.transport == "shm":
                bind_base, ep_base = f"{ep_base},{ep_conc}.base", f"{ep_conc}.base"
            tree = os.path.abspath(args.baseline_tree)
            procs.append(spawn_server(bind_base, args.model, args.device, args.server_args.split(), tree))
            base = concurrent_run("ours", ep_base, width, args.seconds, procs[-1], args.transport)
            print(f"{CALLERS} callers: baseline {json.dumps({k: round(v, 2) for k, v in base.items()})}", flush=True)
            again = concurrent_run("ours", ep_conc, width, args.seconds, procs[1], args.transport)
            print(f"{CALLERS} callers: ours again {json.dumps({k: round(v, 2) for k, v in again.items()})}", flush=True)
            conc.update(baseline_tree=args.baseline_tree, baseline=base, ours_again=again)
            conc["baseline_drafts_per_s"] = base["drafts_per_s"]
        for p in procs[1:]:  # the draft servers hold most of the device's memory (their KV budgets)
            p.kill()
            p.wait()
        procs.append(spawn(["--reqrep", ep_rr, "--model", args.model, "--device", args.device]))
        rr = concurrent_drafts_per_s("reqrep", ep_rr, width, args.seconds)
        conc.update(reqrep_drafts_per_s=rr, ratio=ours / rr)
        if args.baseline_tree:
            conc["baseline_ratio"] = conc["baseline_drafts_per_s"] / rr
        out["concurrent"] = conc
        print(f"{CALLERS} callers: ours {ours:.0f} drafts/s, serialized REQ/REP {rr:.0f} drafts/s ({ours / rr:.1f}x)")
    finally:
        for p in procs:
            p.kill()
        if ipc_dir:
            shutil.rmtree(ipc_dir, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
