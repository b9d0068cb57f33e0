"""Early taps vs the single message in a real vLLM engine (CPU, the tiny trained pair): per step.

One run starts `draft-server serve` on the shipped tiny DSpark drafter, then four vLLM engines
in turn (each its own subprocess, ``draft_tools.demo.part_vllm --worker``) on the same greedy
prompts: remote drafts with early taps and predicted commits (the default), with early taps
committing only after sampling (``DRAFT_PREDICTED_COMMIT=0``), with the single message
(``DRAFT_EARLY_TAPS=0``), and no speculation. From the proposer's ``step_phases()`` it reports,
per mode, the distribution over engine steps of

* ``forward``: scheduler output to the end of the target's forward (``execute_model``),
* ``taps``: sending the early taps (gather-free slice, encode, hand to the I/O thread),
* ``sample``: from there to ``propose``: sampling, rejection, bookkeeping,
* ``wait``: the critical-path draft wait, commit (or single message) to drafts in hand,
* ``server``: the server's compute for that reply (``Timing.compute_ms``),
* ``overhead``: wait - server, what the hop adds above the server's compute,

plus vLLM's acceptance counters, the predicted commits kept and missed, the rows the early taps
carried against the rows committed, and whether every output equals plain decoding. Writes JSON
(with the command and the machine) to ``--out``. Timings on a shared 2-core CPU show the shape,
not GPU speed.

    python -m draft_tools.bench.early_taps --out bench/results/early_taps_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

import numpy as np

from draft_tools.common import start_server, stop_server
from draft_tools.demo.part_vllm import PROMPTS, _acceptance, _run_worker
from draft_tools.tiny_pair.pair import ASSET_DIR as ASSETS

PHASES = ("forward", "taps", "sample", "wait", "server", "overhead")
# (name, DRAFT_EARLY_TAPS, DRAFT_PREDICTED_COMMIT)
MODES = (("predicted_commit", "1", "1"), ("early_taps", "1", "0"), ("single_message", "0", "0"))


def summarize(phases: list[dict[str, float]]) -> dict[str, Any]:
    """Per phase p50 / p90 / mean (ms) over the engine steps that asked for drafts and got a reply."""
    rows = [p for p in phases if p["server"] >= 0]
    out: dict[str, Any] = {"steps": len(phases), "steps_with_reply": len(rows)}
    for name in PHASES:
        v = np.array([p["wait"] - p["server"] if name == "overhead" else p[name] for p in rows], dtype=np.float64)
        if len(v):
            out[name] = {
                "p50": round(float(np.percentile(v, 50)), 3),
                "p90": round(float(np.percentile(v, 90)), 3),
                "mean": round(float(v.mean()), 3),
            }
    return out


def run(k: int, max_tokens: int, budget_ms: float) -> dict[str, Any]:
    draft, target = ASSETS / "draft", ASSETS / "target"
    proc, endpoint, _ = start_server(
        ["--model", str(draft), "--target-model", str(target), "--device", "cpu", "--dtype", "float32"]
    )
    env = {**os.environ, "DRAFT_SERVER_ENDPOINT": endpoint, "DRAFT_BUDGET_MS": str(budget_ms)}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = {"target": str(target), "prompts": PROMPTS, "max_tokens": max_tokens}
    modes: dict[str, Any] = {}
    try:
        for name, early, predicted in MODES:
            mode_env = {**env, "DRAFT_EARLY_TAPS": early, "DRAFT_PREDICTED_COMMIT": predicted}
            res = _run_worker({**cfg, "k": k, "phases": True}, mode_env)
            drafts, rate, mal = _acceptance(res)
            d = res.get("drafter", {})
            modes[name] = {
                "ids": res["ids"],
                "acceptance": {"drafts": drafts, "rate": round(rate, 4), "mean_acceptance_length": round(mal, 4)},
                "per_step_ms": summarize(res.get("phases", [])),
                "early_steps": sum(int(p["early"]) for p in res.get("phases", [])),
                "predicted": {k: d.get(f"predicted_{k}", 0) for k in ("commits", "hits", "misses", "rows_again")},
                # rows the early taps carried (every verified row, or with predictions only up to the
                # predicted ends) against the rows the steps committed
                "taps_rows": d.get("taps_rows", 0),
                "committed_rows": d.get("rows_sent", 0),
                "phases": res.get("phases", []),
            }
        plain = _run_worker(cfg, env)
    finally:
        stop_server(proc)
    for m in modes.values():
        m["equal_to_plain"] = m.pop("ids") == plain["ids"]
    return modes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budget-ms", type=float, default=200.0)
    ap.add_argument("--out", default="bench/results/early_taps_cpu.json")
    a = ap.parse_args(argv)
    modes = run(a.k, a.max_tokens, a.budget_ms)
    report = {
        "command": "python -m draft_tools.bench.early_taps " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "setup": {"k": a.k, "max_tokens": a.max_tokens, "prompts": len(PROMPTS), "budget_ms": a.budget_ms},
        "modes": modes,
    }
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    for name, m in modes.items():
        s = m["per_step_ms"]
        line = ", ".join(f"{p} p50 {s[p]['p50']:.2f}" for p in PHASES if p in s)
        print(
            f"{name}: equal to plain {m['equal_to_plain']}, MAL {m['acceptance']['mean_acceptance_length']}, "
            f"predicted {m['predicted']}, taps rows {m['taps_rows']} for {m['committed_rows']} committed: {line}"
        )
    return 0 if all(m["equal_to_plain"] for m in modes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
