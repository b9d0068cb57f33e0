"""The fused Triton kernels (RMSNorm, RoPE, SiLU-and-multiply) against the eager ops they replace,
under Triton's interpreter on the CPU (on a GPU the same kernels run compiled)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.nn.functional as F

from draft_server.models.kernels import fused
from draft_server.models.layers import ops

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _eager_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_eager_on_strided_views_and_broadcast_weights(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, 40, generator=g).to(DEV, dtype)
    x = base[:, 1:4, 3:35]  # strided, 3 leading dims after the view below
    w = torch.randn(32, generator=g).to(DEV, dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), _eager_rms(x, w, 1e-6), **tol)
    wl = torch.randn(3, 1, 32, generator=g).to(DEV, dtype)  # one weight row per middle index
    x4 = base[:, 1:4, 3:35].reshape(6, 3, 1, 32)
    torch.testing.assert_close(fused.rms_norm(x4, wl, 1e-5), _eager_rms(x4, wl, 1e-5), **tol)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_matches_eager(interleaved: bool) -> None:
    from draft_server.models.config import RopeSpec

    rope = ops.Rope(RopeSpec(theta=10000.0, dim=16, interleaved=interleaved), torch.device(DEV))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 5, 24, generator=g).to(DEV)[..., 8:]  # [N, B, H, 16] slice of a wider row
    pos = torch.randint(0, 100000, (3, 4), generator=g).to(DEV)
    cos, sin = rope.cos_sin(pos, torch.float32)
    c, s = cos[:, :, None], sin[:, :, None]
    x1, x2 = (q[..., 0::2], q[..., 1::2]) if interleaved else q.chunk(2, dim=-1)
    if interleaved:
        want = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    torch.testing.assert_close(fused.rope(q, c, s, interleaved), want, rtol=0, atol=1e-6)


def test_silu_mul_and_swiglu_add() -> None:
    g = torch.Generator().manual_seed(2)
    gu = torch.randn(7, 2 * 48, generator=g).to(DEV)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul(gu), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    h, x = torch.randn(7, 16, generator=g).to(DEV), torch.randn(7, 16, generator=g).to(DEV)
    wg, wu, wd = (torch.randn(48, 16, generator=g).to(DEV), torch.randn(48, 16, generator=g).to(DEV),
                  torch.randn(16, 48, generator=g).to(DEV))  # fmt: skip
    want = h + F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    torch.testing.assert_close(ops.swiglu_add(h, x, torch.cat([wg, wu]), wd), want, rtol=1e-5, atol=1e-4)


def test_silu_mul_parts_reads_strided_gate_and_up_and_writes_the_asked_dtype() -> None:
    """An EXL3 model's gate and up arrive as two products (strided when their padding is trimmed)."""
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(2, 5, 64, generator=g).to(DEV)[..., :40]  # trimmed: row stride 64
    up = torch.randn(10, 40, generator=g).to(DEV).view(2, 5, 40)
    got = fused.silu_mul_parts(gate, up, torch.float32)
    assert got.shape == (2, 5, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ops.swiglu_parts(gate, up, torch.float32), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="differ"):
        fused.silu_mul_parts(gate, up[..., :39], torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_markov_argmax_equals_eager_argmax_of_the_float32_sum(dtype: torch.dtype) -> None:
    """Strided base rows (one Markov step of [N, k, V]), several blocks, ties, NaN."""
    g = torch.Generator().manual_seed(5)
    N, k, V = 6, 3, 2 * fused.ARGMAX_BLOCK + 123
    base = torch.randn(N, k, V, generator=g).to(dtype).to(DEV)
    bias = torch.randn(N, V, generator=g).to(dtype).to(DEV)
    base[0, 1, 5] = base[0, 1, V - 3] = 80  # a tie across blocks: the first index wins
    bias[0, 5] = bias[0, V - 3] = 1
    base[1, :, 4100:4200] = 90  # a tie inside a block
    bias[1, 4100:4200] = 0
    base[2, 2, 7] = float("nan")  # NaN ranks highest
    bias[3] = -float("inf")  # all -inf but one
    bias[3, 77] = 0
    for j in range(k):
        got = fused.markov_argmax(base[:, j], bias)
        want = (base[:, j].float() + bias.float()).argmax(-1)
        assert torch.equal(got, want), (j, got, want)
        assert torch.equal(fused.markov_argmax(base[:, j], None), base[:, j].float().argmax(-1))


MARKOV_LAUNCHES = [
    None,  # the shape markov_launch picks for N
    fused.MarkovLaunch(block_n=16, block_v=32, iters=3, stages=2),  # 14 tiles: 5 parts, the last one short
    fused.MarkovLaunch(block_n=16, block_v=64, iters=2),
]


@pytest.mark.parametrize("launch", MARKOV_LAUNCHES, ids=["default", "32x3", "64x2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N", [1, 5, 20])
def test_markov_argmax_lowrank_equals_the_argmax_over_the_written_bias(
    dtype: torch.dtype, N: int, launch: fused.MarkovLaunch | None
) -> None:
    """The low-rank bias formed inside the kernel (e = W1[prev] gathered there, e @ W2^T rounded to
    the model dtype as F.linear writes it) gives the argmax of base + F.linear(e, W2), and with d2t
    the target id: strided base rows, several vocab tiles, parts of several tiles (a short last part)
    and session blocks, a rank that is not a power of two, ties across tiles, within a part and across
    parts, in either walking order, NaN in one row."""
    g = torch.Generator().manual_seed(11)
    k, V, R = 3, 3 * fused.MARKOV_BLOCK_V + 37, 24
    base = torch.randn(N, k, V, generator=g).to(dtype).to(DEV)
    e = torch.randn(N, R, generator=g).to(dtype).to(DEV)
    w2 = (torch.randn(V, R, generator=g) / R**0.5).to(dtype).to(DEV)
    bias = F.linear(e, w2)
    base[0, 1, 3] = base[0, 1, V - 2] = 90 - bias[0, 3].float()  # equal sums (tie) in two vocab blocks
    base[0, 1, V - 2] = 90 - bias[0, V - 2].float()
    base[0, 2, 40] = 90 - bias[0, 40].float()  # a tie in tiles 1 and 2 of a part of three 32-row tiles
    base[0, 2, 80] = 90 - bias[0, 80].float()  # (the ties are exact in float32)
    if N > 2:
        base[2, 0, 11] = float("nan")
    w1 = torch.cat([torch.randn(7, R, generator=g).to(dtype).to(DEV), e])  # the embedding table, e its last rows
    prev = torch.arange(7, 7 + N, device=DEV).repeat_interleave(2)[::2]  # each one's row of e; strided
    d2t = torch.randint(0, 50, (V,), generator=g).to(DEV)
    for j in range(k):
        want = fused.markov_argmax(base[:, j], bias)
        for reverse in (False, True):  # the chain alternates the launch order of the vocab blocks
            got = fused.markov_argmax_lowrank(base[:, j], prev, w1, w2, reverse=reverse, launch=launch)
            assert torch.equal(got, want), (j, reverse, got, want)
            mapped = fused.markov_argmax_lowrank(base[:, j], prev, w1, w2, reverse=reverse, d2t=d2t, launch=launch)
            assert torch.equal(mapped, want + d2t[want])  # target ids: id + d2t[id]
        assert torch.equal(got, (base[:, j].float() + bias.float()).argmax(-1)) or N > 2


@pytest.mark.parametrize(
    "launch",
    [fused.markov_launch(n) for n in (1, 20, 64)]
    + [fused.MarkovLaunch(32, 64, 4, 4, 2), fused.MarkovLaunch(64, 64, 4, 8, 2), fused.MarkovLaunch(16, 64, 8, 4, 3)],
    ids=str,
)
def test_every_launch_shape_gives_the_same_tokens(launch: fused.MarkovLaunch) -> None:
    """The shapes ``markov_launch`` picks (16, 32 and 64 session rows) and the multi-tile ones the sweep
    times draft the tokens of ``markov_argmax`` over the written bias: several parts, a short last one,
    both walking orders, a tie across tiles."""
    g = torch.Generator().manual_seed(12)
    N, V, R = 20, 9 * 128 + 5, 40
    base = torch.randn(N, V, generator=g).to(torch.bfloat16).to(DEV)
    w1 = torch.randn(50, R, generator=g).to(torch.bfloat16).to(DEV)
    w2 = (torch.randn(V, R, generator=g) / R**0.5).to(torch.bfloat16).to(DEV)
    prev = torch.randint(0, 50, (N,), generator=g).to(DEV)
    w2[7] = w2[V - 3] = 0  # no Markov bias there: the same sum at two ends of the vocabulary
    base[1, 7] = base[1, V - 3] = 99
    bias = F.linear(w1[prev], w2)
    want = fused.markov_argmax(base, bias)
    assert int(want[1]) == 7
    for reverse in (False, True):
        assert torch.equal(fused.markov_argmax_lowrank(base, prev, w1, w2, reverse=reverse, launch=launch), want)


def _k3_rope(interleaved: bool = True) -> ops.Rope:
    from draft_server.models.config import RopeSpec

    spec = RopeSpec(
        theta=50000.0, dim=16, interleaved=interleaved, kind="deepseek_yarn", factor=32.0, original_max_position=4096,
        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.7,
    )  # fmt: skip
    return ops.Rope(spec, torch.device(DEV))


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_cos_sin_kernel_rounds_what_the_float64_eager_form_rounds(pos_dtype: torch.dtype) -> None:
    """One launch for the step's cos/sin: angles, cos/sin and the YaRN scale in float64 registers,
    rounded once to float32; equal to the eager float64 form at small and very large positions."""
    rope = _k3_rope()
    assert rope.mul != 1.0  # the scale is applied in float64 too
    g = torch.Generator().manual_seed(21)
    pos = torch.cat([torch.arange(40), torch.randint(0, 1 << 24, (60,), generator=g)]).to(pos_dtype).view(4, 25)
    ang = pos.to(torch.float64).unsqueeze(-1) * rope.inv_freq.cpu()
    want_c, want_s = (ang.cos() * rope.mul).float(), (ang.sin() * rope.mul).float()
    got_c, got_s = fused.cos_sin(pos.to(DEV), rope.inv_freq, rope.mul_t)
    assert got_c.shape == (4, 25, 8) and got_c.dtype == torch.float32
    torch.testing.assert_close(got_c.cpu(), want_c, rtol=0, atol=0)
    torch.testing.assert_close(got_s.cpu(), want_s, rtol=0, atol=0)
    with pytest.raises(ValueError, match="integer"):
        fused.cos_sin(pos.to(DEV).float(), rope.inv_freq, rope.mul_t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
def test_mla_latent_is_rms_norm_then_rope_then_the_concatenation(dtype: torch.dtype, interleaved: bool) -> None:
    """The cached MLA token in one kernel: bit for bit the two fused kernels and a cat (the same
    arithmetic), close to the eager ops; rows of several layers from strided kv_a rows, written
    rows-first or layers-first (the cache write's layout); a 1-D weight for one layer."""
    rope = _k3_rope(interleaved)
    g = torch.Generator().manual_seed(22)
    R, L, lat = 5, 3, 32
    wide = torch.randn(R, L, 8 + lat + 16, generator=g).to(DEV, dtype)
    kv = wide[..., 8:]  # strided rows: the kv_a part of a fused projection
    w = torch.randn(L, lat, generator=g).to(DEV, dtype)
    cos, sin = rope.cos_sin(torch.randint(0, 100000, (R,), generator=g).to(DEV), torch.float32)
    want = torch.cat(
        [fused.rms_norm(kv[..., :lat], w, 1e-6), fused.rope(kv[..., lat:], cos[:, None], sin[:, None], interleaved)],
        dim=-1,
    )
    got = fused.mla_latent(kv, w, cos, sin, 1e-6, interleaved)
    assert got.shape == (R, L, lat + 16) and torch.equal(got, want)
    assert torch.equal(fused.mla_latent(kv, w, cos, sin, 1e-6, interleaved, layers_first=True), want.transpose(0, 1))
    eager = torch.cat(
        [_eager_rms(kv[..., :lat], w, 1e-6), rope._apply_eager(kv[..., lat:], cos[:, None], sin[:, None])], dim=-1
    )
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(got, eager, **tol)
    one = fused.mla_latent(kv[:, 1:2], w[1], cos, sin, 1e-6, interleaved)
    assert torch.equal(one, want[:, 1:2])
    cache = torch.zeros(L, 3 * R, lat + 16, dtype=dtype, device=DEV)  # [layers, slots, token]
    slots = torch.randperm(3 * R, generator=g)[:R].to(DEV, torch.int32)
    assert fused.mla_latent(kv, w, cos, sin, 1e-6, interleaved, into=(cache, slots)) is cache
    assert torch.equal(cache[:, slots.long()], want.transpose(0, 1))  # each row at its slot, every layer
    rest = torch.ones(3 * R, dtype=torch.bool)
    rest[slots.long().cpu()] = False
    assert not cache[:, rest.to(DEV)].any()  # nothing else written
    with pytest.raises(ValueError, match="takes these rows"):
        fused.mla_latent(kv, w, cos, sin, 1e-6, interleaved, into=(cache.double(), slots))
    with pytest.raises(ValueError, match="cos/sin"):
        fused.mla_latent(kv, w, cos[:2], sin[:2], 1e-6, interleaved)


def test_rope_writes_into_a_strided_buffer() -> None:
    """The query's rope part goes straight into the kernel's query buffer (no copy after)."""
    rope = _k3_rope()
    g = torch.Generator().manual_seed(23)
    q = torch.randn(2, 3, 4, 24, generator=g).to(DEV)[..., 8:]
    cos, sin = rope.cos_sin(torch.randint(0, 5000, (2, 3), generator=g).to(DEV), torch.float32)
    c, s = cos[:, :, None], sin[:, :, None]
    buf = torch.zeros(2, 3, 4, 40, device=DEV)
    got = fused.rope(q, c, s, True, out=buf[..., 24:])
    assert got.data_ptr() == buf[..., 24:].data_ptr()
    assert torch.equal(buf[..., 24:], fused.rope(q, c, s, True)) and not buf[..., :24].any()
    with pytest.raises(ValueError, match="does not take"):
        fused.rope(q, c, s, True, out=buf[..., 20:])


def _same_arithmetic(got: torch.Tensor, want: torch.Tensor) -> None:
    """Two kernels doing the same float32 arithmetic: bit for bit under the interpreter; compiled, the
    GPU's code generator may contract a product into an FMA or order a row's sum differently in one of
    them, so the last bit of the float32 value (and, rarely, the rounding to bf16 after it) may move."""
    if DEV == "cpu":
        assert torch.equal(got, want)
    else:
        tol = {"rtol": 1e-6, "atol": 1e-6} if got.dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-2}
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rms_rope_is_rms_norm_then_rope(dtype: torch.dtype, interleaved: bool) -> None:
    """A GQA head's q/k: RoPE of the RMSNormed head in one kernel, the two kernels' arithmetic in a
    row, close to the eager ops; heads sliced out of a fused QKV row, per-layer weights broadcast."""
    rope = _k3_rope(interleaved)
    g = torch.Generator().manual_seed(24)
    qkv = torch.randn(6, 7, 16, generator=g).to(DEV, dtype)  # [rows, heads, hd]
    x = qkv[:, 2:5].view(2, 3, 3, 16)  # three heads of every row, rows as [N, B]
    w = torch.randn(16, generator=g).to(DEV, dtype)
    cos, sin = rope.cos_sin(torch.randint(0, 100000, (2, 3), generator=g).to(DEV), torch.float32)
    c, s = cos[:, :, None], sin[:, :, None]
    got = fused.rms_rope(x, w, c, s, 1e-6, interleaved)
    _same_arithmetic(got, fused.rope(fused.rms_norm(x, w, 1e-6), c, s, interleaved))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(got, rope._apply_eager(_eager_rms(x, w, 1e-6), c, s), **tol)
    kv = torch.randn(4, 3, 2, 2, 16, generator=g).to(DEV, dtype)[:, :, 0]  # [R, L, nkv, hd]: the k half
    wl = torch.randn(3, 1, 16, generator=g).to(DEV, dtype)  # one k_norm per layer
    cr, sr = rope.cos_sin(torch.arange(4).to(DEV), torch.float32)
    got = fused.rms_rope(kv, wl, cr[:, None, None], sr[:, None, None], 1e-6, interleaved)
    want = fused.rope(fused.rms_norm(kv, wl, 1e-6), cr[:, None, None], sr[:, None, None], interleaved)
    _same_arithmetic(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_kv_writes_normed_roped_k_and_v_at_their_slots(dtype: torch.dtype) -> None:
    """A GQA layer's cached tokens from one kernel: K = rms_rope's arithmetic, V as it came, both at
    the rows' slots in every layer (K/V slices of one projection, per-layer k_norm); nothing else."""
    rope = _k3_rope(False)
    g = torch.Generator().manual_seed(25)
    R, L, nkv, hd = 5, 3, 2, 16
    kv = torch.randn(R, L, 2, nkv, hd, generator=g).to(DEV, dtype)  # one stacked K/V projection
    w = torch.randn(L, hd, generator=g).to(DEV, dtype)
    cos, sin = rope.cos_sin(torch.randint(0, 100000, (R,), generator=g).to(DEV), torch.float32)
    cache = torch.zeros(L, 4 * R, 2, nkv, hd, dtype=dtype, device=DEV)
    slots = torch.randperm(4 * R, generator=g)[:R].to(DEV)
    assert fused.gqa_kv(kv[:, :, 0], kv[:, :, 1], w, cos, sin, 1e-6, False, into=(cache, slots)) is cache
    k = fused.rms_rope(kv[:, :, 0], w[:, None, :], cos[:, None, None], sin[:, None, None], 1e-6, False)
    _same_arithmetic(cache[:, slots, 0], k.transpose(0, 1))
    assert torch.equal(cache[:, slots, 1], kv[:, :, 1].transpose(0, 1))
    rest = torch.ones(4 * R, dtype=torch.bool, device=DEV)
    rest[slots] = False
    assert not cache[:, rest].any()
    with pytest.raises(ValueError, match="takes these rows"):
        fused.gqa_kv(kv[:, :, 0], kv[:, :, 1], w, cos, sin, 1e-6, False, into=(cache[..., :8], slots))


def test_rms_norm_and_silu_mul_store_fp16_as_converting_their_bf16_result_would() -> None:
    """``out_dtype`` / ``store``: the bf16 op's result stored as fp16 by the kernel itself (what an EXL3
    linear on exllamav3's kernels reads), bit for bit what converting the bf16 result gives."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(9, 3, 96, generator=g) * 3).to(DEV, torch.bfloat16)
    w = torch.randn(96, generator=g).to(DEV, torch.bfloat16)
    got = fused.rms_norm(x, w, 1e-6, torch.float16)
    assert got.dtype == torch.float16 and torch.equal(got, fused.rms_norm(x, w, 1e-6).to(torch.float16))
    assert torch.equal(ops.rms_norm(x.cpu(), w.cpu(), 1e-6, torch.float16), ops.rms_norm(x.cpu(), w.cpu(), 1e-6).half())
    gate, up = (torch.randn(9, 200, generator=g).to(DEV) * 4 for _ in range(2))  # float32 products
    got = fused.silu_mul_parts(gate, up, torch.bfloat16, torch.float16)
    assert got.dtype == torch.float16
    assert torch.equal(got, fused.silu_mul_parts(gate, up, torch.bfloat16).to(torch.float16))
    want = ops.swiglu_parts(gate.cpu(), up.cpu(), torch.bfloat16).half()
    assert torch.equal(ops.swiglu_parts(gate.cpu(), up.cpu(), torch.bfloat16, torch.float16), want)
