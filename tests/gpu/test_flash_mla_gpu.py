"""FlashMLA on a Hopper GPU (skipped elsewhere, and where ``DRAFT_FLASHMLA_SRC`` names no FlashMLA tree):

1. The kernel through our binding against our Triton kernel and a float32 reference on the same
   cache, with NaN in every page tail and unused page: bf16-close, never NaN.
2. A K3-dims drafter on 64-token pages takes FlashMLA (its start-up self-test replays every captured
   bucket against eager), drafts what it drafts eagerly, keeps a NaN-tapped session's neighbours
   exactly as they are with clean taps, keeps a session starting mid-sequence on the graph, and serves
   a draft asked from a later start than its span's (the mixed eager body).
FlashMLA's split plan depends on the whole batch, so unlike the float32 Triton path its bf16 rows are
not bitwise independent of the other sessions (neither are bf16 GEMMs across buckets).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("FlashMLA needs a CUDA GPU", allow_module_level=True)

from draft_server.drafters import DraftItem, IngestItem  # noqa: E402
from draft_server.models.kernels import flash_mla as fm  # noqa: E402
from draft_server.models.kernels import paged_attention as pa  # noqa: E402
from draft_server.models.presets import random_drafter  # noqa: E402
from draft_server.models.tiny import K3_CONFIG  # noqa: E402
from protocol import GREEDY  # noqa: E402

if fm.load() is None:
    pytest.skip(f"FlashMLA unavailable: {fm.why_not()}", allow_module_level=True)

DEV = torch.device("cuda")
K3_DIMS = {
    **K3_CONFIG,
    "hidden_size": 256,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "q_lora_rank": 64,
    "target_hidden_size": 256,
}


def test_the_kernel_matches_triton_and_a_float32_reference_and_never_reads_nan() -> None:
    torch.manual_seed(0)
    rows, heads, lat, d, scale = 8, 64, 512, 576, 0.0625
    ctx = [37, 1000, 64, 3000]
    kv = [torch.randn(c + rows, d, dtype=torch.bfloat16, device=DEV) for c in ctx]
    pages = [-(-len(x) // fm.PAGE) for x in kv]
    cache = torch.full((sum(pages) + 1, fm.PAGE, d), float("nan"), dtype=torch.bfloat16, device=DEV)
    table = torch.zeros(len(ctx), max(pages), dtype=torch.int32, device=DEV)
    perm, o = torch.randperm(sum(pages), device=DEV), 0
    for i, (x, k) in enumerate(zip(kv, pages, strict=True)):
        ids = perm[o : o + k]
        o += k
        table[i, :k] = ids.to(torch.int32)
        cache.view(-1, d)[(ids[:, None] * fm.PAGE + torch.arange(fm.PAGE, device=DEV)).flatten()[: len(x)]] = x
    q = torch.randn(len(ctx), rows, heads, d, dtype=torch.bfloat16, device=DEV)
    pos = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    zeros = torch.zeros_like(pos)
    mod = fm.load()
    buf = fm.FlashMLABuffers.allocate(mod, len(ctx), rows, heads, DEV)
    out = torch.empty(len(ctx), rows, heads, lat, dtype=torch.bfloat16, device=DEV)
    fm.flash_mla_decode(mod, q.contiguous(), cache.view(-1, fm.PAGE, 1, d), pos + rows, table, scale, True, out, buf)
    tri = pa.mla_paged_attention(q[..., :lat], cache, table, zeros, zeros, pos, scale=scale, causal=True, kv_lora=lat,
                                 q_rope=q[..., lat:])  # fmt: skip
    assert torch.isfinite(out).all()
    assert float((out.float() - tri.float()).abs().max()) < 2e-2
    for i, c in enumerate(ctx):
        s = torch.einsum("bhd,td->bht", q[i].float(), kv[i].float()) * scale
        limit = c + torch.arange(rows, device=DEV) + 1
        s = s.masked_fill(torch.arange(c + rows, device=DEV)[None, None] >= limit[:, None, None], float("-inf"))
        ref = torch.einsum("bht,td->bhd", torch.softmax(s, -1), kv[i][:, :lat].float())
        assert float((out[i].float() - ref).abs().max()) < 2e-2


def _bits(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    return (rng.standard_normal((rows, width), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.fixture(scope="module")
def flash_drafter():
    d = random_drafter(dict(K3_DIMS), DEV, 256 << 20, torch.bfloat16, attention="paged")
    assert d.cache.page_size == fm.PAGE
    d.prepare(8, 512)  # the self-test replays each captured bucket against eager: raises on a difference
    assert d.fast is not None and d.fast.flash is not None
    yield d
    d.close()


def test_poisoned_taps_never_reach_the_neighbours_and_graphs_equal_eager(flash_drafter) -> None:
    d = flash_drafter
    W, B = d.contract.tap_width, d.cfg.block_size
    rng = np.random.default_rng(5)
    rows = {0: 130, 1: 70, 2: 9, 3: 200}
    base = {k: _bits(rng, n, W) for k, n in rows.items()}
    got = {}
    for poison in (False, True):
        taps = {k: v.copy() for k, v in base.items()}
        if poison:
            taps[0][3, ::3] = 0x7FC0  # NaN
            taps[0][129, ::5] = 0x7F80  # +Inf in the session's last page
        for k, n in rows.items():
            d.release(k)
            assert d.reserve(k, 0, n + B)
            d.ingest([IngestItem(k, 0, 0, taps[k])])
        items = [DraftItem(k, 0, n, 1, B, GREEDY) for k, n in rows.items()]
        got[poison] = [o.tokens for o in d.draft(items)]
        saved, d.fast._draft_graphs = d.fast._draft_graphs, {}
        try:
            eager = [o.tokens for o in d.draft(items)]
        finally:
            d.fast._draft_graphs = saved
        assert eager == got[poison]
    assert got[True][1:] == got[False][1:]


def test_a_session_starting_mid_sequence_stays_on_the_graph(flash_drafter) -> None:
    """A span made at 37 starts on a page boundary in the cache: FlashMLA reads it in the captured
    step. A draft asked from a later start than its span's (40) takes the mixed eager body."""
    d = flash_drafter
    W, B = d.contract.tap_width, d.cfg.block_size
    rng = np.random.default_rng(6)
    spans = {10: (0, 90), 11: (37, 150)}
    for k, (a, b) in spans.items():
        d.release(k)
        assert d.reserve(k, a, b + B)
        d.ingest([IngestItem(k, a, a, _bits(rng, b - a, W))])
    before = d.fast.eager_steps
    outs = d.draft([DraftItem(k, a, b, 2, B, GREEDY) for k, (a, b) in spans.items()])
    assert d.fast.eager_steps == before
    assert all(len(o.tokens) == B and all(0 <= t < d.cfg.vocab_size for t in o.tokens) for o in outs)
    later = d.draft([DraftItem(10, 0, 90, 2, B, GREEDY), DraftItem(11, 40, 150, 2, B, GREEDY)])
    assert d.fast.eager_steps == before + 1
    assert all(len(o.tokens) == B for o in later)
