"""Must-show 1: the batched, paged implementation equals the plain float64 reference.

Random tiny checkpoints of both families and variants: causal block, DeepSeek-YaRN (K3) and
YaRN (Qwen3), logit_scale, no Markov head, attention bias, a pruned draft vocabulary with d2t,
MLA heads that do not divide hidden (6 and 5 heads over 64). Several sessions of
different lengths go through multi-step appends, overwrites after a rejected block and gap
restarts, all sessions batched in every ingest/draft call. Greedy drafts must be
token-identical and every step's logits within 1e-4 relative (max abs diff / max abs logit).
Sampled drafting: reruns agree, the returned top-n probabilities are the reference's processed
distribution, and Gumbel sampling follows that distribution.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from draft_server.drafters.base import DraftItem, IngestItem
from draft_server.models import load_drafter
from draft_server.models.tiny import make_tiny
from protocol import Sampling
from tests.numerics.dspark_reference import Reference, processed_probs

CASES = {
    "k3": ("k3", {}),
    "k3-causal-yarn-nomarkov": (
        "k3",
        {
            "is_causal": True,
            "num_attention_heads": 5,
            "markov_rank": 0,
            "confidence_head_with_markov": False,
            "logit_scale": 0.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 50000.0,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        },
    ),
    "qwen3": ("qwen3", {}),
    "qwen3-causal-pruned-bias-yarn": (
        "qwen3",
        {
            "is_causal": True,
            "draft_vocab_size": 200,
            "attention_bias": True,
            "enable_confidence_head": False,
            "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        },
    ),
}


def bf16_taps(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    """Random taps as the wire carries them: bf16 bit patterns in uint16."""
    x = torch.from_numpy(rng.standard_normal((rows, width)).astype(np.float32) * 2.0)
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def decode(taps: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(taps.view(np.int16)).view(torch.bfloat16).to(torch.float64)


class Session:
    def __init__(self, key: int, start: int) -> None:
        self.key, self.start, self.end = key, start, start
        self.rows: dict[int, torch.Tensor] = {}


def run_scenario(drafter, ref: Reference, seed: int, rel_tol: float, steps: int = 5) -> int:
    """Drive 4 sessions through appends / overwrites / gap restarts; compare every draft."""
    rng = np.random.default_rng(seed)
    pyr = random.Random(seed)
    c = drafter.contract
    sessions = [Session(k, s) for k, s in zip((10, 11, 12, 13), (0, 0, 40, 3), strict=True)]
    first_rows = [5, 19, 1, 34]
    compared = 0
    kinds: dict[str, int] = {}
    forced = {(2, 0): "overwrite", (2, 1): "gap", (2, 3): "overwrite"}  # every run has both
    for step in range(steps):
        ingest, drafts = [], []
        for n, s in enumerate(sessions):
            if step == 0:
                pos, rows = s.start, first_rows[n]
            else:
                kind = pyr.choice(["append", "append", "overwrite", "gap"] if step > 1 else ["append"])
                kind = forced.get((step, n), kind)
                kinds[kind] = kinds.get(kind, 0) + 1
                rows = pyr.randint(1, 4)
                if kind == "append":
                    pos = s.end
                elif kind == "overwrite":  # the last block was partly rejected: rewrite from pos
                    pos = max(s.start, s.end - pyr.randint(1, 3))
                else:  # a gap: the session restarts at pos with only the new rows
                    pos = s.end + pyr.randint(1, 9)
                    s.start, s.rows = pos, {}
            taps = bf16_taps(rng, rows, c.tap_width)
            for r in range(rows):
                s.rows[pos + r] = decode(taps[r : r + 1])[0]
            for t in [t for t in s.rows if t >= pos + rows]:
                del s.rows[t]
            s.end = pos + rows
            assert drafter.reserve(s.key, s.start, s.end)
            ingest.append(IngestItem(s.key, s.start, pos, taps))
            k = pyr.randint(1, c.block_size)
            drafts.append(DraftItem(s.key, s.start, s.end, pyr.randrange(c.vocab_size), k, Sampling()))
        drafter.ingest(ingest)
        outs, logits = drafter.draft_debug(drafts)
        for it, out, lg in zip(drafts, outs, logits, strict=True):
            s = next(x for x in sessions if x.key == it.key)
            assert sorted(s.rows) == list(range(it.start, it.pos))
            toks, ref_logits, confs = ref.draft(s.rows, it.start, it.pos, it.anchor, it.k, width=it.k)
            assert out.tokens == toks, f"step {step} session {it.key}"
            err = (lg.to(torch.float64) - ref_logits).abs().max() / ref_logits.abs().max()
            assert err < rel_tol, f"step {step} session {it.key}: logits rel err {err:.2e}"
            if ref.conf:
                np.testing.assert_allclose(out.confidence, confs, rtol=rel_tol, atol=rel_tol)
            else:
                assert out.confidence == []
            compared += 1
    assert {"append", "overwrite", "gap"} <= set(kinds), kinds
    return compared


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_float64_reference(tmp_path, case):
    variant, overrides = CASES[case]
    paths = make_tiny(variant, str(tmp_path / "ck"), seed=7, **overrides)
    ref = Reference(paths.draft, paths.target)
    drafter = load_drafter(paths.draft, paths.target, "cpu", "float64", kv_budget_bytes=8 << 20, page_size=8)
    assert run_scenario(drafter, ref, seed=1, rel_tol=1e-10) == 20


@pytest.mark.parametrize("variant", ["k3", "qwen3"])
def test_greedy_float32_matches_reference(tmp_path, variant):
    paths = make_tiny(variant, str(tmp_path / "ck"), seed=3)
    ref = Reference(paths.draft, paths.target)
    drafter = load_drafter(paths.draft, paths.target, "cpu", "float32", kv_budget_bytes=8 << 20)
    run_scenario(drafter, ref, seed=2, rel_tol=1e-4, steps=3)


@pytest.mark.parametrize("variant", ["k3", "qwen3"])
def test_sampled_drafts_are_seeded_and_report_reference_probs(tmp_path, variant):
    overrides = {"draft_vocab_size": 250} if variant == "qwen3" else {}
    paths = make_tiny(variant, str(tmp_path / "ck"), seed=5, **overrides)
    ref = Reference(paths.draft, paths.target)
    drafter = load_drafter(paths.draft, paths.target, "cpu", "float64", kv_budget_bytes=4 << 20)
    c = drafter.contract
    rng = np.random.default_rng(0)
    taps = bf16_taps(rng, 12, c.tap_width)
    assert drafter.reserve(1, 0, 12)
    drafter.ingest([IngestItem(1, 0, 0, taps)])
    rows = {t: decode(taps[t : t + 1])[0] for t in range(12)}
    settings = [
        Sampling(temperature=0.8, seed=11, return_probs=5),
        Sampling(temperature=1.3, top_k=20, seed=12, return_probs=3),
        Sampling(temperature=1.0, top_p=0.7, seed=13, return_probs=4),
        Sampling(temperature=0.9, top_k=50, top_p=0.9, seed=14, return_probs=6),
    ]
    items = [DraftItem(1, 0, 12, 33, c.block_size, s) for s in settings]
    outs = drafter.draft(items)
    again = drafter.draft(list(reversed(items)))[::-1]  # same seeds, other batch order
    d2t = ref.w.get("d2t")
    for it, out, out2 in zip(items, outs, again, strict=True):
        assert out.tokens == out2.tokens
        np.testing.assert_array_equal(out.prob_ids, out2.prob_ids)
        _, logits, _ = ref.draft(rows, 0, 12, it.anchor, it.k, forced=out.tokens, width=it.k)
        s = it.sampling
        for j in range(it.k):
            q = processed_probs(logits[j], s.temperature, s.top_k, s.top_p)
            top = torch.topk(q, s.return_probs)
            ids = top.indices if d2t is None else top.indices + d2t[top.indices]
            np.testing.assert_allclose(out.probs[j], top.values.numpy(), rtol=1e-5, atol=1e-7)
            np.testing.assert_array_equal(out.prob_ids[j], ids.numpy())
            to_target = torch.arange(len(q)) if d2t is None else torch.arange(len(q)) + d2t
            assert q[to_target == out.tokens[j]].sum() > 0  # the drafted token is inside the filtered support
    other = drafter.draft([DraftItem(1, 0, 12, 33, c.block_size, Sampling(temperature=0.8, seed=99))])
    assert other[0].tokens != outs[0].tokens  # a different seed draws differently (overwhelmingly likely)


def test_sampling_follows_the_processed_distribution(tmp_path):
    paths = make_tiny("qwen3", str(tmp_path / "ck"), seed=9)
    ref = Reference(paths.draft, paths.target)
    drafter = load_drafter(paths.draft, paths.target, "cpu", "float32", kv_budget_bytes=4 << 20)
    c = drafter.contract
    taps = bf16_taps(np.random.default_rng(4), 6, c.tap_width)
    assert drafter.reserve(1, 0, 6)
    drafter.ingest([IngestItem(1, 0, 0, taps)])
    s = Sampling(temperature=1.5, top_k=12)
    n = 3000
    outs = drafter.draft([DraftItem(1, 0, 6, 2, 1, Sampling(s.temperature, s.top_k, seed=i)) for i in range(n)])
    counts = np.bincount([o.tokens[0] for o in outs], minlength=c.vocab_size) / n
    rows = {t: decode(taps[t : t + 1])[0] for t in range(6)}
    _, logits, _ = ref.draft(rows, 0, 6, 2, 1, forced=[0], width=1)
    q = processed_probs(logits[0], s.temperature, s.top_k, 1.0).numpy()
    assert set(np.nonzero(counts)[0]) <= set(np.nonzero(q)[0])
    assert 0.5 * np.abs(counts - q).sum() < 0.05  # total variation
