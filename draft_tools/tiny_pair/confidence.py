"""Train, write and check the tiny pair's confidence head (DSpark paper §9: c_k = σ(wᵀ[h_k; W1[x_{k-1}]] + b)).

Owns the head's training and its calibration report; the head's math is the production
``DSparkModel.confidence_logit``. The draft is frozen: the head sees the final-normed block row
z_k and the Markov embedding of the row's predecessor, and is fitted by logistic regression
(binary cross-entropy, L-BFGS) to acceptance events of the shipped target: row k's greedy draft
equals the target's greedy token, over the rows whose earlier drafts all equal the target's
tokens (so the predecessor is the draft's own), i.e. "draft k survives given that every earlier
draft survived" (the conditional the paper trains; its soft target 1 - ½‖p_draft - p_target‖₁
is the same event's probability under sampling at T = 1, and our verification is greedy).
Training sequences are the target's greedy continuations of training-split prompts
(``train.make_draft_data``, another seed than the draft's).

The calibration report (``assets/confidence.json``) is measured on the 32 held-out prompts
through the production drafter in the engine loop (``pair.acceptance``): per position, the
predicted prefix survival ∏_{i≤j} c_i against the observed fraction of steps whose first j drafts
were all accepted, Brier scores of the survival predictions against a constant per-position rate
(the best a confidence-free client could say), and the same for the conditional c_j.

Run: ``python -m draft_tools.tiny_pair.confidence [--data-seqs 1024]`` (a few minutes on 2 cores);
it rewrites ``assets/draft/model.safetensors`` (adding ``confidence_head.proj.*``, float32) and
sets ``enable_confidence_head`` / ``confidence_head_with_markov`` in its config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from draft_tools.tiny_pair.pair import (
    ASSET_DIR,
    AcceptStats,
    TinyDSpark,
    acceptance,
    load_draft,
    load_target,
    load_tokenizer,
)
from draft_tools.tiny_pair.train import (
    Settings,
    corpus_files,
    encode_stream,
    held_out_prompts,
    make_draft_data,
    read_text,
    sample_batch,
)


@torch.no_grad()
def features(draft: TinyDSpark, data: dict[str, torch.Tensor], s: Settings, batches: int) -> tuple[torch.Tensor, ...]:
    """(x [n, H + r] = [z_k; W1[prev_k]], accepted [n] 0/1, row index [n]) over random anchors,
    for the rows whose earlier drafts in the block were all accepted."""
    m = draft.model()
    rng = np.random.default_rng(s.seed + 11)
    xs, ys, js = [], [], []
    for _ in range(batches):
        taps, anchors, tokens, prev, y = sample_batch(data, s, rng)
        z = draft.train_block(m, taps, anchors, tokens)
        e = m.markov_embed(prev)
        logits = m.logits(z) + m.markov_bias(e)
        ok = logits.argmax(-1) == y
        # the conditional's population: rows whose earlier drafts all survived
        reached = torch.cat([torch.ones_like(ok[..., :1]), ok[..., :-1].cumprod(-1).bool()], dim=-1).flatten()
        xs.append(torch.cat([z, e], dim=-1).flatten(0, 2).float()[reached])
        ys.append(ok.flatten().float()[reached])
        js.append(torch.arange(s.block_size).expand_as(y).flatten()[reached])
    return torch.cat(xs), torch.cat(ys), torch.cat(js)


def fit_head(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-4, iters: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Logistic regression w [1, d], b [1] by L-BFGS on mean BCE + l2 |w|²."""
    w = torch.zeros(1, x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=iters, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w[0] + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def write_head(draft_dir: Path, w: torch.Tensor, b: torch.Tensor) -> None:
    """Add the head (float32) to the draft checkpoint and switch it on in its config."""
    from safetensors.torch import load_file, save_file

    path = draft_dir / "model.safetensors"
    state = {k: v for k, v in load_file(str(path)).items() if not k.startswith("confidence_head")}
    state["confidence_head.proj.weight"] = w.float().contiguous()
    state["confidence_head.proj.bias"] = b.float().contiguous()
    save_file(state, str(path), metadata={"format": "pt"})
    cfg = json.loads((draft_dir / "config.json").read_text())
    cfg["enable_confidence_head"] = True
    cfg["confidence_head_with_markov"] = True
    (draft_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def calibration(events: Sequence[tuple[list[float], int]], k: int) -> dict[str, Any]:
    """Per position j (1..k): predicted prefix survival ∏_{i≤j} c_i vs observed [accepted >= j],
    Brier scores (head vs the constant observed rate), and the conditional c_j on steps that reached j."""
    conf = np.array([c[:k] for c, _ in events], dtype=np.float64)
    acc = np.array([a for _, a in events])
    surv_pred = np.cumprod(conf, axis=1)
    out: dict[str, Any] = {"steps": len(events), "positions": []}
    bs_head = bs_const = 0.0
    for j in range(k):
        obs = (acc >= j + 1).astype(np.float64)
        rate = obs.mean()
        reached = acc >= j  # steps whose first j drafts survived: the conditional's population
        cond_obs = obs[reached]
        row = {
            "position": j + 1,
            "survival_predicted": round(float(surv_pred[:, j].mean()), 4),
            "survival_observed": round(float(rate), 4),
            "brier_survival": round(float(((surv_pred[:, j] - obs) ** 2).mean()), 4),
            "brier_survival_constant": round(float(((rate - obs) ** 2).mean()), 4),
            "conditional_predicted": round(float(conf[reached, j].mean()), 4) if reached.any() else None,
            "conditional_observed": round(float(cond_obs.mean()), 4) if reached.any() else None,
            "reached": int(reached.sum()),
        }
        bs_head += row["brier_survival"]
        bs_const += row["brier_survival_constant"]
        out["positions"].append(row)
    out["brier_survival_mean"] = round(bs_head / k, 4)
    out["brier_survival_constant_mean"] = round(bs_const / k, 4)
    # reliability of the survival predictions over every position: 10 equal-width bins
    flat_p = surv_pred.flatten()
    flat_o = np.stack([(acc >= j + 1) for j in range(k)], axis=1).astype(np.float64).flatten()
    bins = []
    for lo in np.arange(0.0, 1.0, 0.1):
        sel = (flat_p >= lo) & (flat_p < lo + 0.1 + (1e-9 if lo >= 0.9 else 0.0))
        if sel.any():
            bins.append(
                {
                    "bin": [round(float(lo), 1), round(float(lo + 0.1), 1)],
                    "n": int(sel.sum()),
                    "predicted": round(float(flat_p[sel].mean()), 4),
                    "observed": round(float(flat_o[sel].mean()), 4),
                }
            )
    out["reliability"] = bins
    out["expected_accepted_predicted"] = round(float(surv_pred.sum(axis=1).mean()), 4)
    out["expected_accepted_observed"] = round(float(acc.mean()), 4)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ASSET_DIR, help="the pair's asset dir (target/, draft/ inside)")
    ap.add_argument("--data-seqs", type=int, default=1024, help="greedy continuations to train the head on")
    ap.add_argument("--batches", type=int, default=192, help="feature batches of d_batch sequences x d_anchors")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    s = dataclasses.replace(Settings(), d_data_seqs=args.data_seqs, seed=Settings.seed + 100)
    target_dir, draft_dir = args.out / "target", args.out / "draft"
    target = load_target(target_dir)
    tok = load_tokenizer(target_dir)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_files, held_files = corpus_files(stdlib, Settings())
    log: dict[str, Any] = {}
    data = make_draft_data(target, encode_stream(tok, [read_text(p) for p in train_files]), s, log)

    draft = load_draft(draft_dir, target)
    x, y, j = features(draft, data, s, args.batches)
    n_fit = int(0.9 * len(y))  # last 10 % of the anchors: a validation split of training-side data
    w, b = fit_head(x[:n_fit], y[:n_fit])
    with torch.no_grad():
        p_val = torch.sigmoid(x[n_fit:] @ w[0] + b)
        val_bce = F.binary_cross_entropy(p_val, y[n_fit:]).item()
    print(f"head fitted on {n_fit} rows: validation BCE {val_bce:.4f}", flush=True)
    write_head(draft_dir, w, b)

    draft = load_draft(draft_dir, target)  # the shipped head, through the production drafter
    held = held_out_prompts(tok, [read_text(p) for p in held_files], Settings())
    events: list[tuple[list[float], int]] = []
    stats = AcceptStats()
    for pr in held:
        acceptance(target, draft, pr["ids"], Settings.eval_new_tokens, stats=stats, events=events)
    report = {
        "what": "tiny pair confidence head: calibration on held-out prompts through the production drafter",
        "command": "python -m draft_tools.tiny_pair.confidence "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "training": {
            "sequences": args.data_seqs,
            "rows": n_fit,
            "conditional_acceptance_rate_per_row": [round(float(y[j == r].mean()), 4) for r in range(s.block_size)],
            "validation_bce": round(val_bce, 4),
            "validation_bce_constant": round(
                float(F.binary_cross_entropy(torch.full_like(y[n_fit:], float(y[:n_fit].mean())), y[n_fit:])), 4
            ),
            "features": "[z_k (final-normed block row, 128); W1[prev_k] (Markov embedding, 32)] -> 1 logit",
        },
        "held_out": {
            "prompts": len(held),
            "new_tokens": Settings.eval_new_tokens,
            "k": draft.c.block_size,
            "mean_acceptance_length": round(stats.mean, 4),
            **calibration(events, draft.c.block_size),
        },
        "sts_temperatures": "none (1.0): the head is fitted by BCE on the conditional event; see positions",
        "seconds": round(time.time() - t0, 1),
    }
    (args.out / "confidence.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["held_out"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
