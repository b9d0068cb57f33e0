"""The vLLM half of `make demo`: remote DSpark drafts inside a real vLLM engine (CPU).

Starts `draft-server serve` on the shipped tiny trained drafter (draft_tools/tiny_pair/assets),
runs vLLM with the `custom_class` proposer on a handful of prompts, then runs the same prompts
without speculation, and prints: the generated text, vLLM's own speculative-decoding counters
(drafts, draft tokens, accepted tokens, mean acceptance length), the client's RPC wait
percentiles, and whether the greedy outputs are identical. The speculative run repeats once per
wire format asked for (``--wire-formats``, default bf16 and fp8: ``DRAFT_WIRE_FORMAT``), and a
table compares their acceptance and bytes per row. Then a second draft server serves the shipped
4-bit EXL3 drafter (the same tiny drafter quantized: ``draft_exl3_k4``) and one more run, bf16 wire,
adds its acceptance to the table (issue 13: EXL3 against BF16 in vLLM). Each vLLM engine runs in
its own subprocess (`--worker`), so every one starts from a clean state and shuts down completely.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

from draft_tools.common import scrape, start_server, stop_server
from draft_tools.tiny_pair.pair import ASSET_DIR as ASSETS

PROPOSER = "target_client.vllm.proposer.RemoteDSparkProposer"
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
    'def read_config(path):\n    """Read',
    "try:\n    import json\nexcept ImportError:\n",
]


def _drafter_stats(worker: Any) -> dict[str, Any]:
    drafter = getattr(worker.model_runner, "drafter", None)
    return drafter.stats() if drafter is not None and hasattr(drafter, "stats") else {}


def _drafter_phases(worker: Any) -> list[dict[str, float]]:
    drafter = getattr(worker.model_runner, "drafter", None)
    return drafter.step_phases() if drafter is not None and hasattr(drafter, "step_phases") else []


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs inside a subprocess: one vLLM engine, the prompts, the numbers."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process core: the proposer's stats are reachable
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = dict(
        model=cfg["target"], dtype="float32", enforce_eager=True, max_model_len=512, seed=0, disable_log_stats=False
    )
    if cfg.get("k"):
        kw["speculative_config"] = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": cfg["k"]}
    llm = LLM(**kw)
    # a repetition penalty makes greedy picks differ from the raw logits' argmax now and then: the
    # predicted commits' misses in a real engine (tests/e2e/test_vllm_predicted.py)
    params = SamplingParams(
        temperature=0.0, max_tokens=cfg["max_tokens"], repetition_penalty=cfg.get("repetition_penalty", 1.0)
    )
    outs = llm.generate(cfg["prompts"], params, use_tqdm=False)
    llm.llm_engine.step()  # the step that tells the proposer the last requests finished (frees them)
    res: dict[str, Any] = {
        "texts": [o.outputs[0].text for o in outs],
        "ids": [list(o.outputs[0].token_ids) for o in outs],
    }
    counters: dict[str, Any] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            counters[m.name] = getattr(m, "value", None) if hasattr(m, "value") else list(getattr(m, "values", []))
    res["spec"] = counters
    if cfg.get("k"):
        res["drafter"] = llm.collective_rpc(_drafter_stats)[0]
        if cfg.get("phases"):  # per-step times (draft_tools.bench.early_taps)
            res["phases"] = llm.collective_rpc(_drafter_phases)[0]
    return res


