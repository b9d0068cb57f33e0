"""The engine's own host work per decode step, with no drafter work: what a Step of N entries costs
the engine thread between the socket and the GPU.

One client's Step of N sessions (3 new rows and 7 drafts each, positions advancing) is handed to
``Engine`` the way the router hands admitted work over (``submit``), then the engine queues it
(``_drain_inbox``: binding each entry to its session) and runs one iteration (``_iteration``:
batch forming, placement, the drafter call, results, the reply), with a drafter that does nothing
(fixed drafts), so only the engine's bookkeeping is timed. Medians over ``--steps`` steps per N,
after a warm-up. CPU only; no socket, no GPU.

    python -m draft_tools.bench.engine_step --sessions 1,16,64 --out bench/results/engine_step_cpu.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np

from draft_server.engine.scheduler import Engine
from draft_server.engine.types import Call, Work
from draft_server.metrics import ServerMetrics
from draft_tools.bench.rpc import noop_drafter
from draft_tools.common import write_report
from protocol import GREEDY, Phase

ROWS, K = 3, 7


NoopDrafter = noop_drafter()


def measure(n: int, steps: int, warm: int = 50, predicted: bool = False) -> dict[str, Any]:
    d = NoopDrafter(capacity_tokens=1 << 24)
    replies: list[Any] = []
    eng = Engine(
        d, ServerMetrics(), lambda ident, msg, payloads: replies.append(msg), "e", "c",
        max_sessions=max(n, 1), max_queue_rows=1 << 30, max_batch_rows=4096, max_batch_sessions=max(n, 1),
        prefill_chunk_rows=512, batch_window_ms=0.0, session_ttl_s=600.0,
    )  # fmt: skip
    taps = np.zeros((n, ROWS, d.contract.tap_width), np.uint16)
    pos = [0] * n
    queue_s: list[float] = []
    batch_s: list[float] = []
    for i in range(warm + steps):
        now = time.monotonic()
        assert eng.admission.try_admit_rows(b"client", n * ROWS)
        if predicted:  # the span's early taps first (queued, untimed), then the commit the timing is of
            early = Call(b"client", 2 * i + 1, now, now + 1.0, [None] * n, remaining=n, commit_follows=True)
            eng.submit(
                [
                    Work(early, j, f"s{j}", pos[j], taps[j], 0, 0, GREEDY, pos[j] + ROWS, phase=Phase.TAPS)
                    for j in range(n)
                ]
            )
            eng._drain_inbox()
            if early.remaining:
                raise RuntimeError(f"step {i}'s early taps were not acknowledged when queued")
            call = Call(b"client", 2 * i + 2, now, now + 1.0, [None] * n, remaining=n)
            works = [
                Work(
                    call,
                    j,
                    f"s{j}",
                    pos[j] + ROWS,
                    None,
                    7,
                    K,
                    GREEDY,
                    pos[j] + ROWS,
                    phase=Phase.COMMIT,
                    after=early.call_id,
                )
                for j in range(n)
            ]
        else:
            call = Call(b"client", i + 1, now, now + 1.0, [None] * n, remaining=n)
            works = [Work(call, j, f"s{j}", pos[j], taps[j], 7, K, GREEDY, pos[j] + ROWS) for j in range(n)]
        for j in range(n):
            pos[j] += ROWS
        t0 = time.perf_counter()
        eng.submit(works)
        eng._drain_inbox()
        t1 = time.perf_counter()
        eng._iteration()
        t2 = time.perf_counter()
        if call.remaining:
            raise RuntimeError(f"step {i} of {n} sessions was not answered in one iteration")
        if i >= warm:
            queue_s.append(t1 - t0)
            batch_s.append(t2 - t1)
        eng._flush_metrics()
    return {
        "sessions": n,
        "mode": "predicted commit" if predicted else "single message",
        "queue_us": statistics.median(queue_s) * 1e6,
        "iteration_us": statistics.median(batch_s) * 1e6,
        "total_us": statistics.median(a + b for a, b in zip(queue_s, batch_s, strict=True)) * 1e6,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", default="1,16,64")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument(
        "--predicted", action="store_true", help="each step's rows as early taps first, then a commit (what is timed)"
    )
    ap.add_argument("--out", default="bench/results/engine_step_cpu.json")
    args = ap.parse_args()
    rows = [measure(int(n), args.steps, predicted=args.predicted) for n in args.sessions.split(",")]
    for r in rows:
        print(
            f"{r['mode']}, {r['sessions']:3d} sessions: queue {r['queue_us']:7.1f} us  "
            f"iteration {r['iteration_us']:7.1f} us  total {r['total_us']:7.1f} us"
        )
    report = {
        "command": "python -m draft_tools.bench.engine_step " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rows": rows,
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
