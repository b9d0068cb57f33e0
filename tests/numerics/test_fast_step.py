"""The fast draft step (paged Triton kernels, device-side Markov chain, static buffers; CUDA graphs
on a GPU) against the dense eager reference, and a NaN-tapped session's neighbours.

On the CPU the kernels run under Triton's interpreter and the step runs uncaptured (the same
body a CUDA graph captures); float32, so greedy drafts must be identical token for token.
"""

from __future__ import annotations

import os
import threading
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

from draft_server.drafters import DraftItem, IngestItem
from draft_server.models import load_drafter
from draft_server.models.drafter import DSparkDrafter
from draft_server.models.tiny import make_tiny
from protocol import GREEDY, Sampling

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _pair(tmp_path, variant: str, sessions: int = 8, **over) -> tuple[DSparkDrafter, DSparkDrafter]:
    p = make_tiny(variant, str(tmp_path / variant), seed=3, **over)
    dense = load_drafter(p.draft, p.target, DEV, "float32", 16 << 20, page_size=4, attention="dense")
    fast = load_drafter(p.draft, p.target, DEV, "float32", 16 << 20, page_size=4, attention="paged")
    fast.prepare(max_batch_sessions=sessions, max_batch_rows=64)
    assert fast.fast is not None and dense.fast is None
    return dense, fast


