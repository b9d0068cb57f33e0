"""The greedy Markov chain's argmax passes at 1-64 sessions: launch shapes of ``_markov_partial_kernel`` (issue 10).

Each of a step's k = 7 Markov passes reads W2 (vocab x rank; 84 MB at K3 size) and the base logits of
its draft column. ``fused.markov_launch`` picks how a pass is tiled for N sessions; this times the
whole chain (7 passes, the vocab order alternating as ``greedy_chain`` runs it, the final reductions
included) as a CUDA graph replayed after a 256 MB write (in the step the LM head before the chain
streams 2.35 GB through the L2), for a grid of shapes: sessions per program, vocab rows per tile,
tiles per program (one Markov-row gather per program, the W2 tiles pipelined), warps, stages. Beside
each N: the chain's floor (its bytes over the device copy bandwidth measured in the same run), the
shape ``markov_launch`` picks now, and the fastest one. Prints a table and writes JSON.

    python3 -m draft_tools.bench.markov_sweep --out bench/results/markov_sweep_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from typing import Any

import torch

from draft_server.models import gemm
from draft_server.models.kernels import fused
from draft_tools.bench.draft_step_gpu import gpu_machine, measure_floors

K = 7
SHAPES = {"k3": (163840, 256), "qwen3-8b": (151936, 256)}  # (draft vocab, Markov rank)
SESSIONS = (1, 2, 4, 8, 16, 32, 64)


def candidates(n: int) -> list[fused.MarkovLaunch]:
    out = [fused.markov_launch(n)]
    for bn, bv, (it, st), w in itertools.product((16, 32, 64), (64, 128), ((1, 1), (4, 2), (8, 3)), (4, 8)):
        if bn > 16 and bn // 2 >= n:
            continue  # half the session rows empty at least
        c = fused.MarkovLaunch(block_n=bn, block_v=bv, iters=it, warps=w, stages=st)
        if c not in out:
            out.append(c)
    return out


def chain_ms(base: torch.Tensor, prev: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
             launch: fused.MarkovLaunch) -> tuple[float, torch.Tensor]:  # fmt: skip
    """Median ms of the 7-pass chain as ``gemm.graph_ms`` times it (a CUDA graph, an L2 flush before each
    replay), and its tokens."""
    out = torch.empty(base.shape[0], K, dtype=torch.int64, device=base.device)

    def chain() -> None:
        p = prev
        for j in range(K):
            p = fused.markov_argmax_lowrank(base[:, j], p, w1, w2, reverse=j % 2 == 1, launch=launch)
            out[:, j] = p

    return gemm.graph_ms(chain, runs=15), out.clone()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--presets", default="k3,qwen3-8b")
    ap.add_argument("--sessions", default=",".join(map(str, SESSIONS)))
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    floors = measure_floors(dev)
    bw = floors["copy_bytes_per_s"]
    report: dict[str, Any] = {"command": " ".join(sys.argv), "machine": gpu_machine(dev), "floors": floors}
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"copy {bw / 1e12:.2f} TB/s")
    for preset in args.presets.split(","):
        V, R = SHAPES[preset]
        w2 = (torch.randn(V, R, device=dev, generator=g) / R**0.5).to(torch.bfloat16)
        w1 = torch.randn(V, R, device=dev, generator=g).to(torch.bfloat16)
        rows = []
        for n in map(int, args.sessions.split(",")):
            base = torch.randn(n, K, V, device=dev, generator=g).to(torch.bfloat16)
            prev = torch.randint(0, V, (n,), device=dev, generator=g)
            floor = (K * w2.numel() * 2 + base.numel() * 2) / bw * 1e3
            times: dict[str, float] = {}
            ref = None
            same = True
            for c in candidates(n):
                name = str(c)
                try:
                    times[name], toks = chain_ms(base, prev, w1, w2, c)
                except Exception as e:  # a shape this GPU cannot hold (shared memory, registers)
                    print(f"  {preset} N={n} {name}: {type(e).__name__}", file=sys.stderr)
                    continue
                ref = toks if ref is None else ref
                same = same and torch.equal(ref, toks)
            now = times[next(iter(times))]
            best = min(times, key=lambda k: times[k])
            top = sorted(times, key=lambda k: times[k])[:5]
            rows.append({"sessions": n, "floor_ms": floor, "now": next(iter(times)), "now_ms": now, "best": best,
                         "best_ms": times[best], "top5": {k: times[k] for k in top}, "same_tokens": same,
                         "all_ms": times})  # fmt: skip
            print(f"{preset:8s} N={n:3d} floor {floor:.3f}  now {now:.3f} ({now / floor:.2f}x)  "
                  f"best {times[best]:.3f} ({times[best] / floor:.2f}x) {best}  same={same}")  # fmt: skip
        report[preset] = rows
    report["seconds"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
