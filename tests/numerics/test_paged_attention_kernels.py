"""Numerics of the paged draft-block attention kernels (draft_server.models.kernels.paged_attention).

Owns the kernel-level checks, MLA and GQA, causal and not: agreement with the float64 torch oracle on
ragged batches (lo == pos, lo not page aligned, many chunks, one long session, shuffled pages,
first_page > 0), no influence of invisible slots even holding NaN/Inf (bitwise), batch independence
(bitwise), dummy work items, poisoned output buffers, the device work plan and loud overflow.
Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1) on tiny shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from draft_server.models.kernels import paged_attention as pa

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROWS = 7
# (lo, pos, lead): lead = extra logical pages held before lo's page (so first_page = lo // P - lead).
SESSIONS: list[tuple[int, int, int]] = [
    (0, 0, 0),  # empty context: the rows see only the block
    (9, 9, 1),  # lo == pos, not page aligned, first_page > 0
    (3, 30, 0),  # lo not page aligned, two+ chunks
    (5, 93, 1),  # the long one: many chunks
    (17, 40, 2),
]
# tiles span several pages (block_n > P) and tiles within one page (block_n == P)
CONFIGS = {
    "p4": (4, 16, pa.KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)),
    "p16": (16, 32, pa.KernelConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, combine_block_p=4)),
}
KV_LORA, ROPE, MLA_HEADS = 32, 8, 4
KV_HEADS, GROUP, HEAD_DIM = 2, 3, 16


class Case:
    """A random batch on a shuffled paged cache, with the set of slots some session may see."""

    def __init__(
        self,
        layout: str,
        sessions: list[tuple[int, int, int]],
        *,
        page: int,
        seed: int,
        pad_cols: int = 3,
        spare_pages: int = 5,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.layout = layout
        n = len(sessions)
        spans = []
        for lo, pos, lead in sessions:
            first = max(lo // page - lead, 0)
            last = (pos + ROWS - 1) // page + 1  # one more page held past the visible end
            spans.append((first, last))
        num_pages = sum(last - first + 1 for first, last in spans) + spare_pages
        perm = torch.randperm(num_pages, generator=g).tolist()
        max_pages = max(last - first + 1 for first, last in spans) + pad_cols
        self.block_table = torch.randint(0, num_pages, (n, max_pages), generator=g, dtype=torch.int32)
        self.first_page = torch.tensor([f for f, _ in spans], dtype=torch.int32)
        self.lo = torch.tensor([s[0] for s in sessions], dtype=torch.int32)
        self.pos = torch.tensor([s[1] for s in sessions], dtype=torch.int32)
        self.visible = torch.zeros((num_pages, page), dtype=torch.bool)
        for i, ((lo, pos, _), (first, last)) in enumerate(zip(sessions, spans, strict=True)):
            for j in range(last - first + 1):
                self.block_table[i, j] = perm.pop()
            for t in range(lo, pos + ROWS):
                self.visible[self.block_table[i, t // page - first], t % page] = True
        if layout == "mla":
            self.cache = torch.randn((num_pages, page, KV_LORA + ROPE), generator=g)
            self.q = torch.randn((n, ROWS, MLA_HEADS, KV_LORA + ROPE), generator=g)
            self.scale = (KV_LORA + ROPE) ** -0.5
        else:
            self.cache = torch.randn((num_pages, page, 2, KV_HEADS, HEAD_DIM), generator=g)
            self.q = torch.randn((n, ROWS, KV_HEADS * GROUP, HEAD_DIM), generator=g)
            self.scale = HEAD_DIM**-0.5
        self.q = self.q * 2.0  # peakier softmax

    def poisoned_cache(self) -> torch.Tensor:
        """The cache with every slot no session may see set to NaN / +Inf / -Inf."""
        cache = self.cache.clone()
        bad = ~self.visible
        flat = cache.view(cache.shape[0] * cache.shape[1], -1)
        idx = bad.flatten().nonzero().flatten()
        for k, value in enumerate((float("nan"), float("inf"), float("-inf"))):
            flat[idx[k::3]] = value
        return cache

    def args(self, cache: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        c = self.cache if cache is None else cache
        return tuple(x.to(DEVICE) for x in (self.q, c, self.block_table, self.first_page, self.lo, self.pos))

    def run(
        self, *, causal: bool, config_key: str = "p4", cache: torch.Tensor | None = None, **kw: object
    ) -> torch.Tensor:
        _, chunk, cfg = CONFIGS[config_key]
        if self.layout == "mla":
            return pa.mla_paged_attention(
                *self.args(cache), scale=self.scale, causal=causal, kv_lora=KV_LORA, chunk=chunk, config=cfg, **kw
            )
        return pa.gqa_paged_attention(*self.args(cache), scale=self.scale, causal=causal, chunk=chunk, config=cfg, **kw)

    def reference(self, *, causal: bool) -> torch.Tensor:
        return pa.reference_paged_attention(
            *self.args(), scale=self.scale, causal=causal, layout=self.layout, kv_lora=KV_LORA
        )

    def plan(self, config_key: str = "p4", capacity: int | None = None) -> pa.WorkPlan:
        page, chunk, _ = CONFIGS[config_key]
        return pa.plan_work(
            self.lo.to(DEVICE), self.pos.to(DEVICE), rows=ROWS, chunk=chunk, page_size=page, capacity=capacity
        )


def _case(layout: str, config_key: str = "p4", sessions: list[tuple[int, int, int]] | None = None) -> Case:
    page = CONFIGS[config_key][0]
    return Case(layout, SESSIONS if sessions is None else sessions, page=page, seed=1234 + len(layout) + page)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


def _expected_plan(lo: list[int], pos: list[int], *, chunk: int, page: int) -> list[tuple[int, int]]:
    work = []
    for i, (lo_i, pos_i) in enumerate(zip(lo, pos, strict=True)):
        if lo_i < 0 or lo_i > pos_i:
            continue
        base = lo_i // page * page
        work += [(i, c) for c in range(-(-(pos_i + ROWS - base) // chunk))]
    return work


# ---------------------------------------------------------------------------------------------
def test_plan_work_matches_host_plan_and_pads_with_dummies() -> None:
    lo = [0, 9, 3, 5, 20, 17, 0]
    pos = [0, 9, 30, 93, 4, 40, 16]  # session 4 is padding (lo > pos)
    expected = _expected_plan(lo, pos, chunk=16, page=4)
    args = (torch.tensor(lo, device=DEVICE), torch.tensor(pos, device=DEVICE))
    exact = pa.plan_work(*args, rows=ROWS, chunk=16, page_size=4)
    assert exact.capacity == len(expected)
    assert [tuple(r) for r in exact.work.tolist()] == expected
    padded = pa.plan_work(*args, rows=ROWS, chunk=16, page_size=4, capacity=len(expected) + 9)
    assert [tuple(r) for r in padded.work.tolist()] == expected + [(-1, 0)] * 9
    assert int(padded.total) == len(expected)
    counts = [sum(1 for s, _ in expected if s == i) for i in range(len(lo))]
    assert padded.nchunks.tolist() == counts
    assert padded.offsets.tolist() == [sum(counts[:i]) for i in range(len(lo))]
    assert len(expected) <= pa.max_work_items(
        [p - q for p, q in zip(pos, lo, strict=True)], rows=ROWS, chunk=16, page_size=4
    )
    # in place, into preallocated buffers
    buf = pa.WorkPlan.empty(len(lo), len(expected) + 2, rows=ROWS, chunk=16, page_size=4, device=DEVICE)
    buf.work.fill_(77)
    assert pa.plan_work(*args, rows=ROWS, chunk=16, page_size=4, out=buf) is buf
    assert [tuple(r) for r in buf.work.tolist()] == expected + [(-1, 0)] * 2


@pytest.mark.parametrize("layout", ["mla", "gqa"])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_float64_reference(layout: str, causal: bool) -> None:
    case = _case(layout)
    out = case.run(causal=causal)
    ref = case.reference(causal=causal)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["mla", "gqa"])
def test_matches_reference_with_pages_larger_than_tiles(layout: str) -> None:
    case = _case(layout, "p16")
    out = case.run(causal=True, config_key="p16")
    torch.testing.assert_close(out.double(), case.reference(causal=True).double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["mla", "gqa"])
@pytest.mark.parametrize("causal", [True, False])
def test_invisible_slots_holding_nan_and_inf_change_nothing(layout: str, causal: bool) -> None:
    case = _case(layout)
    clean = case.run(causal=causal)
    poisoned = case.run(causal=causal, cache=case.poisoned_cache())
    assert torch.isfinite(poisoned).all()
    assert _bitwise_equal(clean, poisoned)


@pytest.mark.parametrize("layout", ["mla", "gqa"])
def test_session_alone_equals_session_in_batch(layout: str) -> None:
    batch = _case(layout)
    out = batch.run(causal=True)
    for i in (1, 3):  # a short one and the long one, alone (same q and cache, one-row block table)
        alone = Case.__new__(Case)
        alone.__dict__.update(batch.__dict__)
        sl = slice(i, i + 1)
        alone.q, alone.block_table, alone.first_page = batch.q[sl], batch.block_table[sl], batch.first_page[sl]
        alone.lo, alone.pos = batch.lo[sl], batch.pos[sl]
        assert _bitwise_equal(alone.run(causal=True), out[sl])


@pytest.mark.parametrize("layout", ["mla", "gqa"])
def test_dummy_items_padding_sessions_and_poisoned_out(layout: str) -> None:
    # a padding session (lo > pos) in the middle; capacity well past the real work
    sessions = [*SESSIONS[:2], (8, 3, 0), *SESSIONS[2:4]]
    case = _case(layout, sessions=sessions)
    exact = case.run(causal=True)
    plan = case.plan(capacity=int(case.plan().total) + 11)
    rows, heads = case.q.shape[1], case.q.shape[2]
    v_dim = KV_LORA if layout == "mla" else HEAD_DIM
    ws = pa.Workspace.allocate(plan.capacity, rows * heads, v_dim, DEVICE)
    ws.partial_out.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    out = torch.full_like(exact, float("nan"))
    got = case.run(causal=True, plan=plan, workspace=ws, out=out)
    assert got is out
    assert torch.isfinite(out).all()
    assert _bitwise_equal(out, exact)
    assert not out[2].any()  # the padding session: zeros
    torch.testing.assert_close(out.double(), case.reference(causal=True).double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["mla", "gqa"])
def test_chunk_size_changes_only_rounding(layout: str) -> None:
    case = _case(layout)
    a = case.run(causal=True)
    page = CONFIGS["p4"][0]
    plan = pa.plan_work(case.lo.to(DEVICE), case.pos.to(DEVICE), rows=ROWS, chunk=4 * 32, page_size=page)
    assert int(plan.nchunks.max()) == 1  # every session in one chunk: the stage-1 direct path
    b = case.run(causal=True, plan=plan)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_overflowing_plan_is_loud_not_wrong() -> None:
    case = _case("mla")
    full = case.run(causal=True)
    plan = case.plan(capacity=4)  # sessions 0, 1 take items 0..1; session 2 needs items 2..4
    nch, off = plan.nchunks.tolist(), plan.offsets.tolist()
    out = case.run(causal=True, plan=plan)
    fits = [off[i] + nch[i] <= plan.capacity for i in range(len(SESSIONS))]
    assert any(fits) and not all(fits) and int(plan.total) > plan.capacity
    for i, ok in enumerate(fits):
        if ok:
            assert _bitwise_equal(out[i], full[i])
        else:
            assert torch.isnan(out[i]).all()


def test_mla_separate_rope_query_through_strides_equals_concatenated() -> None:
    """q_lat and q_pe passed apart, each a non-contiguous view (as the model's einsum leaves them)."""
    case = _case("mla")
    whole = case.run(causal=True)
    n, rows, heads, _ = case.q.shape
    # q_lat stored head-major (the bmm layout), q_pe inside a wider buffer
    lat = case.q[..., :KV_LORA].permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    wide = torch.zeros(n, rows, heads, ROPE + 5)
    wide[..., 2 : 2 + ROPE] = case.q[..., KV_LORA:]
    q_pe = wide[..., 2 : 2 + ROPE]
    assert not lat.is_contiguous() and not q_pe.is_contiguous()
    _, chunk, cfg = CONFIGS["p4"]
    args = [x.to(DEVICE) for x in (lat, case.cache, case.block_table, case.first_page, case.lo, case.pos)]
    apart = pa.mla_paged_attention(
        *args, scale=case.scale, causal=True, kv_lora=KV_LORA, chunk=chunk, config=cfg, q_rope=q_pe.to(DEVICE)
    )
    assert _bitwise_equal(apart, whole)


@pytest.mark.parametrize("layout", ["mla", "gqa"])
def test_block_width_narrows_what_a_non_causal_block_sees(layout: str) -> None:
    """A block of k < Bq rows (vLLM's width for k drafts): every row sees the context and the
    block's first k rows only, per session; width Bq is the whole block."""
    case = _case(layout)
    n = len(SESSIONS)
    width = torch.tensor([ROWS, 1, 3, ROWS - 1, 2], dtype=torch.int32)[:n]
    got = case.run(causal=False, width=width.to(DEVICE))
    ref = pa.reference_paged_attention(
        *case.args(), scale=case.scale, causal=False, layout=layout, kv_lora=KV_LORA, width=width
    )
    torch.testing.assert_close(got.double(), ref.double(), rtol=1e-5, atol=1e-5)
    full = case.run(causal=False)
    assert _bitwise_equal(got[0], full[0])  # width Bq: unchanged
    assert not torch.allclose(got[1], full[1])  # width 1: the block's other rows are out of sight


def test_stage_rows_matches_host_form_and_pads() -> None:
    """The draft batch's block rows made on the device (``stage_rows``) equal the host's form: ids
    (anchor, then the mask id), absolute positions, and slots through each session's ragged pages
    from its first page's offset 0; sessions past the count get ids 0, positions 0 and the trash slot."""
    P, rows, n_max, mask_id, trash = 4, ROWS, 8, 99, 1000
    g = torch.Generator().manual_seed(3)
    # (anchor, absolute start of the block, origin): the block's rows sit at pos = t0 - origin onward
    sessions = [(5, 40, 36), (7, 9, 0), (11, 130, 124)]
    scalars = torch.zeros(6 * n_max + 1, dtype=torch.int32)
    pages: list[int] = []
    want_ids, want_pos, want_slots = [], [], []
    for i, (anchor, t0, origin) in enumerate(sessions):
        pos = t0 - origin
        mine = torch.randperm(200, generator=g)[: (pos + rows - 1) // P + 1].tolist()
        for f, v in enumerate((anchor, t0, 0, pos, -len(pages), rows)):
            scalars[f * n_max + i] = v
        want_ids.append([anchor] + [mask_id] * (rows - 1))
        want_pos.append([t0 + j for j in range(rows)])
        want_slots.append([mine[(pos + j) // P] * P + (pos + j) % P for j in range(rows)])
        pages.extend(mine)
    scalars[6 * n_max] = len(sessions)
    nb = 5  # two padding sessions
    for _ in range(nb - len(sessions)):
        want_ids.append([0] * rows)
        want_pos.append([0] * rows)
        want_slots.append([trash] * rows)
    ids, positions, slots = (torch.full((nb, rows), -7, dtype=torch.int32, device=DEVICE) for _ in range(3))
    pa.stage_rows(
        scalars.to(DEVICE), torch.tensor(pages, dtype=torch.int32, device=DEVICE), ids, positions, slots,
        mask_id=mask_id, trash_slot=trash, page_size=P,
    )  # fmt: skip
    assert ids.cpu().tolist() == want_ids
    assert positions.cpu().tolist() == want_pos
    assert slots.cpu().tolist() == want_slots
