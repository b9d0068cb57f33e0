"""Block width: a session asking for k drafts runs a block of k rows, as vLLM's in-process DSpark
(a block of ``num_speculative_tokens``), not the checkpoint's trained ``block_size``.

The DSpark block is not causal, so the width changes the drafts. The check that our width-k block
is vLLM's: the same weights saved with ``block_size = k`` (every row of that block is one of ours)
draft exactly what our width-k block drafts, on the dense and the paged path (CPU, float32), with
sessions of several widths in one batch; ``block_width="trained"`` keeps the old behaviour.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

from draft_server.drafters import DraftItem, IngestItem
from draft_server.models import load_drafter
from draft_server.models.drafter import DSparkDrafter
from draft_server.models.tiny import make_tiny
from protocol import GREEDY


def _load(path: str, target: str, attention: str, block_width: str = "k") -> DSparkDrafter:
    d = load_drafter(
        path, target, "cpu", "float32", 16 << 20, page_size=4, attention=attention, block_width=block_width
    )
    if attention == "paged":
        d.prepare(max_batch_sessions=4, max_batch_rows=64)
    return d


def _drafts(d: DSparkDrafter, ks: list[int], seed: int = 0) -> list[list[int]]:
    """Sessions with 20, 33 and 9 context rows (the same taps on every drafter); drafts of k each."""
    rng = np.random.default_rng(seed)
    W, B = d.contract.tap_width, d.cfg.block_size
    ctx = [20, 33, 9]
    for key, n in enumerate(ctx):
        assert d.reserve(key, 0, n + B)
        bits = (rng.standard_normal((n, W), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        d.ingest([IngestItem(key, 0, 0, bits)])
    out = d.draft([DraftItem(key, 0, n, 5 + key, k, GREEDY) for key, (n, k) in enumerate(zip(ctx, ks, strict=True))])
    for key in range(len(ctx)):
        d.release(key)
    return [o.tokens for o in out]


@pytest.mark.parametrize("attention", ["dense", "paged"])
def test_a_width_k_block_drafts_what_a_k_row_checkpoint_drafts(tmp_path, attention: str) -> None:
    wide = make_tiny("qwen3", str(tmp_path / "wide"), seed=3)  # block_size 8, not causal
    drafter = _load(wide.draft, wide.target, attention)
    assert drafter.cfg.block_size == 8 and not drafter.cfg.causal
    for k in (3, 5):
        narrow = make_tiny("qwen3", str(tmp_path / f"k{k}"), seed=3, block_size=k)  # the same weights
        ref = _load(narrow.draft, narrow.target, "dense")
        assert torch.equal(ref.model.lm_head, drafter.model.lm_head)
        # one batch, three widths: k, k, and the full block (k = 8 equals the trained behaviour)
        got = _drafts(drafter, [k, k, 8])
        want = _drafts(ref, [k, k, k])
        assert got[:2] == want[:2], (k, got, want)
    trained = _load(wide.draft, wide.target, attention, block_width="trained")
    full = _drafts(drafter, [8, 8, 8])
    assert _drafts(trained, [8, 8, 8]) == full  # width = block_size: one and the same
    short_k, short_t = _drafts(drafter, [3, 3, 3]), _drafts(trained, [3, 3, 3])
    assert [t[:3] for t in full] == short_t  # trained: the first k of the full block
    assert short_k != short_t  # k rows see fewer block rows: other drafts (the reason this exists)


def test_block_width_is_checked() -> None:
    from draft_server.config import ServerConfig
    from draft_server.models.config import CheckpointError

    with pytest.raises(ValueError, match="block width"):
        ServerConfig(block_width="wide").validate()
    with pytest.raises(CheckpointError, match="block width"):
        DSparkDrafter.__init__(object.__new__(DSparkDrafter), None, block_width="wide")  # type: ignore[arg-type]
