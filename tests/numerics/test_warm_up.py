"""Server warm-up: a model runs every batch shape class before the socket binds, and leaves nothing behind."""

from __future__ import annotations

import numpy as np
import pytest

from draft_server.drafters import warm_up
from draft_server.drafters.base import DraftItem, IngestItem
from draft_server.models import load_drafter
from draft_server.models.tiny import make_tiny
from protocol import GREEDY


def _session_drafts(drafter, contract, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    k, end, out = contract.block_size, 0, []
    for step in range(4):
        rows = 12 if step == 0 else 3
        taps = (rng.standard_normal((rows, contract.tap_width)).astype(np.float32).view(np.uint32) >> 16).astype(
            np.uint16
        )
        assert drafter.reserve(7, 0, end + rows + k)
        drafter.ingest([IngestItem(7, 0, end, taps)])
        end += rows
        out.append(
            drafter.draft([DraftItem(7, 0, end, int(rng.integers(0, contract.vocab_size)), k, GREEDY)])[0].tokens
        )
    drafter.release(7)
    return out


@pytest.mark.parametrize("variant", ["k3", "qwen3"])
def test_warm_up_runs_every_batch_class_and_leaves_no_state(tmp_path, variant):
    paths = make_tiny(variant, str(tmp_path / variant), seed=5)
    warmed = load_drafter(paths.draft, paths.target, "cpu", "float64")
    cold = load_drafter(paths.draft, paths.target, "cpu", "float64")
    w = warm_up(warmed, max_batch_sessions=12, prefill_chunk_rows=64)
    assert w["largest_batch"] == 12  # 1, 2, 4, 8, then the configured maximum
    assert warmed.used_tokens() == 0  # every warm-up session released
    assert _session_drafts(warmed, warmed.contract, 1) == _session_drafts(cold, cold.contract, 1)


def test_warm_up_stops_where_the_kv_cache_is_full(tmp_path):
    from draft_server.models.kv_cache import PagedKVCache

    paths = make_tiny("k3", str(tmp_path / "k3"), seed=5)
    probe = load_drafter(paths.draft, paths.target, "cpu", "float32")
    per_token = PagedKVCache.bytes_per_token(probe.cfg.num_layers, probe.model.token_shape, probe.model.dtype)
    # five pages of 16 tokens: five one-page warm-up sessions fit, so batches 1, 2, 4 run and 8 does not
    tiny = load_drafter(paths.draft, paths.target, "cpu", "float32", kv_budget_bytes=5 * 16 * per_token, page_size=16)
    assert tiny.capacity_tokens() == 5 * 16
    assert tiny.contract.block_size + 5 <= 16
    w = warm_up(tiny, max_batch_sessions=64, prefill_chunk_rows=32)
    assert w["largest_batch"] == 4
    assert tiny.used_tokens() == 0
