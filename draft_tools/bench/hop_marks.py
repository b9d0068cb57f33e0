"""Where a Step's round trip goes, segment by segment, on both sides of the hop (issue 12).

A no-op drafter server (``draft-bench --serve --noop``: the hop's and the server's own host work only)
runs in a child process with timestamps taken at fixed points of its code; a ``DraftClient`` in this
process takes its own. Both read ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for every
process of the host), so each step's marks line up into one timeline:

    client: enter step() | send() | sent || server: engine_serve | header read | Step admitted |
    engine_serve done | inbox drained | batch | drafter | reply | send() | sent || client: reply read |
    return

(2-core VM, one K3 session, rows in place, at e61706b: the client's own work 43 us before its send and 58
after the reply; each ``send()`` 40-45 us; the server 14 us to read the header, 44 to admit the Step,
14 to form the batch, 9 from reply to send)

and the table gives each segment's median (us). Each session's steps append their rows (``rpc.appending``;
runs before 2026-12-07 overwrote positions [0, 3) every step). The marks wrap methods of the shipped code (nothing in
the product changes); each costs well under a microsecond. Only Steps the idle engine reads itself are
aligned (one client, back to back: all of them, but for the rare one the I/O thread takes).

    python -m draft_tools.bench.hop_marks [--sessions 1,64] [--transport shm] [--in-place] [--steps 3000]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

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


def serve(endpoint: str, out: str) -> None:
    """The no-op server with marks (child process): writes them to ``out`` (JSON) on SIGUSR1."""
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
    noop = rpc.noop_drafter

    def marked_noop() -> type:
        base = noop()

        class Marked(base):  # type: ignore[misc,valid-type]
            def step(self, ingest: Any, drafts: Any) -> Any:
                marks["drafter"].append(pc())
                return super().step(ingest, drafts)

        return Marked

    rpc.noop_drafter = marked_noop

    def dump(*_: Any) -> None:
        with open(out, "w") as f:
            json.dump(marks, f)
        os._exit(0)

    signal.signal(signal.SIGUSR1, dump)
    rpc.serve_checksum(endpoint, noop=True)


def run_client(endpoint: str, n: int, steps: int, transport: str, in_place: bool) -> dict[str, list[float]]:
    """``steps`` back-to-back Steps of n sessions, 3 K3-sized rows each; the client's marks per step."""
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
    cfg = ClientConfig(endpoint=endpoint, budget_ms=1000.0, name="marks", transport=transport, shm_ring_mib=64)
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
    finally:
        requests.close()
        client.close()
        io_loop.IoLoop._try_send, io_loop.IoLoop._on_bufs = send, recv  # type: ignore[method-assign]
    return out


def align(client: dict[str, list[float]], server: dict[str, list[float]], skip: int) -> dict[str, float]:
    """Median us of each segment over the steps whose server marks all fall between the client's send
    and its reply read, in order (the idle engine's path)."""
    names = ["client.enter", "client.send", "client.sent"] + [f"server.{name}" for name, _, _ in SERVER_MARKS]
    names += ["client.reply_read", "client.return"]
    srv = {k: np.asarray(v) for k, v in server.items()}
    rows = []
    for i in range(skip, len(client["enter"])):
        a, b = client["sent"][i], client["reply_read"][i]
        if not (a == a and b == b):  # nan: a step that never went out
            continue
        t = [client["enter"][i], client["send"][i], a]
        prev = a
        for name, _, _ in SERVER_MARKS:
            arr = srv[name]
            j = int(np.searchsorted(arr, prev))
            if j >= len(arr) or arr[j] > b:
                break
            prev = float(arr[j])
            t.append(prev)
        else:
            t += [b, client["return"][i]]
            rows.append(np.diff(np.asarray(t)))
    if not rows:
        return {"aligned_steps": 0}
    med = np.median(np.asarray(rows), axis=0) * 1e6
    res = {f"{names[j]} -> {names[j + 1]}": round(float(v), 1) for j, v in enumerate(med)}
    res["total"] = round(float(np.median([r.sum() for r in rows]) * 1e6), 1)
    res["aligned_steps"] = len(rows)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", default="1,64")
    ap.add_argument("--transport", default="shm", choices=("frames", "shm"))
    ap.add_argument("--in-place", action="store_true", help="rows written into a region of the ring (shm)")
    ap.add_argument("--steps", type=int, default=3000, help="steps per session count (the first 10%% untimed)")
    ap.add_argument("--out", default="")
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)  # ENDPOINT OUT: the marked server
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
        "rows": "3 K3-sized rows (5 x 7168 bf16) per session; no-op drafter",
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(s) for s in args.sessions.split(",")]:
            endpoint, marks = f"ipc://{tmp}/s{n}.sock", os.path.join(tmp, f"marks{n}.json")
            cmd = [sys.executable, "-m", "draft_tools.bench.hop_marks", "--serve", endpoint, marks]
            srv = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                assert srv.stdout is not None and srv.stdout.readline().startswith("READY")
                steps = max(20, args.steps if n == 1 else args.steps // 5)
                client = run_client(endpoint, n, steps, args.transport, args.in_place)
                srv.send_signal(signal.SIGUSR1)
                srv.wait(timeout=30)
                with open(marks) as f:
                    server = json.load(f)
            finally:
                if srv.poll() is None:
                    srv.kill()
            res = align(client, server, steps // 10)
            report["runs"][str(n)] = res
            print(f"sessions {n}: {res.get('aligned_steps', 0)} steps aligned (us, median)")
            for k, v in res.items():
                if k != "aligned_steps":
                    print(f"  {k:52s} {v:8.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
