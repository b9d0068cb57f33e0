"""The draft step with fewer, fused kernels against the step before them, in one process (GPU).

What changed (``kernels/fused.py``): the step's cos/sin in one kernel (float64 in registers) instead
of eight float64 tensor ops; the MLA cached token (RMSNorm of the latent + RoPE of the key) in one
kernel instead of three, written straight into its cache slots (no index_copy); the query's RoPE
written straight into FlashMLA's query buffer instead of a copy after; a GQA head's RMSNorm + RoPE
in one kernel, and its K/V written into their slots by one kernel (no stack, no index_copy); each
greedy Markov step in two kernels (the embedding gathered inside the argmax kernel, d2t applied in
its final pass). One drafter per preset, captured twice: once with the model's ``rope``,
``_latent``, ``_fused_rows``, ``gqa.rms_rope`` and ``step.greedy_chain`` swapped
for the compositions they replace (``unfused``), once as shipped (``fused``); both FastSteps share
the weights, the KV cache and the GEMM tuner's choices, so only the fusion differs. Steps of 3 new
rows + 7 drafts per session at 1,024 context rows (CUDA graphs; taps in registered host memory)
are timed interleaved, rounds alternating which goes first, at each B, beside the floor measured in
the same run; kernels and host syncs per step (torch.profiler) at 1 and 64 sessions; and whether
the two give the same greedy drafts, and the share of draft tokens that agree (bf16: a kernel doing
the same arithmetic may still differ in a last bit once compiled, and a random drafter's argmax can
flip on it).

    python3 -m draft_tools.bench.fused_step --out bench/results/fused_step_h200.json [--presets k3,qwen3-8b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from draft_server.models import gemm
from draft_server.models import step as step_mod
from draft_server.models.kernels import fused
from draft_server.models.layers import gqa
from draft_server.models.layers.ops import Rope, rms_norm
from draft_server.models.presets import PRESETS, random_drafter
from draft_tools.bench.draft_step_gpu import (
    CTX,
    NEW_ROWS,
    Sessions,
    captures_interleaved,
    floor_ms,
    gpu_machine,
    log,
    measure_floors,
    profile_counts,
    share_registered,
    step_cost,
)
from draft_tools.bench.flash_step import agreement

SIZES = (1, 2, 4, 8, 16, 32, 64)


class UnfusedRope(Rope):
    """The RoPE of the step before: cos/sin as float64 tensor ops, the query's rope part copied into place."""

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        ang = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq
        return (ang.cos() * self.mul).to(dtype), (ang.sin() * self.mul).to(dtype)

    def apply(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = super().apply(x, cos, sin)
        return y if out is None else out.copy_(y)


def _unfused_latent(m: Any) -> Any:
    """K3's cached token as three kernels (RMSNorm, RoPE, concatenation), as before ``fused.mla_latent``."""

    def latent(kv, norm_w, cos, sin, layers_first=False, into=None):  # type: ignore[no-untyped-def]
        assert into is None  # _fused_rows is False on this side: the cache write is index_copy's
        c = rms_norm(kv[..., : m.lat], norm_w, m.eps)
        tok = torch.cat([c, m.rope.apply(kv[..., m.lat :], cos[:, None], sin[:, None])], dim=-1)
        return tok.transpose(0, 1) if layers_first else tok

    return latent


def _unfused_rms_rope(x, w, eps, rope, cos, sin):  # type: ignore[no-untyped-def]
    return rope.apply(rms_norm(x, w, eps), cos, sin)


def _unfused_chain(m, z, anchors, k, sts):  # type: ignore[no-untyped-def]
    """The greedy Markov chain before the embedding and d2t moved into its kernels: per step an
    embedding, the argmax kernels, and d2t's gather and add (``step.greedy_chain``'s arithmetic)."""
    base = gemm.linear(z[:, :k], m.lm_head)
    prev, toks, embs = anchors, [], []
    rows = torch.arange(anchors.shape[0], device=anchors.device)
    for j in range(k):
        e = m.markov_embed(prev)
        embs.append(e)
        best = fused.markov_argmax_lowrank(base[:, j], rows, e, m.markov_w2, reverse=j % 2 == 1)
        prev = m.to_target_ids(best)
        toks.append(prev)
    conf = None
    if m.conf_w is not None:
        conf = torch.sigmoid(m.confidence_logit(z[:, :k], torch.stack(embs, dim=1)).to(m.acc) / sts[:k])
    return torch.stack(toks, dim=1), conf


def bench_preset(
    name: str, floors: dict[str, float], rounds: int, steps: int, dev: torch.device, sizes: tuple[int, ...] = SIZES
) -> dict[str, Any]:
    res: dict[str, Any] = {"preset": name}
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    d = random_drafter(PRESETS[name], dev, 8 << 30 if dev.type == "cuda" else 64 << 20, dtype, attention="paged")
    res["weights_s"] = time.perf_counter() - t0
    m = d.model
    fused_rope, fused_rms_rope, fused_chain = m.rope, gqa.rms_rope, step_mod.greedy_chain
    unfused_rope = UnfusedRope.__new__(UnfusedRope)
    unfused_rope.__dict__.update(fused_rope.__dict__)
    fasts = {}
    for mode in ("unfused", "fused"):  # the unfused capture first: the GEMM tuner's timings come from it
        if mode == "unfused":
            m.rope = unfused_rope
            gqa.rms_rope = _unfused_rms_rope
            step_mod.greedy_chain = _unfused_chain
            m._fused_rows = lambda x, cos, cache=None: False  # the cache written by index_copy
            if hasattr(m, "lat"):
                m._latent = _unfused_latent(m)
        t0 = time.perf_counter()
        try:
            res[f"{mode}_prepare"] = d.prepare(64, 4096)
        finally:
            m.rope, gqa.rms_rope, step_mod.greedy_chain = fused_rope, fused_rms_rope, fused_chain
            m.__dict__.pop("_latent", None)
            m.__dict__.pop("_fused_rows", None)
        res[f"{mode}_prepare_s"] = time.perf_counter() - t0
        fasts[mode] = d.fast
        log(f"{name} {mode}: captured in {res[f'{mode}_prepare_s']:.1f} s")
    S = Sessions(d, np.random.default_rng(1), 0)
    registered = share_registered(list(fasts.values()), S)
    res["taps_in"] = "registered host memory" if registered else "ordinary host memory (staged copy)"
    keys = S.open(64, CTX)
    rows = []
    for n in sizes:
        times, drafts = captures_interleaved(S, fasts, n, rounds, steps)
        row: dict[str, Any] = {"sessions": n, **floor_ms(step_cost(d, n, [CTX] * n, n * NEW_ROWS), floors)}
        for mode, ts in times.items():
            row[f"{mode}_ms"] = statistics.median(ts)
            row[f"{mode}_rounds_ms"] = ts
            row[f"{mode}_ratio_to_floor"] = row[f"{mode}_ms"] / row["floor_ms"]
        row["same_drafts"] = drafts["fused"] == drafts["unfused"]
        row["draft_agreement"] = agreement(drafts["fused"], drafts["unfused"])
        rows.append(row)
        log(
            f"{name:9s} B={n:2d} unfused {row['unfused_ms']:.3f} ms ({row['unfused_ratio_to_floor']:.2f}x)  "
            f"fused {row['fused_ms']:.3f} ms ({row['fused_ratio_to_floor']:.2f}x)  floor {row['floor_ms']:.3f}  "
            f"same drafts {row['same_drafts']} (agreement {row['draft_agreement']:.3f})"
        )
    res["steps"] = rows
    prof = {}
    for mode, fast in fasts.items():
        d.fast = fast
        for n in (1, 64):
            S.rewind(keys[:n], CTX)
            p = profile_counts(lambda n=n: S.step(keys[:n]))
            prof[f"{mode}_B{n}"] = p
            log(
                f"{name} {mode} B={n}: {p['kernels']} kernels, {p['host_syncs']} host syncs, "
                f"GPU busy {p['gpu_busy_ms']:.3f} ms, span {p['gpu_span_ms']:.3f} ms"
            )
    res["profile"] = prof
    d.fast = None
    if S.registered is not None:
        fasts["unfused"].unregister_host(memoryview(S.registered))
    S.close(keys)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/fused_step_h200.json")
    ap.add_argument("--presets", default="k3,qwen3-8b")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    report: dict[str, Any] = {
        "command": "python3 -m draft_tools.bench.fused_step " + " ".join(sys.argv[1:]),
        "machine": gpu_machine(dev),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "floors": measure_floors(dev),
    }

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=float)

    for name in args.presets.split(","):
        report[name] = bench_preset(name, report["floors"], args.rounds, args.steps, dev)
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
