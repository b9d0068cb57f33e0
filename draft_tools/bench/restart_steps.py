"""The first steps after a server restart, over transport shm: how long they wait, and for what.

Runs ``draft_tools.soak`` with the shm soak smoke's settings (``tests/soak/test_soak_smoke.py``: 2
engines x 8 sessions, rows written in place in the client's ring, early taps, server kills every
9 s, pauses, drops, NaN taps, stale storms) once per ``--seeds``, keeps its raw records, and for
every READY after a kill and every engine reports the first ``--first`` calls that start after it:
their wait, the calling thread's own CPU time during the call (what the client did on the caller's
thread, not the server), and the steps until drafts came back (the soak's ``resume_after_restart``
allows 2). Writes JSON (command, machine, per restart and a summary) to ``--out``.

    python -m draft_tools.bench.restart_steps --seeds 5,6 --out bench/results/restart_steps_cpu.json

The A/B of a change: ``python -m draft_tools.bench.ab --base REV --rounds 3 --out FILE --
draft_tools.bench.restart_steps --seeds 5``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

# the shm soak smoke's settings (``tests/soak/test_soak_smoke.py`` runs them at seed 5)
SMOKE = [
    "--duration-s", "36", "--warmup-s", "3", "--cooldown-s", "5", "--transport", "shm", "--engines", "2",
    "--sessions", "8", "--chaos", "kill,pause,drop,taps,nan,stale", "--kill-every-s", "9", "--pause-every-s", "11",
    "--pause-ms", "500", "--drop-request-p", "0.01", "--drop-reply-p", "0.01", "--neighbour-every-s", "9",
]  # fmt: skip


def after_restarts(raw: str, first: int) -> list[dict[str, Any]]:
    """Per READY after a kill, per engine: the first ``first`` calls after it and the steps to drafts."""
    with open(glob.glob(os.path.join(raw, "result-*.json"))[0]) as f:
        run = json.load(f)
    engines = []
    for path in sorted(glob.glob(os.path.join(raw, "engine-*-1.json"))):
        with open(path) as f:
            e = json.load(f)
        cols = {c: i for i, c in enumerate(e["call_columns"])}
        engines.append((e["spec"]["index"], np.asarray(e["calls"], dtype=np.float64).reshape(-1, len(cols)), cols))
    out = []
    for ev in run["events"]:
        ready = ev["detail"].get("ready") if ev["kind"] == "kill" else None
        if not ready:
            continue
        for idx, calls, c in engines:
            after = calls[calls[:, c["t0"]] >= ready] if len(calls) else calls
            drafted = np.nonzero(after[:, c["drafted"]] > 0)[0] if len(after) else []
            out.append(
                {
                    "t_ready_s": round(ready - run["t_start"], 3),
                    "engine": idx,
                    "steps_to_drafts": int(drafted[0]) if len(drafted) else None,
                    "first_calls": [
                        {
                            "wait_ms": round(float(r[c["wait_ms"]]), 2),
                            "caller_cpu_ms": round(float(r[c["cpu_ms"]]), 2),
                            "drafted": int(r[c["drafted"]]),
                            "want": int(r[c["want"]]),
                        }
                        for r in after[:first]
                    ],
                }
            )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="5", help="comma list: one soak per seed")
    ap.add_argument("--first", type=int, default=3, help="calls reported after each READY")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    restarts: list[dict[str, Any]] = []
    invariants: dict[str, bool] = {}
    for seed in [int(s) for s in a.seeds.split(",")]:
        with tempfile.TemporaryDirectory(prefix="restart-steps-") as tmp:
            cmd = [sys.executable, "-m", "draft_tools.soak", *SMOKE, "--seed", str(seed)]
            cmd += ["--out", os.path.join(tmp, "out"), "--raw-dir", os.path.join(tmp, "raw")]
            subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            with open(os.path.join(tmp, "out", "soak.json")) as f:
                report = json.load(f)
            invariants[f"seed {seed}"] = bool(report["invariants"]["resume_after_restart"]["ok"])
            restarts += [dict(r, seed=seed) for r in after_restarts(os.path.join(tmp, "raw"), a.first)]
    firsts = [c for r in restarts for c in r["first_calls"]]
    steps = [r["steps_to_drafts"] for r in restarts if r["steps_to_drafts"] is not None]
    summary = {
        "restarts_x_engines": len(restarts),
        "resume_after_restart_held": invariants,
        "steps_to_drafts_max": max(steps, default=None),
        "steps_to_drafts_over_2": sum(s > 2 for s in steps),
        "first_calls_wait_ms_max": max((c["wait_ms"] for c in firsts), default=None),
        "first_calls_over_budget": sum(c["wait_ms"] > 20.0 for c in firsts),
        "first_calls_caller_cpu_ms_max": max((c["caller_cpu_ms"] for c in firsts), default=None),
        "first_calls_caller_cpu_over_10ms": sum(c["caller_cpu_ms"] > 10.0 for c in firsts),
    }
    report = {
        "command": " ".join([os.path.basename(sys.executable), "-m", "draft_tools.bench.restart_steps", *sys.argv[1:]]),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "soak_args": SMOKE,
        "summary": summary,
        "restarts": restarts,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