def _run_worker(cfg: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "draft_tools.demo.part_vllm", "--worker", json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    for line in out.stdout.splitlines():
        if line.startswith("@@"):
            return json.loads(line[2:])
    raise SystemExit(f"vLLM worker failed (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")


def _acceptance(spec: dict[str, Any]) -> tuple[float, float, float]:
    """(drafts, acceptance rate, mean acceptance length) from vLLM's counters."""
    sd = spec["spec"]
    drafts = sd.get("vllm:spec_decode_num_drafts", 0) or 0
    dtoks = sd.get("vllm:spec_decode_num_draft_tokens", 0) or 0
    acc = sd.get("vllm:spec_decode_num_accepted_tokens", 0) or 0
    return drafts, acc / max(dtoks, 1), 1 + acc / max(drafts, 1)


def run(k: int = 4, max_tokens: int = 48, wire_formats: tuple[str, ...] = ("bf16", "fp8")) -> bool:
    """The demo proper; returns True when the outputs with drafts (in every wire format) and
    without are identical."""
    draft, target = ASSETS / "draft", ASSETS / "target"
    if not (draft / "config.json").exists() or not (target / "config.json").exists():
        raise SystemExit(f"the tiny trained pair is missing under {ASSETS}")
    print(f"== starting draft server on the shipped tiny DSpark drafter ({draft.relative_to(ASSETS.parents[2])})")
    proc, endpoint, mport = start_server(
        ["--model", str(draft), "--target-model", str(target), "--device", "cpu", "--dtype", "float32"]
    )
    env = {**os.environ, "DRAFT_SERVER_ENDPOINT": endpoint, "DRAFT_BUDGET_MS": "200", "VLLM_CPU_KVCACHE_SPACE": "1"}
    try:
        cfg = {"target": str(target), "prompts": PROMPTS, "max_tokens": max_tokens}
        specs = {}
        for fmt in wire_formats:
            print(f"== vLLM (CPU) with remote DSpark drafts, k={k}, {len(PROMPTS)} prompts, greedy, wire format {fmt}")
            specs[fmt] = _run_worker({**cfg, "k": k}, {**env, "DRAFT_WIRE_FORMAT": fmt, "DRAFT_MODEL_DIR": str(draft)})
        spec = specs[wire_formats[0]]
        exl3 = ASSETS / "draft_exl3_k4"
        print(f"== starting a second draft server on the 4-bit EXL3 drafter ({exl3.relative_to(ASSETS.parents[2])})")
        q_proc, q_endpoint, _ = start_server(
            ["--model", str(exl3), "--target-model", str(target), "--device", "cpu", "--dtype", "float32"]
        )
        try:
            print(f"== vLLM (CPU) with remote drafts from the EXL3 drafter, k={k}, wire format bf16")
            q_env = {**env, "DRAFT_SERVER_ENDPOINT": q_endpoint, "DRAFT_WIRE_FORMAT": "bf16"}
            specs["exl3 4-bit"] = _run_worker({**cfg, "k": k}, {**q_env, "DRAFT_MODEL_DIR": str(exl3)})
        finally:
            stop_server(q_proc)
        print("== vLLM (CPU) without speculation, same prompts")
        plain = _run_worker(cfg, env)
        for p, t in zip(PROMPTS, spec["texts"], strict=True):
            print("-" * 72)
            print(textwrap.indent(p + t, "  | "))
        print("-" * 72)
        sd = spec["spec"]
        drafts = sd.get("vllm:spec_decode_num_drafts", 0) or 0
        dtoks = sd.get("vllm:spec_decode_num_draft_tokens", 0) or 0
        acc = sd.get("vllm:spec_decode_num_accepted_tokens", 0) or 0
        per_pos = sd.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
        print("== vLLM speculative decoding counters")
        print(
            f"   drafts {int(drafts)}, draft tokens {int(dtoks)}, accepted {int(acc)}, "
            f"acceptance rate {acc / max(dtoks, 1):.3f}, mean acceptance length {1 + acc / max(drafts, 1):.3f}"
        )
        if per_pos:
            print("   accepted per position " + ", ".join(f"{v / max(drafts, 1):.2f}" for v in per_pos))
        d = spec.get("drafter", {})
        c = d.get("client", {})
        print("== draft client RPC (per engine step)")
        print(
            f"   steps {d.get('steps')}, wait p50 {d.get('rpc_ms_p50') or 0:.2f} ms, "
            f"p90 {d.get('rpc_ms_p90') or 0:.2f} ms, p99 {d.get('rpc_ms_p99') or 0:.2f} ms, "
            f"max {d.get('rpc_ms_max') or 0:.2f} ms; "
            f"timeouts {c.get('timeouts')}, fallbacks {c.get('fallbacks')}"
        )
        taps = json.loads((draft / "config.json").read_text())
        width = len(taps["target_layer_ids"]) * taps.get("target_hidden_size", taps["hidden_size"])
        row_bytes = {"bf16": 2 * width, "fp8": width + 4, "projected": 4 * taps["hidden_size"]}  # f32 server
        row_bytes["exl3 4-bit"] = row_bytes["bf16"]
        print("== acceptance by drafter and wire format (vLLM's counters; the servers compute in float32)")
        print("   drafter     format     bytes/row  drafts  acceptance rate  mean acceptance length  output == plain")
        for label, s in specs.items():
            n, rate, mean = _acceptance(s)
            same_fmt = "YES" if s["ids"] == plain["ids"] else "NO"
            weights, fmt = ("EXL3 K=4", "bf16") if label == "exl3 4-bit" else ("BF16", label)
            cells = f"{row_bytes[label]:9d}  {int(n):6d}  {rate:15.3f}  {mean:22.3f}  {same_fmt}"
            print(f"   {weights:10s}  {fmt:9s}  {cells}")
        same = all(s["ids"] == plain["ids"] for s in specs.values())
        print(f"== greedy outputs identical with and without remote drafts: {'YES' if same else 'NO'}")
        met = scrape(mport)
        print(
            f"   server: live sessions {int(met['draft_server_sessions'])}, "
            f"drafted tokens {int(met['draft_server_drafted_tokens_total'])}"
        )
        return same
    finally:
        stop_server(proc)
        print("== draft server stopped")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, default=4, help="drafts per step")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--wire-formats", default="bf16,fp8", help="one speculative run per wire format (bf16, fp8, projected)"
    )
    args = ap.parse_args(argv)
    if args.worker:
        res = worker(json.loads(args.worker))
        sys.stdout.write("@@" + json.dumps(res) + "\n")
        return 0
    return 0 if run(args.k, args.max_tokens, tuple(f for f in args.wire_formats.split(",") if f)) else 1


if __name__ == "__main__":
    sys.exit(main())
