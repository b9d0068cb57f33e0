"""Acceptance of the shipped tiny pair with the draft block as vLLM runs it (k rows for k drafts)
and as the checkpoint was trained (block_size rows, the first k returned), side by side.

Greedy acceptance (mean accepted + 1 per step, the engine loop of ``tiny_pair.pair.acceptance``)
on the held-out prompts, for every k below the block size and both widths, in one run.

    python -m draft_tools.bench.block_width --out bench/results/block_width_tiny.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from draft_tools.tiny_pair import pair as tp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/block_width_tiny.json")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target = tp.load_target()
    draft = tp.load_draft(target=target)
    prompts = json.loads((tp.ASSET_DIR / "eval_prompts.json").read_text())[: args.prompts]
    B = draft.c.block_size
    rows = []
    for k in range(1, B + 1):
        row: dict[str, float] = {"k": k}
        for width in ("k", "trained"):
            stats = tp.AcceptStats()
            for pr in prompts:
                tp.acceptance(target, draft, pr["ids"], args.tokens, k=k, stats=stats, block_width=width)
            row[f"acceptance_{width}"] = stats.mean
            row[f"steps_{width}"] = stats.steps
        rows.append(row)
        print(f"k={k}: block of k rows {row['acceptance_k']:.3f}, trained block of {B} {row['acceptance_trained']:.3f}")
    out = {
        "benchmark": "block_width",
        "command": "python -m draft_tools.bench.block_width " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "block_size": B,
        "prompts": len(prompts),
        "tokens": args.tokens,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
