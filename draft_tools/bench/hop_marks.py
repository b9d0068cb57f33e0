"""Where a Step's round trip goes, segment by segment, on both sides of the hop (issue 12).

A no-op drafter server (``draft-bench --serve --noop``: the hop's and the server's own host work only),
or with ``--server-args`` a real one (``draft-server serve`` with those flags, e.g. ``--model random:k3
--device cuda``: the hop beside a GPU step), runs in a child process with timestamps taken at fixed
points of its code; a ``DraftClient`` in this process takes its own. Both read ``time.perf_counter``
(CLOCK_MONOTONIC on Linux: one clock for every process of the host), so each step's marks line up
into one timeline:

    client: enter step() | send() | sent || server: engine_serve | header read | Step admitted |
    engine_serve done | inbox drained | batch | drafter | reply | send() | sent || client: reply read |
    return

A Step is read either by the idle engine (``engine_serve`` ... ``served``) or by the I/O thread, which
hands its work to the engine (which must wake for it); each step's segments run between the marks it
met, in time order (the server's ``send()`` may return after the client read the reply), so the table
shows both paths, each with how many steps took it.
``--gap-ms`` sleeps between steps (untimed), as a target's forward does: then both processes idle
between Steps, as they do in service, and wake for each.

(2-core VM, one K3 session, rows in place, at e61706b: the client's own work 43 us before its send and 58
after the reply; each ``send()`` 40-45 us; the server 14 us to read the header, 44 to admit the Step,
14 to form the batch, 9 from reply to send)

and the table gives each segment's median (us). Each session's steps append their rows (``rpc.appending``;
runs before 2026-12-07 overwrote positions [0, 3) every step). The marks wrap methods of the shipped code (nothing in
the product changes); each costs well under a microsecond.

    python -m draft_tools.bench.hop_marks [--sessions 1,64] [--transport shm] [--in-place] [--steps 3000]
        [--gap-ms 0] [--client-spin-ms 0] [--server-args "--model random:k3 --device cuda"] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import psutil

# the server's marks, in the order one Step meets them
SERVER_MARKS = (
    ("engine_serve", "Router.engine_serve", "before"),
    ("header_read", "Router._dispatch", "before"),
    ("admitted", "Router._dispatch", "after"),
    ("served", "Router.engine_serve", "after"),
    ("drained", "Engine._drain_inbox", "before"),
    ("batch", "Engine._decode_batch", "before"),
    ("drafter", "drafter.step", "before"),
    ("reply", "Engine._reply", "before"),
    ("send", "Router._send", "before"),
    ("sent", "Router._send", "after"),
)


def serve(endpoint: str, out: str, server_args: str = "") -> None:
    """The server with marks (child process): the no-op drafter's, or ``draft-server serve`` with
    ``server_args`` bound to ``endpoint``; writes the marks to ``out`` (JSON) on SIGUSR1."""
    from draft_server.engine import scheduler
    from draft_server.io import router
    from draft_tools.bench import rpc

    marks: dict[str, list[float]] = {name: [] for name, _, _ in SERVER_MARKS}
    pc = time.perf_counter
    owners = {"Router": router.Router, "Engine": scheduler.Engine}

    def wrap(cls: Any, meth: str, before: str | None, after: str | None) -> None:
        orig = getattr(cls, meth)

        def marked(*a: Any, **k: Any) -> Any:
            if before:
                marks[before].append(pc())
            r = orig(*a, **k)
            if after:
                marks[after].append(pc())
            return r

        setattr(cls, meth, marked)

    by_site: dict[str, dict[str, str]] = {}
    for name, site, when in SERVER_MARKS:
        by_site.setdefault(site, {})[when] = name
    for site, whens in by_site.items():
        owner, meth = site.split(".")
        if owner == "drafter":
            continue
        wrap(owners[owner], meth, whens.get("before"), whens.get("after"))

    def dump(*_: Any) -> None:
        with open(out, "w") as f:
            json.dump(marks, f)
        os._exit(0)

    signal.signal(signal.SIGUSR1, dump)
    if server_args:
        from draft_server.app import serve as serve_model
        from draft_server.cli import parse_serve_config, serve_parser

        cfg = parse_serve_config(serve_parser().parse_args([*shlex.split(server_args), "--bind", endpoint]))
        if cfg is None:
            raise SystemExit(2)

        def marked_step(drafter: Any) -> Any:
            step = drafter.step

            def marked(ingest: Any, drafts: Any) -> Any:
                marks["drafter"].append(pc())
                return step(ingest, drafts)

            drafter.step = marked
            return drafter

        serve_model(cfg, wrap=marked_step)  # until SIGTERM (a model server may not see SIGUSR1 in time)
        dump()
    noop = rpc.noop_drafter

    def marked_noop() -> type:
        base = noop()

        class Marked(base):  # type: ignore[misc,valid-type]
            def step(self, ingest: Any, drafts: Any) -> Any:
                marks["drafter"].append(pc())
                return super().step(ingest, drafts)

        return Marked

    rpc.noop_drafter = marked_noop
    rpc.serve_checksum(endpoint, noop=True)


def run_client(
    endpoint: str, n: int, steps: int, transport: str, in_place: bool, gap_ms: float = 0.0, spin_ms: float = 0.0
) -> dict[str, list[float]]:
    """``steps`` Steps of n sessions, 3 rows each, ``gap_ms`` apart (0: back to back); the client's marks per step."""
    from draft_tools.bench.rpc import appending
    from target_client import ClientConfig, DraftClient
    from target_client.client import io_loop

    pc = time.perf_counter
    step_marks: dict[str, float] = {}
    send, recv = io_loop.IoLoop._try_send, io_loop.IoLoop._on_bufs

    def marked_send(self: Any, frames: list, *a: Any, **k: Any) -> bool:
        step_marks["send"] = pc()
        ok = send(self, frames, *a, **k)
        step_marks["sent"] = pc()
        return ok

    def marked_recv(self: Any, bufs: list, now: float) -> None:
        step_marks.setdefault("reply_read", pc())  # the first reply read after the send (its header in hand)
        recv(self, bufs, now)

    io_loop.IoLoop._try_send, io_loop.IoLoop._on_bufs = marked_send, marked_recv  # type: ignore[method-assign]
    cfg = ClientConfig(
        endpoint=endpoint, budget_ms=1000.0, name="marks", transport=transport, shm_ring_mib=64, wait_spin_ms=spin_ms
    )
    client = DraftClient(cfg)
    welcome = client.connect(wait=True)
    assert welcome is not None
    taps = np.ones((n * 3, welcome.contract.tap_width), np.uint16)
    requests = appending(client, n, 3, welcome.contract.block_size)
    out: dict[str, list[float]] = {k: [] for k in ("enter", "send", "sent", "reply_read", "return")}
    try:
        for reqs in itertools.islice(requests, steps):
            rows: Any = taps
            if in_place:
                buf = client.claim_rows(taps.nbytes)
                assert buf is not None, "no free region in the ring"
                rows = buf.view(np.uint16).reshape(taps.shape)
                rows[:] = taps
                del buf
            step_marks.clear()
            t0 = pc()
            client.step(reqs, rows)
            t1 = pc()
            del rows
            out["enter"].append(t0)
            out["return"].append(t1)
            for k in ("send", "sent", "reply_read"):
                out[k].append(step_marks.get(k, float("nan")))
            if gap_ms:
                time.sleep(gap_ms / 1000.0)
    finally:
        requests.close()
        client.close()
        io_loop.IoLoop._try_send, io_loop.IoLoop._on_bufs = send, recv  # type: ignore[method-assign]
    return out