def _bits(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    return (rng.standard_normal((rows, width), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _drive(drafters: list[DSparkDrafter], spans: list[tuple[int, int]], rng: np.random.Generator, steps: int):
    """Same sessions on every drafter: prefill [start, end), then steps of ingest + draft."""
    W, B = drafters[0].contract.tap_width, drafters[0].cfg.block_size
    ends = {}
    for key, (start, end) in enumerate(spans):
        taps = _bits(rng, end - start, W)
        for d in drafters:
            assert d.reserve(key, start, end + 3 * steps + B)
            if end > start:
                d.ingest([IngestItem(key, start, start, taps)])
        ends[key] = end
    results = []
    for _ in range(steps):
        new = {k: _bits(rng, 1 + k % 3, W) for k in ends}
        outs = []
        for d in drafters:
            d.ingest([IngestItem(k, spans[k][0], ends[k], new[k]) for k in ends])
            items = [DraftItem(k, spans[k][0], ends[k] + len(new[k]), 3 + k, B - k % 2, GREEDY) for k in ends]
            outs.append(d.draft(items))
        for k in ends:
            ends[k] += len(new[k])
        results.append(outs)
    return results


@pytest.mark.parametrize("variant,over", [("k3", {}), ("qwen3", {}), ("qwen3", {"is_causal": True})])
def test_fast_step_drafts_what_the_dense_reference_drafts(tmp_path, variant: str, over: dict) -> None:
    dense, fast = _pair(tmp_path, variant, **over)
    # gap-restarted (start > 0, not page aligned), empty, short and long contexts; 5 sessions: bucket 8
    spans = [(0, 3), (5, 37), (9, 9), (0, 1), (2, 70)]
    for outs_dense, outs_fast in _drive([dense, fast], spans, np.random.default_rng(0), steps=3):
        assert [o.tokens for o in outs_fast] == [o.tokens for o in outs_dense]
        for a, b in zip(outs_dense, outs_fast, strict=True):
            np.testing.assert_allclose(b.confidence, a.confidence, rtol=1e-4, atol=1e-5)


def test_a_batch_of_twenty_sessions_drafts_what_the_dense_reference_drafts(tmp_path) -> None:
    """Bucket 32 (20 sessions), Qwen3: on a GPU the K/V writer, the RMSNorm + RoPE kernel and the Markov
    kernels run inside the captured graph of a bucket the five-session test never reaches; float32, so
    the drafts must equal the dense path's token for token."""
    dense, fast = _pair(tmp_path, "qwen3", sessions=32)
    spans = [(k % 3, 6 + 5 * k) for k in range(20)]
    for outs_dense, outs_fast in _drive([dense, fast], spans, np.random.default_rng(4), steps=2):
        assert [o.tokens for o in outs_fast] == [o.tokens for o in outs_dense]


def test_sessions_asking_no_drafts_keep_their_places_in_the_batch(tmp_path) -> None:
    """A greedy batch where some sessions ask k = 0: each output stays at its session's index (empty for
    those), the others' drafts are the dense path's; an empty batch drafts nothing; k past the block
    is refused naming the session."""
    dense, fast = _pair(tmp_path, "k3")
    W, B = dense.contract.tap_width, dense.cfg.block_size
    for d in (dense, fast):
        for k in range(4):
            assert d.reserve(k, 0, 8 + B)
            d.ingest([IngestItem(k, 0, 0, _bits(np.random.default_rng(k), 8, W))])
    items = [DraftItem(k, 0, 8, 2 + k, (0, 5, 0, B)[k], GREEDY) for k in range(4)]
    want = [o.tokens for o in dense.draft(items)]
    got = [o.tokens for o in fast.draft(items)]
    assert got == want and [len(t) for t in got] == [0, 5, 0, B]
    assert fast.draft([]) == []
    assert [o.tokens for o in fast.draft([DraftItem(1, 0, 8, 2, 0, GREEDY)])] == [[]]
    with pytest.raises(ValueError, match=f"session 3: k={B + 1} exceeds block_size"):
        fast.draft([DraftItem(1, 0, 8, 2, 3, GREEDY), DraftItem(3, 0, 8, 2, B + 1, GREEDY)])


def test_a_poisoned_session_never_reaches_its_neighbours(tmp_path) -> None:
    """One session's taps hold NaN and Inf: every other session drafts exactly what it drafts when
    that session's taps are clean, on the dense path and the fast path alike. The poisoned session
    is the longest and holds page 0, where the dense path's padding entries point."""
    rng = np.random.default_rng(5)
    rows = {0: 40, 1: 20, 2: 9, 3: 20}
    base: dict[int, np.ndarray] = {}
    for poison in (False, True):
        dense, fast = _pair(tmp_path / str(poison), "k3")  # fresh caches: session 0 gets page 0
        W, B = dense.contract.tap_width, dense.cfg.block_size
        base = base or {k: _bits(rng, rows[k], W) for k in range(4)}
        taps = {k: v.copy() for k, v in base.items()}
        if poison:
            taps[0][3, ::3] = 0x7FC0  # NaN
            taps[0][30, ::5] = 0x7F80  # +Inf
        got = []
        for d in (dense, fast):
            for k in range(4):
                assert d.reserve(k, 0, rows[k] + B)
                d.ingest([IngestItem(k, 0, 0, taps[k])])
            got.append([o.tokens for o in d.draft([DraftItem(k, 0, rows[k], 1, B, GREEDY) for k in range(4)])])
        if not poison:
            clean = got
        else:
            for path in (0, 1):
                others = [t for k, t in enumerate(got[path]) if k != 0]
                assert others == [t for k, t in enumerate(clean[path]) if k != 0]


def test_rows_in_registered_host_memory_go_straight_to_the_device(tmp_path) -> None:
    """Rows living in a registered buffer (a shared-memory ring) skip the staging copy: adjacent
    sessions' rows are one copy, and the drafts equal those of rows copied from ordinary frames."""
    _, plain = _pair(tmp_path / "a", "k3")
    _, ring = _pair(tmp_path / "b", "k3")
    W, B = plain.contract.tap_width, plain.cfg.block_size
    buf = bytearray(64 * W * 2)
    assert ring.register_host(memoryview(buf))
    slab = np.frombuffer(buf, dtype=np.uint16).reshape(64, W)
    rng = np.random.default_rng(7)
    rows = _bits(rng, 40, W)
    slab[:40] = rows
    spans = {0: (0, 9), 1: (9, 20), 2: (20, 40)}  # sessions 0 and 1 adjacent, 2 after them
    for d, src in ((plain, rows.copy()), (ring, slab)):
        for key, (a, b) in spans.items():
            assert d.reserve(key, 0, (b - a) + B)
        d.ingest([IngestItem(key, 0, 0, src[a:b]) for key, (a, b) in spans.items()])
    fast = ring.fast
    assert fast is not None
    runs = fast._registered_runs([slab[a:b] for a, b in spans.values()])
    assert runs is not None and len(runs) == 1 and runs[0].shape == (40, W)  # one run, one copy
    assert fast._registered_runs([rows[:3]]) is None  # not registered: the staging path
    items = [DraftItem(key, 0, b - a, 5, B, GREEDY) for key, (a, b) in spans.items()]
    assert [o.tokens for o in ring.draft(items)] == [o.tokens for o in plain.draft(items)]
    ring.unregister_host(memoryview(buf))
    assert fast._registered_runs([slab[:3]]) is None


def test_device_rows_cut_from_one_steps_rows_go_to_the_staging_buffer_in_one_copy(tmp_path, monkeypatch) -> None:
    """Rows already on the drafter's device (transport cuda_ipc) arrive as one Step's rows cut into its
    entries: neighbouring entries go to the ingest's staging buffer as one device copy (one stream wait),
    not one per entry, on the fast path and the dense path alike; the drafts and the KV cache equal those
    of the same rows from host frames. Two Steps' rows in one ingest are two runs; between another
    client's host rows in the same batch, each run of neighbours is one copy. (On the CPU the
    "device" rows are host tensors: the same code, without the stream.)"""
    import torch

    from draft_server.drafters.base import DeviceRows
    from draft_server.models import step as step_mod

    copies: list[int] = []
    runs = step_mod.device_runs

    def counted(parts):
        out = runs(parts)
        copies.extend(len(d) for d in out)
        return out

    monkeypatch.setattr(step_mod, "device_runs", counted)
    dense, plain = _pair(tmp_path / "a", "k3")
    _, dev = _pair(tmp_path / "b", "k3")
    _, mix = _pair(tmp_path / "c", "k3")  # another client's host rows between them in the same batch
    dense_mix, _ = _pair(tmp_path / "d", "k3")
    W, B = plain.contract.tap_width, plain.cfg.block_size
    rng = np.random.default_rng(11)
    lens = [3, 1, 4, 2, 3]
    first, second = _bits(rng, sum(lens[:3]), W), _bits(rng, sum(lens[3:]), W)  # two Steps' rows
    rows_a = DeviceRows(torch.from_numpy(first.view(np.int16)), None)
    rows_b = DeviceRows(torch.from_numpy(second.view(np.int16)), None)
    cuts, at = [], [0, 0]
    for key, n in enumerate(lens):
        src, i = (rows_a, 0) if key < 3 else (rows_b, 1)
        cuts.append(src[at[i] : at[i] + n])
        at[i] += n
    host = [c.t.numpy().view(np.uint16) for c in cuts]
    for d in (dense, plain, dev, mix, dense_mix):
        for key, n in enumerate(lens):
            assert d.reserve(key, 0, n + B)
    mixed = [host[0], cuts[1], cuts[2], host[3], cuts[4]]
    for d, parts in ((dense, cuts), (plain, host), (dev, cuts), (mix, mixed), (dense_mix, mixed)):
        d.ingest([IngestItem(key, 0, 0, p) for key, p in enumerate(parts)])
    # one copy per Step's rows, not one per entry; beside host rows, each run of neighbours is one
    assert copies == [sum(lens[:3]), sum(lens[3:]), lens[1] + lens[2], lens[4]]
    items = [DraftItem(key, 0, n, 5, B, GREEDY) for key, n in enumerate(lens)]
    want = [o.tokens for o in plain.draft(items)]
    for d in (dev, mix, dense, dense_mix):
        assert [o.tokens for o in d.draft(items)] == want
    for d in (dev, mix):
        assert torch.equal(d.fast.cache.data, plain.fast.cache.data)


def test_sampled_batches_take_the_paged_kernels_and_draw_what_the_dense_path_draws(tmp_path) -> None:
    """A batch with sampled sessions (seeded; one greedy among them) runs the block forward through
    the paged kernels, not the dense gather, and draws the same drafts and probabilities."""
    dense, fast = _pair(tmp_path, "k3")
    W, B = dense.contract.tap_width, dense.cfg.block_size
    rng = np.random.default_rng(4)
    spans = {0: 40, 1: 9, 2: 70}
    for key, n in spans.items():
        taps = _bits(rng, n, W)
        for d in (dense, fast):
            assert d.reserve(key, 0, n + B)
            d.ingest([IngestItem(key, 0, 0, taps)])
    hot = Sampling(temperature=0.8, top_p=0.95, seed=11, return_probs=3)
    items = [DraftItem(k, 0, n, 3 + k, B, GREEDY if k == 1 else hot) for k, n in spans.items()]
    assert fast.fast is not None
    before = fast.fast.eager_steps
    got, want = fast.draft(items), dense.draft(items)
    assert fast.fast.eager_steps == before + 1  # the paged block forward ran (dense has no fast path)
    assert [o.tokens for o in got] == [o.tokens for o in want]
    for a, b in zip(got, want, strict=True):
        assert (a.probs is None) == (b.probs is None)
        if a.probs is not None:
            np.testing.assert_array_equal(a.prob_ids, b.prob_ids)
            np.testing.assert_allclose(a.probs, b.probs, rtol=1e-4, atol=1e-6)


def test_a_mapped_shm_ring_is_registered_and_its_rows_skip_staging(tmp_path) -> None:
    """The server's rings register each mapping with the drafter: rows a Step names in the ring
    are read-only views of it that ingest copies straight to the device; unmapping unregisters."""
    from draft_server.io.rings import Rings
    from target_client.client.ring import ClientRing

    class Gauge:
        def set(self, v: float) -> None:
            self.v = v

    _, plain = _pair(tmp_path / "a", "k3")
    _, drafter = _pair(tmp_path / "b", "k3")
    fast = drafter.fast
    assert fast is not None
    W, B = plain.contract.tap_width, plain.cfg.block_size
    ring = ClientRing(1 << 20)
    rings = Rings(0.01, Gauge(), drafter.register_host, drafter.unregister_host)
    rings.map(b"c", b"c", ring.announce, 1)
    ring.confirm()
    assert len(fast._host_ranges) == 1
    rows = _bits(np.random.default_rng(9), 12, W)
    at = ring.put([rows])
    assert at is not None
    view = rings.rows(b"c", b"c", at, 2).view(np.uint16).reshape(12, W)
    assert not view.flags.writeable and fast._registered_runs([view[:5], view[5:]]) is not None
    for d, src in ((plain, rows), (drafter, view)):
        for key, (a, b) in enumerate(((0, 5), (5, 12))):
            assert d.reserve(key, 0, (b - a) + B)
        d.ingest([IngestItem(key, 0, 0, src[a:b]) for key, (a, b) in enumerate(((0, 5), (5, 12)))])
    items = [DraftItem(0, 0, 5, 3, B, GREEDY), DraftItem(1, 0, 7, 4, B, GREEDY)]
    assert [o.tokens for o in drafter.draft(items)] == [o.tokens for o in plain.draft(items)]
    del view, src  # the engine's references to the rows: gone once the batch is done
    rings._last_sweep = 0.0
    rings.sweep(1e12)  # idle: unmapped, and unregistered first (on a thread of their own)
    end = time.monotonic() + 5.0
    while fast._host_ranges and time.monotonic() < end:
        time.sleep(0.002)
    assert fast._host_ranges == []
    for t in threading.enumerate():  # its unpin (a device-wide sync) must not overlap the next test's capture
        if t.name == "draft-server-ring-unmap":
            t.join(5.0)
    ring.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_mla_session_takes_the_small_tile_shape_and_bigger_batches_do_not(tmp_path, dtype: str) -> None:
    """A one-session MLA batch is planned in chunks of at least ``ONE_SESSION_MLA_CHUNK`` and, in half
    precision, launched with ``MLA_CONFIG_ONE`` (its 3 stages of 32-token tiles do not fit float32);
    batches of 2+ sessions and GQA batches keep the defaults."""
    from draft_server.models import step
    from draft_server.models.kernels import paged_attention as pa

    for variant in ("k3", "qwen3"):
        p = make_tiny(variant, str(tmp_path / variant), seed=3)
        d = load_drafter(p.draft, p.target, DEV, dtype, 16 << 20, page_size=4, attention="paged")
        d.prepare(max_batch_sessions=4, max_batch_rows=64)
        f = d.fast
        assert f is not None
        for n in (1, 2, 4):
            chunk = f._chunk(n * (step.TYPICAL_CONTEXT + f.B))
            config = f._batch(n, 8, chunk).config
            one = variant == "k3" and n == 1
            assert (chunk >= step.ONE_SESSION_MLA_CHUNK) if one else True
            assert config is (pa.MLA_CONFIG_ONE if one and dtype == "bfloat16" else None), (variant, n, config)


@pytest.mark.parametrize("spans", [1, 3, 21])
def test_an_ingests_slots_made_on_the_device_are_the_caches(tmp_path, spans: int) -> None:
    """The ingest graph's first kernel (``pa.ingest_rows``, from ``_describe``'s items and pages) gives
    each row the cache's own slot (``PagedKVCache.slots``) and its absolute position, for items starting
    mid-page, crossing pages, mid-sequence, one to many in a call; the bucket's padding rows go to the
    trash slot at position 0."""
    _, d = _pair(tmp_path, "k3", sessions=32)
    fast = d.fast
    assert fast is not None
    rng = np.random.default_rng(spans)
    W, items, want_slots, want_pos = d.contract.tap_width, [], [], []
    rows = 0
    for key in range(spans):
        start = int(rng.integers(0, 9))
        first = start + int(rng.integers(0, 11))  # mid-page (pages of 4) more often than not
        count = 37 if spans == 1 else int(rng.integers(1, 8 if spans < 8 else 4))
        assert d.reserve(key, start, first + count)
        items.append(IngestItem(key, start, first, _bits(rng, count, W)))
        positions = np.arange(first, first + count, dtype=np.int64)
        want_slots += d.cache.slots(key, positions).tolist()
        want_pos += positions.tolist()
        rows += count
    assert rows <= fast.r_max
    d.ingest(items)
    rb = next(b for b in fast.row_buckets if b >= max(rows, 16))
    got = fast.ing.cpu().tolist()
    assert got[:rows] == want_slots
    assert got[fast.r_max : fast.r_max + rows] == want_pos
    assert got[rows:rb] == [d.cache.trash_slot] * (rb - rows)
    assert got[fast.r_max + rows : fast.r_max + rb] == [0] * (rb - rows)
    assert len(set(want_slots)) == rows  # distinct cache slots


@pytest.mark.parametrize("registered", [False, True])
def test_padding_rows_of_every_ingest_bucket_hold_zeros(tmp_path, monkeypatch, registered: bool) -> None:
    """An ingest bucket's padding rows (past the rows sent) are zeros whatever ingests came before:
    a long ingest's rows past a later short one's bucket are zeroed once a bucket that covers them
    is used, and rows from ordinary frames (zeros copied up with them) and from registered memory
    (zeroed on the device, no memset when nothing past the rows is dirty) alike. Decode-sized
    ingests after a long one zero their bucket once, not at every step."""
    _, d = _pair(tmp_path, "k3")
    fast = d.fast
    assert fast is not None
    W = d.contract.tap_width
    buf = bytearray(64 * W * 2)
    slab = np.frombuffer(buf, dtype=np.uint16).reshape(64, W)
    if registered:
        assert d.register_host(memoryview(buf))
    rng = np.random.default_rng(5)
    slab[:] = _bits(rng, 64, W) | 1  # no row is all zeros
    assert d.reserve(0, 0, 200)
    end = 0
    for rows in (40, 3, 20, 3, 3, 17, 64, 5):
        d.ingest([IngestItem(0, 0, end, slab[:rows])])
        end += rows
        rb = next(b for b in fast.row_buckets if b >= max(rows, 16))
        dev = fast._rows(fast.rows, "bf16").cpu()
        assert (dev[:rows].view(torch.int16).numpy().view(np.uint16) == slab[:rows]).all()
        assert not dev[rows:rb].view(torch.int16).any(), f"padding rows {rows}..{rb} not zero"
    memsets: list[int] = []
    zero_ = torch.Tensor.zero_
    monkeypatch.setattr(torch.Tensor, "zero_", lambda t: memsets.append(t.numel()) or zero_(t))
    for _ in range(4):  # after the 64 and 5 rows above: rows 3..5 are the only dirty ones in the bucket
        d.ingest([IngestItem(0, 0, end, slab[:3])])
        end += 3
        dev = fast._rows(fast.rows, "bf16").cpu()
        assert not dev[3:16].view(torch.int16).any(), "padding rows 3..16 not zero"
    monkeypatch.undo()
    assert len(memsets) == (1 if registered else 0), memsets  # frames bring their zeros with them
    if registered:
        d.unregister_host(memoryview(buf))


def test_graph_capture_holds_garbage_collection_off_after_one_collection() -> None:
    """``no_collection`` (around ``FastStep``'s captures): garbage waiting in cycles is collected on the
    way in, no collection runs inside, and the collector is left as it was found, also on an error."""
    import gc
    import weakref

    from draft_server.models.step import no_collection

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    assert gc.isenabled()
    with no_collection():
        assert gone() is None
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_collection():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            pass
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()
