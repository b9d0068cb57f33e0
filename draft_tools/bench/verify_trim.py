"""Load-aware verification on the tiny pair in vLLM (CPU): generated tokens per second with and
without draft trimming at 1, 4 and 16 concurrent requests, and acceptance per draft position.

One draft server (the shipped tiny drafter with its confidence head, float32) and one vLLM engine
(in-process core, the ``custom_class`` proposer, k drafts per step) serve every measurement, so
both policies see the same warm engine; trimming is switched per run on the proposer
(``Verifier.enabled``, the switch ``DRAFT_TRIM=0`` sets). Each round runs every load once with
trimming on and once off, alternating which goes first, so drift of the shared machine hits both
alike; the summary takes per-load medians over rounds and the median of the per-round ratios
(trim / no trim, measured back to back: the comparison least hurt by other work on the machine)
with its 95% bootstrap interval; ``trim_never_slower`` holds when at no load that interval lies
wholly below 1.
A plain engine (no speculation) runs the same loads afterwards for scale. Greedy outputs of every
speculative run are checked equal to the plain engine's.

Run: ``python -m draft_tools.bench.verify_trim`` (a few minutes on 2 cores); writes
``bench/results/verify_trim_cpu.json`` and ``verify_trim_cpu.png`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from draft_tools.common import start_server, stop_server
from draft_tools.tiny_pair.pair import ASSET_DIR

PROPOSER = "target_client.vllm.proposer.RemoteDSparkProposer"
ROOT = Path(__file__).resolve().parents[2]


def _prompts(n: int) -> list[list[int]]:
    """n distinct 32-token prompts cut from the pair's held-out prompts (two windows of each)."""
    held = [p["ids"] for p in json.loads((ASSET_DIR / "eval_prompts.json").read_text())]
    windows = [ids[o : o + 32] for o in (0, 16) for ids in held]
    assert n <= len(windows), n
    return windows[:n]


def _set_trim(worker: Any, on: bool) -> None:
    worker.model_runner.drafter.verifier.enabled = on


def _verify_stats(worker: Any) -> dict[str, Any]:
    return worker.model_runner.drafter.stats()


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Inside a subprocess: one engine, every measurement."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process core: the proposer is reachable
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = cfg["k"] > 0
    kw: dict[str, Any] = dict(
        model=cfg["target"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=max(cfg["loads"]),
        seed=0,
        disable_log_stats=False,
    )
    if spec:
        kw["speculative_config"] = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": cfg["k"]}
    llm = LLM(**kw)
    params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True, detokenize=False)

    def one(load: int) -> tuple[float, list[list[int]]]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(load)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        return dt, [list(o.outputs[0].token_ids) for o in outs]

    def spec_counts() -> dict[str, Any]:
        got: dict[str, Any] = {}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode"):
                got[m.name] = getattr(m, "value", None) if hasattr(m, "value") else list(getattr(m, "values", []))
        return got

    runs: list[dict[str, Any]] = []
    outputs: dict[int, list[list[int]]] = {}
    for load in cfg["loads"]:  # warm-up: every shape once
        outputs[load] = one(load)[1]
    modes = [True, False] if spec else [None]
    for r in range(cfg["rounds"]):
        for load in cfg["loads"]:
            order = modes if r % 2 == 0 else modes[::-1]
            for trim in order:
                if trim is not None:
                    llm.collective_rpc(_set_trim, args=(trim,))
                    before, sd0 = llm.collective_rpc(_verify_stats)[0]["verify"], spec_counts()
                dt, outs = one(load)
                run: dict[str, Any] = {"round": r, "load": load, "trim": trim, "seconds": round(dt, 4)}
                run["tokens"] = sum(len(o) for o in outs)
                run["tokens_per_s"] = round(run["tokens"] / dt, 2)
                run["same_as_warmup"] = outs == outputs[load]
                if trim is not None:
                    after, sd1 = llm.collective_rpc(_verify_stats)[0]["verify"], spec_counts()
                    run["per_position"] = {
                        s: [a - (before["per_position"][s][j] if j < len(before["per_position"][s]) else 0)
                            for j, a in enumerate(after["per_position"][s])]
                        for s in after["per_position"]
                    }  # fmt: skip
                    run["trimmed_drafts"] = after["trimmed_drafts"] - before["trimmed_drafts"]
                    run["trimmed_steps"] = after["trimmed_steps"] - before["trimmed_steps"]
                    run["planned_steps"] = after["planned_steps"] - before["planned_steps"]
                    run["cost_model"] = {k: after[k] for k in ("cost_base_ms", "cost_per_token_ms", "fixed_ms")}
                    run["vllm_drafts"] = (sd1.get("vllm:spec_decode_num_drafts") or 0) - (
                        sd0.get("vllm:spec_decode_num_drafts") or 0
                    )
                    run["vllm_accepted"] = (sd1.get("vllm:spec_decode_num_accepted_tokens") or 0) - (
                        sd0.get("vllm:spec_decode_num_accepted_tokens") or 0
                    )
                runs.append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "per_position"}), file=sys.stderr, flush=True)
    res: dict[str, Any] = {"runs": runs, "outputs": {str(k): v for k, v in outputs.items()}}
    if spec:
        res["proposer"] = llm.collective_rpc(_verify_stats)[0]
    return res


