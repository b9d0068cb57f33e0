"""A bare echo over ZeroMQ (DEALER/ROUTER over ipc) against the same echo over a Unix SOCK_SEQPACKET pair.

Why direct links exist (``protocol.direct``): the floor of a same-host round trip each way can
carry. One echo server process per carrier, the client in this process, a ``--bytes`` message
(a 64-session Step's header is about 3 KB, one session's about 150 bytes) sent and read back
``--iters`` times after a warm-up; p50 / p99 in microseconds, each carrier ``--rounds`` times,
alternating. Writes one JSON (``--out``) with the machine and the command.

    python3 -m draft_tools.bench.direct_echo [--bytes 600] [--iters 20000] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import zmq

QUIT = b"q"


def _zmq_server(endpoint: str) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(endpoint)
    while True:
        frames = s.recv_multipart(copy=False)
        if frames[1].bytes == QUIT:
            break
        s.send_multipart(frames, copy=False)
    os._exit(0)


def _unix_server(name: str) -> None:
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ls.bind("\0" + name)
    ls.listen(1)
    c, _ = ls.accept()
    while True:
        m = c.recv(1 << 16)
        if not m or m == QUIT:
            break
        c.send(m)
    os._exit(0)


def _serve(target: Callable[[str], None], where: str) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            target(where)
        finally:
            os._exit(1)
    return pid


def one(kind: str, size: int, iters: int, tmp: str) -> dict[str, float]:
    msg = b"x" * size
    if kind == "zmq":
        ep = f"ipc://{tmp}/echo-{os.getpid()}-{time.monotonic_ns()}"
        pid = _serve(_zmq_server, ep)
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.connect(ep)

        def rt() -> None:
            s.send_multipart([msg], copy=False)
            s.recv_multipart(copy=False)

        def quit_() -> None:
            s.send_multipart([QUIT])
            s.close(linger=100)
            ctx.term()

    else:
        name = f"draft-echo-{os.getpid()}-{time.monotonic_ns()}"
        pid = _serve(_unix_server, name)
        c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for _ in range(200):  # until the child listens
            try:
                c.connect("\0" + name)
                break
            except (ConnectionRefusedError, FileNotFoundError):
                time.sleep(0.01)

        def rt() -> None:
            c.send(msg)
            c.recv(1 << 16)

        def quit_() -> None:
            c.send(QUIT)
            c.close()

    try:
        for _ in range(min(1000, iters)):
            rt()
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            rt()
            ts.append(time.perf_counter() - t0)
    finally:
        quit_()
        os.waitpid(pid, 0)
    ts.sort()
    return {"p50_us": statistics.median(ts) * 1e6, "p99_us": ts[int(len(ts) * 0.99)] * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", type=int, default=600)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"zmq": [], "seqpacket": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind in ("zmq", "seqpacket") if r % 2 == 0 else ("seqpacket", "zmq"):
                runs[kind].append(one(kind, args.bytes, args.iters, tmp))
                print(
                    f"round {r} {kind:9s} p50 {runs[kind][-1]['p50_us']:7.1f} us  p99 {runs[kind][-1]['p99_us']:7.1f}"
                )
    report = {
        "benchmark": "direct_echo",
        "command": "python3 -m draft_tools.bench.direct_echo " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "bytes": args.bytes,
        "iters": args.iters,
        "median_of_rounds": {
            k: {m: statistics.median(x[m] for x in v) for m in ("p50_us", "p99_us")} for k, v in runs.items()
        },
        "runs": runs,
    }
    print(json.dumps(report["median_of_rounds"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
