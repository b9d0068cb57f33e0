"""Demo part 2: many synthetic target engines against one draft server.

`draft-server serve` on loopback (the deterministic checksum drafter, so it runs anywhere) and
several synthetic target engines — each its own
DraftClient, many sessions, staggered arrivals, prefills, decode steps committing 1..k+1 rows,
finishes with Free — then per-step latency percentiles and throughput per engine, the
server's own numbers from /metrics, and a check that no session is left behind.
"""

from __future__ import annotations

import threading
import time

from draft_tools.common import label_values, scrape, start_server, stop_server
from draft_tools.synthetic import SyntheticTarget, summarize
from target_client import ClientConfig, DraftClient


def run(
    engines: int = 2,
    sessions: int = 8,
    total_sessions: int = 96,
    budget_ms: float = 50.0,
    duration_s: float = 8.0,
    server_args: list[str] | None = None,
) -> bool:
    """Part 2; True when every draft was valid and no session was left behind."""
    server_args = server_args or ["--drafter", "checksum"]
    print(f"== starting draft server: draft-server serve {' '.join(server_args)}")
    proc, endpoint, mport = start_server(server_args)
    print(f"   endpoint {endpoint}, metrics http://127.0.0.1:{mport}/metrics")
    clients, targets, threads = [], [], []
    try:
        for i in range(engines):
            c = DraftClient(ClientConfig(endpoint=endpoint, budget_ms=budget_ms, name=f"engine-{i}"))
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
                sessions=sessions,
                total_sessions=total_sessions,
                seed=i,
                decode_steps=(15, 40),
            )
            clients.append(c)
            targets.append(t)
            threads.append(threading.Thread(target=t.run, kwargs={"duration_s": duration_s}))
        print(f"== {engines} engines x {sessions} concurrent sessions, budget {budget_ms} ms")
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
    entries = {k: int(v) for k, v in label_values(met, "draft_server_entries_total", "status").items() if v}
    lat_count = met["draft_server_step_duration_seconds_count"]
    lat_sum = met["draft_server_step_duration_seconds_sum"]
    print("== server (/metrics)")
    print(
        f"   steps {int(lat_count)}, mean receive-to-reply {1000 * lat_sum / max(lat_count, 1):.3f} ms, "
        f"rows ingested {int(met['draft_server_rows_ingested_total'])}, "
        f"drafted tokens {int(met['draft_server_drafted_tokens_total'])}"
    )
    print(f"   entries by status {entries}; live sessions now {int(met['draft_server_sessions'])}")
    stop_server(proc)
    print(f"== server stopped (exit {proc.returncode}); demo {'OK' if not met['draft_server_sessions'] else 'LEAK'}")
    return met["draft_server_sessions"] == 0 and s["bad_tokens"] == 0
