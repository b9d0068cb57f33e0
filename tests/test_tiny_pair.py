"""Checks of the shipped tiny Qwen3 target + DSpark draft pair (draft_server/assets/tiny_pair).

Loads the pair as shipped and checks: tokenizer round trip and special ids, the checkpoint
layouts, deterministic greedy generation, that the training-time (masked many-anchor) forward
equals the incremental engine-style forward, held-out greedy acceptance > 1.5, and that the
production drafter (``draft_server.models.load_drafter``) gives the same greedy drafts as
``tiny_pair.DraftCache`` step by step.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from safetensors import safe_open

from draft_server import tiny_pair as tp

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


def test_training_forward_equals_incremental(pair: tuple) -> None:
    target, _ = pair
    d = tp.load_draft(target=target, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, d.c.vocab_size, (1, 40), generator=g)
    taps, _ = tp.target_taps(target, ids, d.c.target_layer_ids)
    taps = taps.double()
    anchors = torch.tensor([[7, 23, 35]])
    prev = torch.randint(4, d.c.vocab_size, (1, 3, d.c.block_size), generator=g)
    prev[:, :, 0] = ids[0, anchors[0]]
    batched = d.train_logits(taps, anchors, ids, prev)
    for n, p in enumerate(anchors[0].tolist()):
        cache = tp.DraftCache(d)
        cache.ingest(taps[0, :p], 0)
        blk = torch.full((1, d.c.block_size), d.c.mask_token_id)
        blk[0, 0] = ids[0, p]
        kv = [(k[None], v[None]) for k, v in zip(cache.k, cache.v, strict=True)]
        z = d.block_hidden(blk, torch.arange(p, p + d.c.block_size)[None], kv, None)[0]
        ref = d.base_logits(z) + d.markov_head(prev[0, n])
        torch.testing.assert_close(batched[0, n], ref, rtol=0, atol=1e-10)


def test_held_out_acceptance(pair: tuple, prompts: list[dict]) -> None:
    target, draft = pair
    stats = tp.AcceptStats()
    for pr in prompts[:2]:
        tp.acceptance(target, draft, pr["ids"], 48, stats=stats)
    assert stats.steps > 0
    assert stats.mean > 1.5, stats


def _bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def test_production_drafter_matches(pair: tuple, prompts: list[dict]) -> None:
    """Same greedy drafts from the production Drafter as from tiny_pair.DraftCache, per step."""
    models = pytest.importorskip("draft_server.models")
    from draft_server.drafter import DraftItem, IngestItem
    from protocol import GREEDY

    target, draft = pair
    prod = models.load_drafter(str(tp.DRAFT_DIR), str(tp.TARGET_DIR), "cpu", "float32", None)
    assert prod.contract.tap_layer_ids == tuple(i + 1 for i in draft.c.target_layer_ids)
    assert prod.contract.mask_token_id == draft.c.mask_token_id
    B = draft.c.block_size
    for key, pr in enumerate(prompts[:2]):
        prompt = pr["ids"]
        ids = tp.greedy_generate(target, torch.tensor([prompt]), 32)
        taps, _ = tp.target_taps(target, ids, draft.c.target_layer_ids)
        seq = ids[0].tolist()
        cache = tp.DraftCache(draft)
        p = len(prompt)
        assert prod.reserve(key, 0, p + B)
        prod.ingest([IngestItem(key, 0, 0, _bf16_bits(taps[0, :p]))])
        cache.ingest(taps[0, :p], 0)
        steps = 0
        while p < len(seq) - 1:
            mine, mine_logits = cache.draft_logits(seq[p], p)
            outs, logits = prod.draft_debug([DraftItem(key, 0, p, seq[p], B, GREEDY)])
            assert outs[0].tokens == mine, f"prompt {key} step {steps} pos {p}"
            torch.testing.assert_close(logits[0].float(), mine_logits.float(), rtol=1e-4, atol=1e-4)
            acc = 0
            while acc < B and p + 1 + acc < len(seq) and mine[acc] == seq[p + 1 + acc]:
                acc += 1
            assert prod.reserve(key, 0, p + acc + 1 + B)
            prod.ingest([IngestItem(key, 0, p, _bf16_bits(taps[0, p : p + acc + 1]))])
            cache.ingest(taps[0, p : p + acc + 1], p)
            p += acc + 1
            steps += 1
        prod.release(key)
        assert steps >= 5