def _run_worker(cfg: dict[str, Any], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "draft_tools.bench.verify_trim", "--worker", json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=None,  # the runs' progress lines and vLLM's logs go to the terminal
        text=True,
        env=env,
        timeout=timeout_s,
    )
    for line in out.stdout.splitlines():
        if line.startswith("@@"):
            return json.loads(line[2:])
    raise SystemExit(f"vLLM worker failed (exit {out.returncode}):\n{out.stdout[-3000:]}")


def median_ci(xs: list[float], n: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``xs`` (percentile method, seeded)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def summarise(spec: dict[str, Any], plain: dict[str, Any], loads: list[int]) -> list[dict[str, Any]]:
    rows = []
    for load in loads:
        row: dict[str, Any] = {"load": load}
        for name, trim in (("trim", True), ("no_trim", False)):
            runs = [r for r in spec["runs"] if r["load"] == load and r["trim"] is trim]
            row[f"{name}_tokens_per_s"] = round(statistics.median(r["tokens_per_s"] for r in runs), 2)
            row[f"{name}_samples"] = [r["tokens_per_s"] for r in runs]
            pp = {
                s: [sum(x) for x in zip(*(r["per_position"][s] for r in runs), strict=False)]
                for s in runs[0]["per_position"]
            }
            steps = sum(r["vllm_drafts"] for r in runs)
            row[f"{name}_per_position"] = pp
            row[f"{name}_accepted_per_received"] = [
                round(a / max(1, n), 4) for a, n in zip(pp["accepted"], pp["received"], strict=False)
            ]
            row[f"{name}_accepted_per_sent"] = [
                round(a / max(1, n), 4) for a, n in zip(pp["accepted"], pp["sent"], strict=False)
            ]
            row[f"{name}_mean_acceptance_length"] = round(1 + sum(r["vllm_accepted"] for r in runs) / max(1, steps), 4)
            row[f"{name}_trimmed_drafts"] = sum(r.get("trimmed_drafts", 0) for r in runs)
        by_round = {(r["round"], r["trim"]): r["tokens_per_s"] for r in spec["runs"] if r["load"] == load}
        rounds = sorted({i for i, _ in by_round})
        ratios = sorted(by_round[(i, True)] / by_round[(i, False)] for i in rounds)
        row["paired_ratio_median"] = round(statistics.median(ratios), 4)  # trim / no trim, same round
        row["paired_ratio_ci95"] = [round(x, 4) for x in median_ci(ratios)]
        row["paired_ratios"] = [round(x, 4) for x in ratios]
        runs = [r for r in plain["runs"] if r["load"] == load]
        row["plain_tokens_per_s"] = round(statistics.median(r["tokens_per_s"] for r in runs), 2)
        row["trim_over_no_trim"] = round(row["trim_tokens_per_s"] / row["no_trim_tokens_per_s"], 4)
        rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: Path, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = list(range(len(rows)))
    w = 0.27
    for off, key, label in (
        (-w, "no_trim", "drafts, no trimming"),
        (0, "trim", "drafts, load-aware trimming"),
        (w, "plain", "no speculation"),
    ):
        a.bar([i + off for i in x], [r[f"{key}_tokens_per_s"] for r in rows], w, label=label)
    a.set_xticks(x, [f"{r['load']} concurrent" for r in rows])
    a.set_ylabel("generated tokens / s (median over rounds)")
    a.set_title(f"tiny pair, vLLM CPU, k={k}")
    a.legend(fontsize=8)
    for r in rows:
        pos = range(1, len(r["trim_accepted_per_received"]) + 1)
        b.plot(pos, r["no_trim_accepted_per_received"], "o-", label=f"{r['load']} conc., no trim")
        b.plot(pos, r["trim_accepted_per_received"], "x--", label=f"{r['load']} conc., trim")
    b.set_xlabel("draft position")
    b.set_ylabel("accepted / received drafts")
    b.set_ylim(0, 1)
    b.set_title("acceptance per position")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, default=5, help="drafts per step (the tiny drafter's block size)")
    ap.add_argument("--loads", default="1,4,16", help="concurrent requests")
    ap.add_argument("--max-tokens", type=int, default=96, help="generated tokens per request")
    ap.add_argument("--rounds", type=int, default=12, help="runs per load and policy")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "verify_trim_cpu.json")
    args = ap.parse_args(argv)
    if args.worker:
        sys.stdout.write("@@" + json.dumps(worker(json.loads(args.worker))) + "\n")
        return 0
    loads = [int(x) for x in args.loads.split(",")]
    draft, target = ASSET_DIR / "draft", ASSET_DIR / "target"
    t0 = time.time()
    proc, endpoint, _ = start_server(
        ["--model", str(draft), "--target-model", str(target), "--device", "cpu", "--dtype", "float32"]
    )
    env = {**os.environ, "DRAFT_SERVER_ENDPOINT": endpoint, "DRAFT_BUDGET_MS": "500", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cfg = {"target": str(target), "loads": loads, "max_tokens": args.max_tokens, "rounds": args.rounds}
    try:
        spec = _run_worker({**cfg, "k": args.k}, env, 1800)
    finally:
        stop_server(proc)
    plain = _run_worker({**cfg, "k": 0, "rounds": max(1, args.rounds // 2)}, env, 900)
    rows = summarise(spec, plain, loads)
    equal = spec["outputs"] == plain["outputs"] and all(r["same_as_warmup"] for r in spec["runs"])
    report = {
        "what": "tokens/s with and without load-aware draft trimming (target_client.trim) on the tiny pair, vLLM CPU",
        "command": "python -m draft_tools.bench.verify_trim " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {
            "k": args.k,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "prompt_tokens": 32,
            "server": "tiny drafter + confidence head, float32, CPU, same host",
            "budget_ms": 500,
        },
        "greedy_outputs_equal_plain": equal,
        "summary": rows,
        # Trimming and not trimming alternate within each round, so machine drift cancels in the
        # per-round ratio; "never slower" = at no load is the paired median significantly below 1
        # (its 95% interval reaches 1). The unpaired medians are kept beside it.
        "trim_never_slower": all(r["paired_ratio_ci95"][1] >= 1.0 for r in rows),
        "unpaired_medians_never_slower": all(r["trim_tokens_per_s"] >= r["no_trim_tokens_per_s"] for r in rows),
        "proposer_final": spec.get("proposer", {}).get("verify"),
        "runs": spec["runs"],
        "plain_runs": plain["runs"],
        "seconds": round(time.time() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"), args.k)
    for r in rows:
        print(
            f"load {r['load']:3d}: trim {r['trim_tokens_per_s']:8.1f} tok/s, no trim {r['no_trim_tokens_per_s']:8.1f}, "
            f"plain {r['plain_tokens_per_s']:8.1f}; paired trim/no-trim median {r['paired_ratio_median']:.3f} "
            f"(95% {r['paired_ratio_ci95'][0]:.3f}-{r['paired_ratio_ci95'][1]:.3f}); "
            f"trimmed drafts {r['trim_trimmed_drafts']}; "
            f"accepted/received per position (no trim) {r['no_trim_accepted_per_received']}"
        )
    print(f"greedy outputs equal plain: {equal}; wrote {args.out} and {args.out.with_suffix('.png').name}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
