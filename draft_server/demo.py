"""`make demo`: remote drafts inside vLLM, then many engines against one draft server.

Part 1 (`demo_vllm`): vLLM on CPU with the shipped tiny trained pair, with and without remote
drafts, outputs compared. Part 2, here: `draft-server serve` on loopback (the deterministic
checksum drafter, so it runs anywhere) and several synthetic target engines — each its own
DraftClient, many sessions, staggered arrivals, prefills, decode steps committing 1..k+1 rows,
finishes with Free — then per-step latency percentiles and throughput per engine, the
server's own numbers from /metrics, and a check that no session is left behind.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from target_client import ClientConfig, DraftClient
from target_client.synthetic import SyntheticTarget, summarize


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str, int]:
    port, mport = _free_port(), _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "draft_server",
        "serve",
        "--bind",
        endpoint,
        "--metrics-port",
        str(mport),
        "--log-level",
        "WARNING",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("READY"):
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining
            return proc, endpoint, mport
        print("  server:", line.rstrip())
    proc.kill()
    raise SystemExit("draft server did not start")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=2, help="synthetic target engines (one DraftClient each)")
    ap.add_argument("--sessions", type=int, default=8, help="concurrent sessions per engine")
    ap.add_argument("--total-sessions", type=int, default=96, help="sessions per engine over the run")
    ap.add_argument("--budget-ms", type=float, default=50.0, help="per-step draft budget")
    ap.add_argument("--duration-s", type=float, default=8.0, help="stop after this long")
    ap.add_argument("--server-arg", action="append", default=[], help="extra draft-server serve flag (repeatable)")
    ap.add_argument(
        "--part",
        choices=["all", "vllm", "load"],
        default="all",
        help="vllm: remote drafts inside vLLM; load: many synthetic engines; all: both",
    )
    args = ap.parse_args(argv)
    same = True
    if args.part in ("all", "vllm"):
        from draft_server.demo_vllm import run as run_vllm

        print("#### part 1: a real vLLM engine (CPU) with remote DSpark drafts")
        same = run_vllm()
        if args.part == "vllm":
            return 0 if same else 1
        print("#### part 2: concurrency — synthetic target engines against one draft server")
    server_args = args.server_arg or ["--drafter", "checksum"]
    print(f"== starting draft server: draft-server serve {' '.join(server_args)}")
    proc, endpoint, mport = start_server(server_args)
    print(f"   endpoint {endpoint}, metrics http://127.0.0.1:{mport}/metrics")
    clients, targets, threads = [], [], []
    try:
        for i in range(args.engines):
            c = DraftClient(ClientConfig(endpoint=endpoint, budget_ms=args.budget_ms, name=f"engine-{i}"))
            welcome = c.connect(wait=True)
            assert welcome is not None
            if i == 0:
                ct = welcome.contract
                print(
                    f"   model {ct.model_name}: taps {list(ct.tap_layer_ids)} x {ct.target_hidden_size}, "
                    f"vocab {ct.vocab_size}, block {ct.block_size}, epoch {welcome.epoch}"
                )
            t = SyntheticTarget(
                c,
                welcome.contract,
                name=f"engine-{i}",
                sessions=args.sessions,
                total_sessions=args.total_sessions,
                seed=i,
                decode_steps=(15, 40),
            )
            clients.append(c)
            targets.append(t)
            threads.append(threading.Thread(target=t.run, kwargs={"duration_s": args.duration_s}))
        print(f"== {args.engines} engines x {args.sessions} concurrent sessions, budget {args.budget_ms} ms")
        t0 = time.perf_counter()
        for th in threads:
            th.start()
            time.sleep(0.02)  # staggered engines
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        print(
            f"{'engine':10s} {'calls':>6s} {'entries':>8s} {'p50 ms':>8s} {'p90 ms':>8s} {'p99 ms':>8s} "
            f"{'max ms':>8s} {'calls/s':>8s} {'drafts/s':>9s} {'fallback':>9s}"
        )
        total = []
        for t in targets:
            s = summarize(t.records)
            total += t.records
            print(
                f"{t.name:10s} {s['calls']:6d} {s['entries']:8d} {s['wait_ms_p50']:8.3f} {s['wait_ms_p90']:8.3f} "
                f"{s['wait_ms_p99']:8.3f} {s['wait_ms_max']:8.3f} {s['calls_per_s']:8.1f} "
                f"{s['tokens_per_s']:9.0f} {s['fallback_entries']:9d}"
            )
        s = summarize(total)
        print(
            f"{'all':10s} {s['calls']:6d} {s['entries']:8d} {s['wait_ms_p50']:8.3f} {s['wait_ms_p90']:8.3f} "
            f"{s['wait_ms_p99']:8.3f} {s['wait_ms_max']:8.3f} {s['calls'] / wall:8.1f} "
            f"{s['tokens'] / wall:9.0f} {s['fallback_entries']:9d}"
        )
        print(f"   statuses {s['statuses']}; invalid drafts {s['bad_tokens']}")
    finally:
        for c in clients:
            c.close()
    deadline = time.monotonic() + 10
    met = scrape(mport)
    while met["draft_server_sessions"] and time.monotonic() < deadline:
        time.sleep(0.1)
        met = scrape(mport)
    entries = {
        k.split("=")[1].rstrip("}"): int(v) for k, v in met.items() if k.startswith("draft_server_entries_total{") and v
    }
    lat_count = met["draft_server_step_duration_seconds_count"]
    lat_sum = met["draft_server_step_duration_seconds_sum"]
    print("== server (/metrics)")
    print(
        f"   steps {int(lat_count)}, mean receive-to-reply {1000 * lat_sum / max(lat_count, 1):.3f} ms, "
        f"rows ingested {int(met['draft_server_rows_ingested_total'])}, "
        f"drafted tokens {int(met['draft_server_drafted_tokens_total'])}"
    )
    print(f"   entries by status {entries}; live sessions now {int(met['draft_server_sessions'])}")
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    print(f"== server stopped (exit {proc.returncode}); demo {'OK' if not met['draft_server_sessions'] else 'LEAK'}")
    return 0 if same and met["draft_server_sessions"] == 0 and s["bad_tokens"] == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
