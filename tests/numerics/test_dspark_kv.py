"""The paged KV cache and the batched draft path: reservation semantics, overwrite, gaps, batching.

reserve(key, start, end) holds exactly the pages covering [start, end) or fails changing
nothing; rewrites land in place; a gap restart never sees stale rows; drafts of 16 sessions
in one batch equal each drafted alone; greedy reruns are exact; a context outside the
reservation is a loud error, never silent garbage.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draft_server.drafters.base import DraftItem, IngestItem
from draft_server.models import load_drafter
from draft_server.models.kv_cache import PagedKVCache
from draft_server.models.tiny import make_tiny
from protocol import GREEDY, Sampling


def taps(seed: int, rows: int, width: int) -> np.ndarray:
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32))
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@pytest.fixture(scope="module", params=["k3", "qwen3"])
def drafter(request, tmp_path_factory):
    p = make_tiny(request.param, str(tmp_path_factory.mktemp(request.param)), seed=1)
    return load_drafter(p.draft, p.target, "cpu", "float32", kv_budget_bytes=4 << 20, page_size=4)


def test_reserve_holds_exactly_the_span():
    kv = PagedKVCache(1, (2,), num_pages=4, page_size=4, dtype=torch.float32, device=torch.device("cpu"))
    assert kv.capacity_tokens() == 16 and kv.used_tokens() == 0
    assert kv.reserve(1, 0, 10) and kv.used_tokens() == 12  # pages for 0-3, 4-7, 8-11
    assert kv.reserve(1, 5, 10) and kv.used_tokens() == 8  # page 0-3 freed
    assert not kv.reserve(2, 0, 12)  # 3 pages wanted, 2 free: refused ...
    assert kv.used_tokens() == 8 and kv.held_tokens(2) == 0  # ... changing nothing
    assert kv.reserve(1, 4, 16) and kv.used_tokens() == 12  # grows in place
    assert not kv.reserve(1, 0, 20)  # 5 pages > capacity
    assert kv.held_tokens(1) == 12
    assert kv.reserve(2, 3, 4) and kv.used_tokens() == 16
    kv.release(1)
    kv.release(99)  # unknown: no-op
    assert kv.used_tokens() == 4 and kv.held_tokens(1) == 0 and kv.held_tokens(2) == 4
    assert kv.reserve(2, 7, 7) and kv.used_tokens() == 0  # empty span holds nothing
    with pytest.raises(RuntimeError, match="no pages reserved"):
        kv.slots(2, np.array([7]))


def test_growing_and_shrinking_at_the_end_keeps_every_held_row_in_place():
    """The decode path: a span that only moves its end keeps the slots of the positions it still
    holds, frees exactly the pages past the new end, and takes new pages only for the new tail.
    Pages count from the span's start (5): position t is at offset (t - 5) % P."""
    P = 4
    kv = PagedKVCache(1, (1,), num_pages=8, page_size=P, dtype=torch.float32, device=torch.device("cpu"))
    assert kv.reserve(1, 5, 13)  # pages for [5, 9), [9, 13)
    first = kv.slots(1, np.arange(5, 13))
    assert np.array_equal(first % P, (np.arange(5, 13) - 5) % P)  # the span starts at offset 0
    assert kv.reserve(1, 5, 24) and kv.used_tokens() == 5 * P  # grows by 3 pages, to [5, 25)
    assert np.array_equal(kv.slots(1, np.arange(5, 13)), first)
    grown = kv.slots(1, np.arange(5, 24))
    assert kv.reserve(1, 5, 9) and kv.used_tokens() == 1 * P  # shrinks to its first page
    assert np.array_equal(kv.slots(1, np.arange(5, 9)), grown[:4])
    assert not kv.reserve(1, 5, 5 + 9 * P)  # more than the pool: refused, nothing changed
    assert np.array_equal(kv.slots(1, np.arange(5, 9)), grown[:4]) and kv.used_tokens() == 1 * P
    assert kv.reserve(2, 0, 7 * P)  # the freed pages are all handed out again, none twice
    assert len(set(kv.slots(2, np.arange(7 * P)) // P) | set(kv.slots(1, np.arange(5, 9)) // P)) == 8


def test_a_new_start_is_a_new_span_from_a_page_boundary() -> None:
    """A restart (another start) frees the old span's pages and lays the new one out from offset 0;
    a refused one changes nothing."""
    P = 4
    kv = PagedKVCache(1, (1,), num_pages=4, page_size=P, dtype=torch.float32, device=torch.device("cpu"))
    assert kv.reserve(1, 0, 10) and kv.used_tokens() == 3 * P
    assert kv.reserve(1, 7, 13) and kv.used_tokens() == 2 * P  # [7, 13): 2 pages, not 3
    assert kv.slots(1, np.array([7]))[0] % P == 0
    with pytest.raises(RuntimeError):
        kv.slots(1, np.array([6]))  # before the new start: not held
    assert kv.reserve(2, 0, 2 * P)
    held = kv.slots(1, np.arange(7, 13))
    assert not kv.reserve(1, 1, 1 + 3 * P + 1)  # 4 pages with 2 free + its own 2: refused
    assert np.array_equal(kv.slots(1, np.arange(7, 13)), held)
    origin, pages = kv.pages(1, 9, 13)
    assert origin == 7 and len(pages) == 2  # position t at offset (t - 7) % P of page (t - 7) // P
    with pytest.raises(RuntimeError, match="session 1 has no pages reserved for \\[6, 13\\)"):
        kv.spans([2, 1], [0, 6], [P, 13])  # one session of the batch past its span: named
    with pytest.raises(RuntimeError, match="session 9 has no pages"):
        kv.spans([1, 9], [7, 0], [13, 1])


ops = st.lists(
    st.tuples(st.sampled_from(["reserve", "release"]), st.integers(0, 3), st.integers(0, 60), st.integers(0, 30)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_reserve_release_invariants(seq):
    """Against a plain model: a session holds exactly the pages covering its last granted span."""
    P, pages = 4, 8
    kv = PagedKVCache(1, (1,), num_pages=pages, page_size=P, dtype=torch.float32, device=torch.device("cpu"))
    held: dict[int, tuple[int, int]] = {}

    def npages(span: tuple[int, int]) -> int:
        a, b = span
        return 0 if b <= a else (b - a - 1) // P + 1

    for op, key, start, length in seq:
        if op == "release":
            kv.release(key)
            held.pop(key, None)
        else:
            span = (start, start + length)
            others = sum(npages(s) for k, s in held.items() if k != key)
            before = held.get(key, (0, 0))
            same_start = key in held and before[0] == span[0]
            kept = np.arange(span[0], min(before[1], span[1])) if same_start else np.arange(0)  # rows kept
            old_slots = kv.slots(key, kept) if len(kept) else None
            ok = kv.reserve(key, *span)
            assert ok == (others + npages(span) <= pages)
            if ok:
                held[key] = span
                if old_slots is not None:  # a position held before and after keeps its slot (its row)
                    assert np.array_equal(kv.slots(key, kept), old_slots)
        assert kv.used_tokens() == P * sum(npages(s) for s in held.values())
        for k, (a, b) in held.items():
            assert kv.held_tokens(k) == P * npages((a, b))
            if b > a:
                slots = kv.slots(k, np.arange(a, b))
                assert len(set(slots.tolist())) == b - a  # distinct slots, no sharing across positions
                origin, pg = kv.pages(k, a, b)  # the array it keeps between calls follows every change
                t = np.arange(a, b) - origin
                assert origin == a and np.array_equal(pg[t // P] * P + t % P, slots)
        spans = [(k, a, b) for k, (a, b) in held.items() if b > a]
        if spans:  # a batch's lookup in one pass: the same as each session's own
            keys, starts, ends = zip(*spans, strict=True)
            origins, pgs = kv.spans(keys, starts, ends)
            for (k, a, b), origin, pg in zip(spans, origins, pgs, strict=True):
                want_origin, want = kv.pages(k, a, b)
                assert origin == want_origin and np.array_equal(pg, want)
        all_pages = [p for k in held for p in kv._sessions[k].pages]
        assert len(all_pages) == len(set(all_pages))  # no page owned twice


def test_capacity_comes_from_the_budget(drafter):
    per_token = drafter.cfg.num_layers * int(np.prod(drafter.model.token_shape)) * 4
    assert drafter.capacity_tokens() == (4 << 20) // (per_token * 4) * 4
    if drafter.cfg.variant == "k3":
        assert drafter.model.token_shape == (drafter.cfg.kv_lora_rank + drafter.cfg.qk_rope_head_dim,)
    else:
        assert drafter.model.token_shape == (2, drafter.cfg.num_kv_heads, drafter.cfg.head_dim)


def _draft(d, key, start, pos, anchor=7, k=None, sampling=GREEDY):
    return d.draft([DraftItem(key, start, pos, anchor, k or d.contract.block_size, sampling)])[0]


def test_overwrite_equals_fresh_history(drafter):
    w = drafter.contract.tap_width
    a, b = taps(1, 10, w), taps(2, 4, w)
    assert drafter.reserve(100, 0, 10) and drafter.reserve(101, 0, 10)
    drafter.ingest([IngestItem(100, 0, 0, a)])
    drafter.ingest([IngestItem(100, 0, 6, b)])  # rows 6..9 rewritten (rejected block / resend)
    drafter.ingest([IngestItem(101, 0, 0, np.concatenate([a[:6], b]))])
    assert _draft(drafter, 100, 0, 10).tokens == _draft(drafter, 101, 0, 10).tokens
    drafter.release(100)
    drafter.release(101)


def test_gap_restart_never_sees_stale_rows(drafter):
    w = drafter.contract.tap_width
    assert drafter.reserve(200, 0, 20)
    drafter.ingest([IngestItem(200, 0, 0, taps(3, 20, w))])
    new = taps(4, 3, w)
    assert drafter.reserve(200, 22, 25)  # restart at 22: pages of 20-23 are kept, 0-19 freed
    drafter.ingest([IngestItem(200, 22, 22, new)])
    assert drafter.reserve(201, 22, 25)
    drafter.ingest([IngestItem(201, 22, 22, new)])
    assert _draft(drafter, 200, 22, 25).tokens == _draft(drafter, 201, 22, 25).tokens
    drafter.release(200)
    drafter.release(201)


def test_batch_of_16_equals_each_alone_and_reruns_are_exact(drafter):
    w = drafter.contract.tap_width
    items, ingest = [], []
    for s in range(16):
        n = 1 + 5 * s % 37
        assert drafter.reserve(300 + s, 2 * s, 2 * s + n)
        ingest.append(IngestItem(300 + s, 2 * s, 2 * s, taps(10 + s, n, w)))
        samp = Sampling(temperature=0.7, top_p=0.9, seed=s, return_probs=2) if s % 3 == 0 else Sampling()
        items.append(DraftItem(300 + s, 2 * s, 2 * s + n, (13 * s) % 300, 1 + s % drafter.contract.block_size, samp))
    drafter.ingest(ingest)
    together = drafter.draft(items)
    assert [len(o.tokens) for o in together] == [it.k for it in items]
    assert [o.tokens for o in drafter.draft(items)] == [o.tokens for o in together]  # reruns are exact
    for it, out in zip(items, together, strict=True):
        alone = drafter.draft([it])[0]
        assert alone.tokens == out.tokens
        np.testing.assert_allclose(alone.confidence, out.confidence, rtol=1e-4, atol=1e-5)
    for s in range(16):
        drafter.release(300 + s)


def test_k_zero_and_context_outside_the_reservation(drafter):
    w = drafter.contract.tap_width
    assert drafter.draft([DraftItem(400, 0, 5, 1, 0, Sampling())])[0].tokens == []
    assert drafter.reserve(400, 0, 4)
    with pytest.raises(RuntimeError, match="no pages reserved"):
        drafter.ingest([IngestItem(400, 0, 0, taps(5, 9, w))])
    with pytest.raises(RuntimeError, match="no pages reserved"):
        _draft(drafter, 400, 0, 9)
    drafter.release(400)
