"""Checks of the shipped tiny Qwen3 target + DSpark draft pair (draft_tools/tiny_pair/assets).

Loads the pair as shipped and checks: tokenizer round trip and special ids, the checkpoint
layouts, deterministic greedy generation, that the training-time (masked many-anchor) forward
equals the production drafter's paged drafting, held-out greedy acceptance > 1.5, and that the
confidence head is calibrated on held-out prompts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from safetensors import safe_open

from draft_tools.tiny_pair import pair as tp

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls: one thread is faster, and far faster when the cores are shared."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def pair(one_thread: None) -> tuple[object, tp.TinyDSpark]:
    target = tp.load_target()
    return target, tp.load_draft(target=target)


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return json.loads((tp.ASSET_DIR / "eval_prompts.json").read_text())


def test_tokenizer_round_trip_and_specials() -> None:
    tok = tp.load_tokenizer()
    for text in ["def f(x):\n    return x + 1\n", "  é ünï ✓ \t\r\n\x00 😀", 'class A:\n    """Doc."""\n']:
        assert tok.decode(tok.encode(text).ids) == text
    assert [tok.token_to_id(t) for t in ("<|pad|>", "<|bos|>", "<|endoftext|>", "<|mask|>")] == [0, 1, 2, 3]
    tcfg = json.loads((tp.TARGET_DIR / "tokenizer_config.json").read_text())
    assert tcfg["mask_token"] == "<|mask|>" and tcfg["eos_token"] == "<|endoftext|>"


def test_checkpoint_layouts() -> None:
    t = json.loads((tp.TARGET_DIR / "config.json").read_text())
    d = json.loads((tp.DRAFT_DIR / "config.json").read_text())
    assert t["model_type"] == "qwen3" and t["architectures"] == ["Qwen3ForCausalLM"]
    assert d["model_type"] == "qwen3" and d["architectures"] == ["Qwen3DSparkModel"]
    assert d["num_target_layers"] == t["num_hidden_layers"]
    assert max(d["target_layer_ids"]) < t["num_hidden_layers"] - 1  # never the final-normed last layer
    assert d["mask_token_id"] == 3 and d["markov_head_type"] == "vanilla"
    for k in ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps"):
        assert d[k] == t[k], k
    H, V, r = d["hidden_size"], d["vocab_size"], d["markov_rank"]
    with safe_open(str(tp.DRAFT_DIR / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["fc.weight"] == (H, len(d["target_layer_ids"]) * H)
    assert shapes["hidden_norm.weight"] == (H,) and shapes["norm.weight"] == (H,)
    assert shapes["markov_head.markov_w1.weight"] == (V, r) == shapes["markov_head.markov_w2.weight"]
    assert {f"layers.{i}.self_attn.k_norm.weight" for i in range(d["num_hidden_layers"])} <= shapes.keys()
    with safe_open(str(tp.TARGET_DIR / "model.safetensors"), "pt") as f:
        tw = {k: f.get_tensor(k) for k in ("model.embed_tokens.weight", "lm_head.weight")}
    with safe_open(str(tp.DRAFT_DIR / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("embed_tokens.weight"), tw["model.embed_tokens.weight"])
        assert torch.equal(f.get_tensor("lm_head.weight"), tw["lm_head.weight"])


def test_target_generates_deterministically(pair: tuple, prompts: list[dict]) -> None:
    target, _ = pair
    tok = tp.load_tokenizer()
    ids = torch.tensor([prompts[0]["ids"]])
    a = tp.greedy_generate(target, ids, 32)
    b = tp.greedy_generate(target, ids, 32)
    assert torch.equal(a, b)
    # KV-cached greedy == argmax of one full forward over the result (the rows are consistent).
    full = target(input_ids=a).logits[0, ids.shape[1] - 1 : -1].argmax(-1)
    assert torch.equal(full, a[0, ids.shape[1] :])
    text = tok.decode(a[0, ids.shape[1] :].tolist())
    assert "\n" in text and len(set(text)) > 5


def test_training_forward_equals_the_drafter(pair: tuple) -> None:
    """The masked many-anchor training forward equals the production drafter's paged, batched
    drafting row for row (same network, two ways of reaching the context)."""
    from draft_server.drafters import DraftItem, IngestItem
    from protocol import GREEDY

    target, _ = pair
    d = tp.load_draft(target=target, dtype=torch.float64)
    B = d.c.block_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, d.c.vocab_size, (1, 40), generator=g)
    taps, _ = tp.target_taps(target, ids, d.c.target_layer_ids)
    anchors = [7, 23, 35]
    drafter = d.drafter()
    items = []
    for n, p in enumerate(anchors):
        assert drafter.reserve(n, 0, p + B)
        drafter.ingest([IngestItem(n, 0, 0, tp.bf16_bits(taps[0, :p]))])
        items.append(DraftItem(n, 0, p, int(ids[0, p]), B, GREEDY))
    outs, logits = drafter.draft_debug(items)
    prev = torch.tensor([[[int(ids[0, p]), *o.tokens[: B - 1]] for p, o in zip(anchors, outs, strict=True)]])
    batched = d.train_logits(taps.double(), torch.tensor([anchors]), ids, prev)
    for n in range(len(anchors)):
        torch.testing.assert_close(batched[0, n], logits[n], rtol=0, atol=1e-10)
        assert batched[0, n].argmax(-1).tolist() == outs[n].tokens


def test_held_out_acceptance(pair: tuple, prompts: list[dict]) -> None:
    target, draft = pair
    stats = tp.AcceptStats()
    for pr in prompts[:2]:
        tp.acceptance(target, draft, pr["ids"], 48, stats=stats)
    assert stats.steps > 0
    assert stats.mean > 1.5, stats


def test_confidence_head_is_calibrated(pair: tuple, prompts: list[dict]) -> None:
    """The shipped confidence head (draft_tools/tiny_pair/confidence.py) through the production
    drafter on the 8 shipped held-out prompts: confidences in (0, 1) for every draft, prefix
    survival ∏ c_i per position near the observed rate and expected accepted drafts within 25 %
    (these 8 are harder than the 32 of ``assets/confidence.json``, where every position is within
    0.02: the head overpredicts their tail by up to 0.16), and steps it ranks high survive far more
    often than steps it ranks low."""
    from draft_tools.tiny_pair.confidence import calibration

    target, draft = pair
    assert draft.c.confidence and draft.c.confidence_with_markov
    events: list[tuple[list[float], int]] = []
    for pr in prompts:
        tp.acceptance(target, draft, pr["ids"], 96, events=events)
    assert all(len(c) == draft.c.block_size and all(0 < x < 1 for x in c) for c, _ in events)
    cal = calibration(events, draft.c.block_size)
    for row in cal["positions"]:
        assert abs(row["survival_predicted"] - row["survival_observed"]) < 0.2, row
    assert abs(cal["expected_accepted_predicted"] / cal["expected_accepted_observed"] - 1) < 0.25, cal
    bins = cal["reliability"]
    low = [b for b in bins if b["bin"][1] <= 0.5]
    high = [b for b in bins if b["bin"][0] >= 0.5]
    rate = lambda bs: sum(b["observed"] * b["n"] for b in bs) / sum(b["n"] for b in bs)  # noqa: E731
    assert rate(high) > rate(low) + 0.3, bins
