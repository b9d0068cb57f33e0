"""How much of W2 an exact, bounded Markov argmax could skip (issue 10): an analysis on the CPU, no kernel.

Each greedy Markov pass reads all of W2 (84 MB at K3 size; seven passes a step, 0.18 ms of a one-session
K3 step on an H200) to find argmax_v base[v] + W2[v]·e. A pass could skip a tile of vocab rows whose
every score is bounded below the best score some other row is sure to reach, and still return exactly
the same token. How many tiles such a bound lets go depends on how tight it is; this script counts them
for three bounds, on seeded random weights shaped and scaled as ``presets.random_weights`` makes them
(the ``random:k3`` / ``random:qwen3-8b`` the step benches run) and unit-RMS hidden states:

- ``cs``: Cauchy-Schwarz, |W2[v]·e| <= ||W2[v]|| ||e|| (one norm per row kept beside W2);
- ``int8`` / ``int4``: a per-row quantized copy of W2 (absmax scale) read instead of W2 to estimate each
  score, with |W2[v]·e - Q[v]·e| <= ||W2[v] - Q[v]|| ||e|| (the residual's norm kept per row); the tiles
  that can still hold the max are then read exactly.

Per pass, per bound: the fraction of 128-row tiles that can hold the argmax (a lower bound of the best
score: the best row's own lower bound), and the bytes a pass would read (the sketch, plus W2's candidate
tiles) against W2's. Trained checkpoints may differ: their Markov bias is larger than random weights'.

    python -m draft_tools.bench.markov_prune --preset k3 --out bench/results/markov_prune_cpu.json
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any

import torch

from draft_tools.common import write_report

TILE = 128
# (vocab, hidden, Markov rank); "tiny" for the tests
SHAPES = {"k3": (163840, 7168, 256), "qwen3-8b": (151936, 4096, 256), "tiny": (8192, 256, 64)}


def quantized(w: torch.Tensor, bits: int) -> torch.Tensor:
    """w [V, R] rounded to a per-row absmax grid of 2^(bits-1) - 1 levels each side (float32)."""
    top = 2 ** (bits - 1) - 1
    scale = w.abs().amax(1, keepdim=True).clamp_min(1e-30) / top
    return torch.round(w / scale).clamp(-top, top) * scale


def candidates(score: torch.Tensor, slack: torch.Tensor) -> torch.Tensor:
    """Per tile, whether it may hold the argmax of the true scores, given estimates ``score`` [V] that
    are within ``slack`` [V] of them: its best upper bound reaches the best lower bound."""
    lower = (score - slack).max()
    upper = score + slack
    V = score.shape[0]
    pad = -V % TILE
    upper = torch.nn.functional.pad(upper, (0, pad), value=float("-inf")).view(-1, TILE).amax(1)
    return upper >= lower


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="k3", choices=sorted(SHAPES))
    ap.add_argument("--passes", type=int, default=28, help="Markov passes sampled (rows x steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    V, H, R = SHAPES[args.preset]
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.monotonic()
    w1 = torch.randn(V, R, generator=g) / R**0.5  # as presets.random_weights scales them
    w2 = torch.randn(V, R, generator=g) / R**0.5
    h = torch.randn(args.passes, H, generator=g)
    h = h / h.pow(2).mean(1, keepdim=True).sqrt()  # a final-normed row (unit RMS, norm weight 1)
    base = torch.empty(args.passes, V)
    for lo in range(0, V, 8192):  # the lm_head a slice at a time: V x H float32 would be 4.7 GB at K3 size
        hi = min(V, lo + 8192)
        base[:, lo:hi] = h @ (torch.randn(hi - lo, H, generator=g) / H**0.5).T
    base = base.bfloat16().float()  # the logits as the step keeps them
    norms = w2.norm(dim=1)
    sketches = {bits: quantized(w2, bits) for bits in (8, 4)}
    resid = {bits: (w2 - q).norm(dim=1) for bits, q in sketches.items()}
    w2_bytes = V * R * 2
    tiles = -(-V // TILE)
    out: dict[str, list[float]] = {"cs": [], "int8": [], "int4": []}
    spread = []
    prev = torch.randint(0, V, (args.passes,), generator=g)
    for p in range(args.passes):
        e = w1[prev[p]]
        en = e.norm()
        exact = base[p] + w2 @ e
        spread.append(float((w2 @ e).std()))
        best = int(exact.argmax())
        for name, score, slack in (
            ("cs", base[p], norms * en),
            ("int8", base[p] + sketches[8] @ e, resid[8] * en),
            ("int4", base[p] + sketches[4] @ e, resid[4] * en),
        ):
            keep = candidates(score, slack * (1 + 2**-6))
            assert keep[best // TILE], "a bound dropped the tile holding the argmax"
            out[name].append(float(keep.float().mean()))
    report: dict[str, Any] = {
        "benchmark": "markov_prune",
        "command": "python -m draft_tools.bench.markov_prune " + " ".join(argv or []),
        "machine": {"python": platform.python_version(), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "preset": args.preset,
        "vocab": V,
        "rank": R,
        "tile_rows": TILE,
        "tiles": tiles,
        "passes": args.passes,
        "bias_std": sum(spread) / len(spread),
        "bounds": {},
    }
    for name, fr in out.items():
        mean = sum(fr) / len(fr)
        sketch = {"cs": 0, "int8": V * R, "int4": V * R // 2}[name]  # the estimate's own reads
        read = sketch + mean * w2_bytes
        report["bounds"][name] = {
            "candidate_tile_fraction_mean": mean,
            "candidate_tile_fraction_max": max(fr),
            "bytes_per_pass_over_w2": read / w2_bytes,
        }
        print(
            f"{args.preset} {name:5s}: tiles that may hold the argmax {mean:7.2%} (max {max(fr):7.2%}); "
            f"a pass reads {read / w2_bytes:6.2%} of W2's bytes"
        )
    print(f"bias std {report['bias_std']:.4f}; {time.monotonic() - t0:.1f} s")
    if args.out:
        write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