# marks a Step meets on one path only: the idle engine reads it (engine_serve .. served), or the I/O thread
# does and hands its work over; drained: the engine's loop, whichever read it
OPTIONAL = {"engine_serve", "served", "drained"}


def align(client: dict[str, list[float]], server: dict[str, list[float]], skip: int) -> dict[str, Any]:
    """Median us of each segment between consecutive marks a step met, in order, over the steps whose
    required server marks all fall between the client's send and its reply read; by path (``engine``:
    the idle engine read the Step; ``io``: the I/O thread did and handed it over)."""
    srv = {k: np.asarray(v) for k, v in server.items()}
    by_path: dict[str, dict[str, list[float]]] = {"engine": {}, "io": {}}
    totals: dict[str, list[float]] = {"engine": [], "io": []}
    for i in range(skip, len(client["enter"])):
        a, b = client["sent"][i], client["reply_read"][i]
        if not (a == a and b == b):  # nan: a step that never went out
            continue
        t = [("client.enter", client["enter"][i]), ("client.send", client["send"][i]), ("client.sent", a)]
        prev, end = a, client["return"][i]
        nxt = client["enter"][i + 1] if i + 1 < len(client["enter"]) else math.inf
        for name, _, _ in SERVER_MARKS:
            arr = srv[name]
            j = int(np.searchsorted(arr, prev))
            if name == "served" and not any(n == "server.engine_serve" for n, _ in t):
                continue  # the I/O thread read it: the engine's next serve is not this Step's
            # the server's send may return after the client has read the reply, even after its step
            # returned (the send woke it, and on few cores it ran first): before the next step, then
            if j < len(arr) and arr[j] <= (nxt if name == "sent" else b):
                prev = float(arr[j])
                t.append((f"server.{name}", prev))
            elif name not in OPTIONAL:
                break
        else:
            t = sorted([*t, ("client.reply_read", b), ("client.return", end)], key=lambda m: m[1])
            path = "engine" if any(n == "server.engine_serve" for n, _ in t) else "io"
            segs = by_path[path]
            for (n0, t0), (n1, t1) in itertools.pairwise(t):
                segs.setdefault(f"{n0} -> {n1}", []).append(t1 - t0)
            totals[path].append(end - client["enter"][i])  # the client's round trip
    res: dict[str, Any] = {"aligned_steps": sum(len(v) for v in totals.values())}
    for path, segs in by_path.items():
        if totals[path]:
            r: dict[str, Any] = {k: round(float(np.median(v)) * 1e6, 1) for k, v in segs.items()}
            r["total"] = round(float(np.median(totals[path])) * 1e6, 1)
            r["steps"] = len(totals[path])
            res[path] = r
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", default="1,64")
    ap.add_argument("--transport", default="shm", choices=("frames", "shm"))
    ap.add_argument("--in-place", action="store_true", help="rows written into a region of the ring (shm)")
    ap.add_argument("--steps", type=int, default=3000, help="steps per session count (the first 10%% untimed)")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="sleep between steps (a target's forward), untimed")
    ap.add_argument("--client-spin-ms", type=float, default=0.0, help="the client's wait_spin_ms")
    ap.add_argument(
        "--server-args",
        default="",
        help="a real server: these draft-server serve flags (e.g. '--model random:k3 --device cuda'), not the no-op",
    )
    ap.add_argument("--out", default="")
    ap.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)  # ENDPOINT OUT SERVER_ARGS: the marked server
    args = ap.parse_args(argv)
    if args.serve:
        serve(*args.serve)
        return 0
    if args.in_place and args.transport != "shm":
        ap.error("--in-place needs --transport shm")
    report: dict[str, Any] = {
        "benchmark": "hop_marks",
        "command": "python -m draft_tools.bench.hop_marks " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rows": "3 rows of the contract's taps per session, "
        + (f"server: draft-server serve {args.server_args}" if args.server_args else "no-op drafter (K3's contract)"),
        "gap_ms": args.gap_ms,
        "client_spin_ms": args.client_spin_ms,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(s) for s in args.sessions.split(",")]:
            endpoint, marks = f"ipc://{tmp}/s{n}.sock", os.path.join(tmp, f"marks{n}.json")
            cmd = [sys.executable, "-m", "draft_tools.bench.hop_marks", "--serve", endpoint, marks, args.server_args]
            srv = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                assert srv.stdout is not None
                for line in srv.stdout:  # a model server may print before it is ready
                    if line.startswith("READY"):
                        break
                else:
                    raise SystemExit(f"the server exited before it was ready (exit {srv.wait()})")
                steps = max(20, args.steps if n == 1 else args.steps // 5)
                proc = psutil.Process(srv.pid)
                cpu0, wall0 = sum(proc.cpu_times()[:2]), time.monotonic()
                client = run_client(endpoint, n, steps, args.transport, args.in_place, args.gap_ms, args.client_spin_ms)
                cpu, wall = sum(proc.cpu_times()[:2]) - cpu0, time.monotonic() - wall0
                srv.send_signal(signal.SIGUSR1)
                try:
                    srv.wait(timeout=10)
                except subprocess.TimeoutExpired:  # a model server: it stops on SIGTERM, then writes its marks
                    srv.terminate()
                    srv.wait(timeout=60)
                with open(marks) as f:
                    server = json.load(f)
            finally:
                if srv.poll() is None:
                    srv.kill()
            res = align(client, server, steps // 10)
            res["server_cpu_ms_per_step"] = round(cpu * 1000.0 / steps, 3)  # every thread of its process
            res["wall_ms_per_step"] = round(wall * 1000.0 / steps, 3)
            report["runs"][str(n)] = res
            print(
                f"sessions {n}: {res['aligned_steps']} steps aligned (us, median); server CPU "
                f"{res['server_cpu_ms_per_step']} ms a step of {res['wall_ms_per_step']} ms"
            )
            for path in ("engine", "io"):
                if path in res:
                    print(f"  {res[path]['steps']} read by the {'idle engine' if path == 'engine' else 'I/O thread'}")
                    for k, v in res[path].items():
                        if k != "steps":
                            print(f"    {k:52s} {v:8.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
