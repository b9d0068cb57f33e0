"""The EXL3 GPU backend without a GPU: dispatch, padding and dtypes against a fake ``exllamav3_ext``.

``Exl3Backend`` calls ``exl3_gemm(A, trellis, C, suh, A_had, svh, -1, mcg, mul1, 0)`` up to
``fused_max_rows`` rows; above, ``reconstruct`` into a shared scratch + ``had_r_128`` on both sides of
a GEMM (``recon``), the same rotations around the Triton decode-GEMM (``inline``, under the
interpreter) or the cached dense weight (``dense``). The fake extension checks each call's
contract (fp16 contiguous A padded to 128, fp32 C, scratch shaped like A, the codebook flags, K) and
computes the kernels' results from our decoder, so the backend's own work (reshape, pad, trim, bias, cast)
and the model's routing (``DSparkModel.route_linears``) are what is tested. Also: the dense model
keeps the plain ops, and exllamav3's real sources (when the 1.6.5 wheel is in ``.whl/``) build with
the same arguments as ``exllamav3/ext.py`` and have the signatures the backend and the golden job use.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from draft_server.models import load_drafter
from draft_server.models.exl3 import Exl3Linear, FusedLinear, set_backend
from draft_server.models.exl3.cuda import Exl3Backend, Exl3Unavailable, fused_max_rows_from_env
from draft_server.models.exl3.decode import decode_inner, dense_weight, had_right
from draft_server.models.exl3.linear import DequantBackend
from draft_server.models.tiny import make_tiny
from draft_tools.exl3_cpu import random_linear, write_exl3_checkpoint
from tests.unit.test_exl3_loader import drafts

ROOT = Path(__file__).resolve().parents[2]
WHEEL = ROOT / ".whl" / "exllamav3-1.6.5-py3-none-any.whl"


class FakeExt:
    """``exllamav3_ext.exl3_gemm`` on the CPU: the argument contract asserted, ``C = A @ W`` computed."""

    def __init__(self) -> None:
        self.rows: list[int] = []  # exl3_gemm calls' row counts
        self.recon: list[int] = []  # reconstruct calls' buffer addresses

    def exl3_gemm(self, A, B, C, suh, A_had, svh, force_shape_idx, mcg, mul1, force_num_sms) -> int:
        assert A.dtype == torch.float16 and A.is_contiguous() and A.dim() == 2
        assert A.shape[1] == B.shape[0] * 16 and C.shape == (A.shape[0], B.shape[1] * 16)
        assert C.dtype == torch.float32 and C.is_contiguous()
        assert A_had.shape == A.shape and A_had.dtype == torch.float16 and A_had.data_ptr() != A.data_ptr()
        assert suh.dtype == svh.dtype == torch.float16 and B.dtype == torch.int16
        assert (force_shape_idx, force_num_sms) == (-1, 0) and not (mcg and mul1)
        cb = "mcg" if mcg else "mul1" if mul1 else "3inst"
        C.copy_(A.double() @ dense_weight(decode_inner(B, cb), suh, svh))
        self.rows.append(A.shape[0])
        return 0

    def reconstruct(self, unpacked, packed, K, mcg, mul1) -> None:
        """The rotated-basis fp16 Wq [k, n] (our decoder is bit-exact with the kernel's: the goldens)."""
        assert unpacked.dtype == torch.float16 and unpacked.is_contiguous() and packed.dtype == torch.int16
        assert unpacked.shape == (packed.shape[0] * 16, packed.shape[1] * 16) and packed.shape[2] == 16 * K
        assert not (mcg and mul1)
        unpacked.copy_(decode_inner(packed, "mcg" if mcg else "mul1" if mul1 else "3inst"))
        self.recon.append(unpacked.data_ptr())

    def had_r_128(self, inp, out, pre_scale, post_scale, scale) -> None:
        """out = H128(inp * pre_scale) * post_scale * scale over 128-column blocks (in place allowed)."""
        assert inp.shape == out.shape and inp.dim() == 2 and inp.shape[1] % 128 == 0
        assert inp.dtype == out.dtype and inp.dtype in (torch.float16, torch.float32)
        x = inp.double() * (1 if pre_scale is None else pre_scale.double())
        x = had_right(x) * (1 if post_scale is None else post_scale.double())
        out.copy_(x * scale)


def through(be: Exl3Backend, lin: Exl3Linear, x: torch.Tensor) -> torch.Tensor:
    """``lin.forward(x)`` with ``be`` installed."""
    prev = set_backend(be)
    try:
        return lin.forward(x)
    finally:
        set_backend(prev)


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_fused_path_pads_trims_adds_bias_and_casts(codebook) -> None:
    t = random_linear(200, 300, 3, codebook, seed=5)  # in 300 -> 384, out 200 -> 256
    bias = torch.randn(200, dtype=torch.bfloat16)
    lin = Exl3Linear("x", 300, 200, t["trellis"], t["suh"], t["svh"], codebook, bias)
    ext = FakeExt()
    be = Exl3Backend(fused_max_rows=8, ext=ext)
    x = torch.randn(2, 3, 300, generator=torch.Generator().manual_seed(6))
    ref = x.double() @ lin.exact_weight().t() + bias.double()
    y = through(be, lin, x.to(torch.bfloat16))
    assert y.shape == (2, 3, 200) and y.dtype == torch.bfloat16 and y.is_contiguous() and ext.rows == [6]
    assert (y.double() - ref).abs().max() <= 2e-2 * ref.abs().max()  # fp16 A, bf16 out
    y32 = through(be, lin, x)
    assert y32.dtype == torch.float32 and (y32.double() - ref).abs().max() <= 2e-3 * ref.abs().max()
    assert be.calls == {"fused": 2, "recon": 0, "inline": 0, "decode": 0, "dense": 0}


def test_rows_above_the_bucket_take_the_cached_dense_weight() -> None:
    t = random_linear(256, 128, 4, "mul1", seed=7)
    lin = Exl3Linear("x", 128, 256, t["trellis"], t["suh"], t["svh"], "mul1")
    ext = FakeExt()
    be = Exl3Backend(fused_max_rows=16, ext=ext, large="dense")
    x = torch.randn(17, 128)
    assert torch.equal(through(be, lin, x), F.linear(x, lin.weight(torch.float32)))
    assert ext.rows == [] and be.calls == {"fused": 0, "recon": 0, "inline": 0, "decode": 0, "dense": 1}
    assert be.path(lin, 16) == "fused"


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_recon_decodes_into_one_shared_scratch_and_keeps_no_dense_copy(codebook) -> None:
    """Above the bucket, ``recon``: every linear decodes into the same buffer (grown to the largest), the
    input and output rotations carry suh / svh, padding is trimmed, and no dense weight is cached."""
    g = torch.Generator().manual_seed(8)
    big, small = random_linear(200, 300, 3, codebook, seed=9), random_linear(130, 128, 2, codebook, seed=10)
    lins = [
        Exl3Linear("big", 300, 200, big["trellis"], big["suh"], big["svh"], codebook, torch.randn(200)),
        Exl3Linear("small", 128, 130, small["trellis"], small["suh"], small["svh"], codebook),
    ]
    ext = FakeExt()
    be = Exl3Backend(fused_max_rows=4, ext=ext)
    assert be.large == "recon" and be.path(lins[0], 5) == "recon"
    for lin in lins:
        x = torch.randn(3, 7, lin.in_features, generator=g)
        ref = x.double() @ lin.exact_weight().t() + (0 if lin.bias is None else lin.bias.double())
        y = through(be, lin, x)
        assert y.shape == (3, 7, lin.out_features) and y.dtype == torch.float32
        assert (y.double() - ref).abs().max() <= 5e-3 * ref.abs().max()  # fp16 input, weight and output
        assert not lin._dense  # nothing cached
    assert ext.rows == [] and be.calls == {"fused": 0, "recon": 2, "inline": 0, "decode": 0, "dense": 0}
    assert len(set(ext.recon)) == 1  # the second, smaller linear reused the first one's scratch


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_inline_decodes_inside_the_gemm_and_equals_recon(codebook) -> None:
    """``inline``: the rotations of ``recon`` around the Triton decode-GEMM; no reconstruct call, no scratch,
    no dense copy, and ``recon``'s product, only closer to the exact one (no fp16 rounding before the
    output rotation)."""
    g = torch.Generator().manual_seed(12)
    t = random_linear(200, 300, 3, codebook, seed=13)
    lin = Exl3Linear("x", 300, 200, t["trellis"], t["suh"], t["svh"], codebook, torch.randn(200))
    x = torch.randn(2, 9, 300, generator=g)
    ext = FakeExt()
    inline = Exl3Backend(fused_max_rows=0, ext=ext, large="inline")
    y = through(inline, lin, x)
    assert not ext.recon and not ext.rows and not inline._scratch and not lin._dense
    assert inline.calls == {"fused": 0, "recon": 0, "inline": 1, "decode": 0, "dense": 0}
    recon = through(Exl3Backend(fused_max_rows=0, ext=FakeExt(), large="recon"), lin, x)
    assert y.shape == recon.shape == (2, 9, 200) and y.dtype == torch.float32
    ref = x.double() @ lin.exact_weight().t() + lin.bias.double()
    err, recon_err = ((t.double() - ref).abs().max().item() for t in (y, recon))
    assert err <= 5e-3 * ref.abs().max().item()
    assert err <= recon_err  # recon's cuBLAS product is rounded to fp16 before its output rotation; inline's is fp32
    torch.testing.assert_close(y, recon, rtol=0, atol=2 * recon_err)


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_decode_writes_the_transposed_weight_into_the_shared_scratch_and_equals_recon(codebook) -> None:
    """``decode``: our Triton decoder (lane order, K in 1, 2, 4) writes Wq.T into the scratch ``recon`` uses and
    ``F.linear`` reads it: no reconstruct call, no dense copy, one buffer for every linear, and ``recon``'s
    product (the same fp16 weight; the fp16 GEMM outputs may round apart); a linear of another K takes
    ``recon`` instead."""
    g = torch.Generator().manual_seed(14)
    lins = []
    for seed, (o, i, bits) in enumerate(((200, 300, 4), (130, 128, 2), (128, 256, 3))):
        t = random_linear(o, i, bits, codebook, seed=15 + seed)
        lins.append(Exl3Linear(f"l{seed}", i, o, t["trellis"], t["suh"], t["svh"], codebook, torch.randn(o)))
    ext = FakeExt()
    be = Exl3Backend(fused_max_rows=0, ext=ext, large="decode")
    for lin in lins:
        x = torch.randn(2, 9, lin.in_features, generator=g)
        y = through(be, lin, x)
        recon = through(Exl3Backend(fused_max_rows=0, ext=FakeExt(), large="recon"), lin, x)
        assert y.shape == recon.shape == (2, 9, lin.out_features) and not lin._dense
        torch.testing.assert_close(y, recon, rtol=0, atol=2**-9 * recon.abs().max().item())  # fp16 roundings apart
        ref = x.double() @ lin.exact_weight().t() + lin.bias.double()
        assert (y.double() - ref).abs().max() <= 5e-3 * ref.abs().max()
    assert be.calls == {"fused": 0, "recon": 1, "inline": 0, "decode": 2, "dense": 0}
    assert len(ext.recon) == 1 and len(be._scratch) == 1  # the K = 3 linear's reconstruct, in the same buffer
    assert ext.recon[0] == next(iter(be._scratch.values())).data_ptr()


class HalfCounting(Exl3Backend):
    """The backend, recording the width of every fp16 input copy (``_half``) it makes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.halves: list[int] = []

    def _half(self, x2: torch.Tensor, k: int) -> torch.Tensor:
        self.halves.append(x2.shape[1])
        return Exl3Backend._half(x2, k)


def mlp(codebook: str, seed: int) -> tuple[list[Exl3Linear], FusedLinear, Exl3Linear]:
    """Random 4-bit gate, up (in 128, out 256) and down (in 256, out 128): the parts, gate | up, down."""
    parts = []
    for i, (n, k) in enumerate(((256, 128), (256, 128), (128, 256))):
        t = random_linear(n, k, 4, codebook, seed=seed + i)
        parts.append(Exl3Linear(f"p{i}", k, n, t["trellis"], t["suh"], t["svh"], codebook))
    return parts, FusedLinear("gate_up", parts[:2]), parts[2]


def test_parts_of_one_input_share_its_fp16_conversion_and_round_once() -> None:
    """A two-part ``FusedLinear`` (gate | up): both kernels read one fp16 copy of the input; the gate/up
    activation and the residual add take the float32 products straight (no bf16 copy, no concatenation
    before the activation), and equal the dense computation within the fp16 kernel's tolerance."""
    from draft_server.models.exl3 import linear as ex

    g = torch.Generator().manual_seed(11)
    parts, gate_up, down = mlp("mul1", seed=20)
    seen: list[int] = []

    class Recording(FakeExt):
        def exl3_gemm(self, A, *args) -> int:
            seen.append(A.data_ptr())
            return super().exl3_gemm(A, *args)

    be = HalfCounting(fused_max_rows=64, ext=Recording())
    x, h = torch.randn(2, 3, 128, generator=g), torch.randn(2, 3, 128, generator=g)
    wg, wu, wd = (p.exact_weight() for p in parts)
    act = F.silu(x.double() @ wg.t()) * (x.double() @ wu.t())
    want = h.double() + act @ wd.t()
    prev = set_backend(be)
    try:
        y = ex.swiglu_add(h, x, gate_up, down)
        gu = gate_up.forward(x)
    finally:
        set_backend(prev)
    assert len(seen) == 5 and seen[0] == seen[1] and seen[3] == seen[4]  # gate and up: one converted input
    assert be.halves == [128, 256, 128]  # one conversion per input: x (gate, up), the activation (down), x
    assert y.shape == h.shape and y.dtype == h.dtype
    assert (y.double() - want).abs().max() <= 5e-3 * want.abs().max()
    assert gu.shape == (2, 3, 512) and gu.is_contiguous()
    torch.testing.assert_close(
        gu.double(), torch.cat([x.double() @ wg.t(), x.double() @ wu.t()], -1), rtol=0, atol=2e-2
    )


@pytest.mark.parametrize("large", ["inline", "decode"])
def test_our_paths_rotate_the_callers_rows_without_an_fp16_copy(large: str) -> None:
    """``inline`` and ``decode`` make their rotated fp16 input from the caller's rows in one kernel
    (``hadamard_128`` converts and zero-pads): no ``_half`` copy, whatever the input's dtype, and the product
    of ``recon`` (which rotates the fp16 copy) within fp16 roundings."""
    g = torch.Generator().manual_seed(16)
    t = random_linear(256, 300, 4, "3inst", seed=17)
    lin = Exl3Linear("x", 300, 256, t["trellis"], t["suh"], t["svh"], "3inst")
    be = HalfCounting(fused_max_rows=0, ext=FakeExt(), large=large)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2, 5, 300, generator=g).to(dtype)
        y = through(be, lin, x)
        recon = through(Exl3Backend(fused_max_rows=0, ext=FakeExt(), large="recon"), lin, x)
        assert y.dtype == dtype and y.shape == (2, 5, 256)
        torch.testing.assert_close(y.float(), recon.float(), rtol=0, atol=2**-7 * recon.float().abs().max().item())
    assert be.halves == [] and be.calls[large] == 2


@pytest.mark.parametrize("large,split", [("inline", 1), ("inline", 2), ("decode", 1), ("recon", 1)])
def test_mlp_output_rotations_fuse_into_the_activation_and_the_residual_add(
    large: str, split: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On our paths the gate and up products' output rotations and the SwiGLU activation are one kernel, and
    down's rotation and the residual add another (``hadamard_swiglu``, ``hadamard_128(add=)``); ``inline``'s
    k-split partials are summed there (``split``: forced, as a GPU's SM count sets it); ``recon``
    (exllamav3's kernels) keeps the separate ops. Either way the MLP equals the dense one within fp16
    kernel tolerances, in the residual's dtype, and each linear is one call of its path."""
    from draft_server.models.exl3 import linear as ex
    from draft_server.models.kernels import exl3_gemm

    monkeypatch.setattr(exl3_gemm, "_split_for", lambda *_: split)

    g = torch.Generator().manual_seed(18)
    _, gate_up, down = mlp("3inst", seed=30)
    fused_calls: list[str] = []

    class Watching(Exl3Backend):
        def _exl3(self, lin, x2, a, path):  # the unfused way: a product with its own output rotation
            fused_calls.append(lin.key)
            return super()._exl3(lin, x2, a, path)

    be = Watching(fused_max_rows=0, ext=FakeExt(), large=large)
    x = torch.randn(2, 3, 128, generator=g).to(torch.bfloat16)
    h = torch.randn(2, 3, 128, generator=g).to(torch.bfloat16)
    prev = set_backend(be)
    try:
        y = ex.swiglu_add(h, x, gate_up, down)
    finally:
        set_backend(prev)
    prev = set_backend(DequantBackend())
    try:
        ref = ex.swiglu_add(h.float(), x.float(), gate_up, down)
    finally:
        set_backend(prev)
    assert y.shape == h.shape and y.dtype == torch.bfloat16
    assert (y.double() - ref.double()).abs().max() <= 2e-2 * ref.abs().max()
    assert be.calls[large] == 3 and sum(be.calls.values()) == 3
    assert fused_calls == ([] if large != "recon" else ["p0", "p1", "p2"])


def test_tuned_paths_time_both_once_per_shape_and_rows_and_never_while_capturing() -> None:
    """Unset ``fused_max_rows``: while ``gemm.TUNER.tuning``, each (in, out, K, codebook, rows) times the
    fused and the packed large paths once and keeps the fastest; a path that fails is left out; a
    shape never tuned falls back to the default threshold; a capture (or tuning off) never times."""
    from draft_server.models import gemm
    from draft_server.models.exl3 import cuda

    t = random_linear(128, 128, 4, "mcg", seed=30)
    lin = Exl3Linear("x", 128, 128, t["trellis"], t["suh"], t["svh"], "mcg")
    timed: list[int] = []

    class Timed(Exl3Backend):
        capturing = False

        def _can_time(self, lin: Exl3Linear) -> bool:
            return not self.capturing

        def _time(self, fn) -> float:  # fused fastest at <= 32 rows, the large path above
            before = dict(self.calls)
            fn()
            path = next(p for p in self.calls if self.calls[p] > before[p])
            timed.append(self.calls[path])
            if path == "inline" and rows == 32:
                raise RuntimeError("triton: out of resources")
            return {"fused": 1.0, "recon": 2.0, "inline": 1.5, "decode": 1.8}[path] * (1 if rows <= 32 else -1) + 5

    be = Timed(ext=FakeExt())
    assert be.fused_max_rows is None
    rows = 48
    assert be.path(lin, rows) == "recon" and not timed  # tuning off: the default threshold
    gemm.TUNER.tuning = True
    try:
        be.capturing = True
        assert be.path(lin, rows) == "recon" and not timed and not be.choice
        be.capturing = False
        assert be.path(lin, rows) == "recon"  # timed: a large path faster
        for rows in (8, 32):
            assert be.path(lin, rows) == "fused"
        n = len(timed)
        assert n == 12 and be.path(lin, 8) == "fused" and len(timed) == n  # cached; inline failed at 32 rows
    finally:
        gemm.TUNER.tuning = False
    assert set(be.choice) == {(128, 128, 4, "mcg", r) for r in (8, 32, 48)}
    assert set(be.timings[(128, 128, 4, "mcg", 32)]) == {"fused", "recon", "decode"} and "inline" in be.failed
    k3 = random_linear(128, 128, 3, "mcg", seed=31)  # K = 3: no lane-order decode to time
    assert be.candidates(Exl3Linear("y", 128, 128, k3["trellis"], k3["suh"], k3["svh"], "mcg")) == (
        "fused", "recon", "inline")  # fmt: skip
    assert cuda.FUSED_MAX_ROWS == 16 and be.path(lin, 20) == "recon"  # untuned rows: the default threshold


def test_dense_or_inline_only_needs_no_exllamav3_and_the_env_knob() -> None:
    for ours in ("dense", "inline"):  # never loads the extension: every call is ours
        assert Exl3Backend(fused_max_rows=0, large=ours).ext is None
    for needs in (
        {"fused_max_rows": 1, "large": "dense"},
        {"fused_max_rows": 0},
        {"fused_max_rows": 0, "large": "decode"},
    ):
        with pytest.raises(Exl3Unavailable):  # CPU torch: a one-line reason, not a build attempt
            Exl3Backend(**needs)
    with pytest.raises(ValueError):
        Exl3Backend(fused_max_rows=0, large="nope")
    for raw, want in (("", None), ("0", 0), ("64", 64)):
        os.environ["DRAFT_EXL3_FUSED_MAX_ROWS"] = raw
        try:
            assert fused_max_rows_from_env() == want
        finally:
            del os.environ["DRAFT_EXL3_FUSED_MAX_ROWS"]
    for bad in ("x", "-1"):
        os.environ["DRAFT_EXL3_FUSED_MAX_ROWS"] = bad
        try:
            with pytest.raises(Exl3Unavailable):
                fused_max_rows_from_env()
        finally:
            del os.environ["DRAFT_EXL3_FUSED_MAX_ROWS"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str, str]]:
    """variant -> (EXL3 draft, its dense original, target)."""
    root = tmp_path_factory.mktemp("pair")
    out = {}
    # hidden and intermediate widths of 128 (exllamav3's padding unit): our paths fuse the output rotations there
    wide = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 128}
    for variant, ov in (("k3", wide), ("qwen3", {**wide, "attention_bias": True})):
        draft, target = make_tiny(variant, str(root / variant), **ov)
        q = str(root / f"{variant}_q")
        write_exl3_checkpoint(draft, q, bits=4, codebook="mcg", encoder="random")
        out[variant] = (q, draft, target)
    return out


@pytest.mark.parametrize("variant", ["k3", "qwen3"])
def test_routed_model_drafts_the_same_through_either_path(pair, variant, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every quantized GEMM site of both variants runs through the backend; the fused (fake kernel) path
    and the dense path give the same drafts, and the bucket picks the path by rows; on our paths the MLP's
    output rotations run inside SwiGLU and the residual adds."""
    from draft_server.models.exl3 import cuda

    fused_out: list[str] = []
    for name in ("hadamard_swiglu", "hadamard_128"):
        real = getattr(cuda, name)

        def spy(*a, _real=real, _name=name, **k):
            fused_out.append(_name if _name == "hadamard_swiglu" or k.get("add") is None else "add")
            return _real(*a, **k)

        monkeypatch.setattr(cuda, name, spy)
    q, _, target = pair[variant]
    rows = torch.randn(9, load_drafter(q, target, "cpu", "float32", 1 << 20).contract.tap_width)
    results = {}
    try:
        # dense only; recon only; inline only; decode only; ingest (9 rows) recon, block (B rows) fused; fused only
        for setting in ((0, "dense"), (0, "recon"), (0, "inline"), (0, "decode"), (8, "recon"), (1 << 20, "recon")):
            max_rows, large = setting
            d = load_drafter(q, target, "cpu", "float32", 1 << 20)
            ext = FakeExt()
            be = Exl3Backend(fused_max_rows=max_rows, ext=ext, large=large)
            set_backend(be)
            results[setting] = drafts(d, rows)
            m = d.model
            sites = len(m.linears) + 1  # every routed module, and the context K/V of all layers
            if max_rows == 0:
                assert be.calls["fused"] == 0 and be.calls[large] >= sites and not ext.rows
                ours = large in ("inline", "decode")
                assert ("hadamard_swiglu" in fused_out and "add" in fused_out) == ours, (large, set(fused_out))
                fused_out.clear()
            elif max_rows == 8:
                assert set(ext.rows) == {d.contract.block_size} and 9 not in ext.rows
                assert be.calls["recon"] >= 1 and be.calls["fused"] >= 1 and be.calls["dense"] == 0
            else:
                assert be.calls["fused"] == sum(be.calls.values()) and 9 in ext.rows
            assert isinstance(m.kv_a_all if variant == "k3" else m.kv_w, FusedLinear)
    finally:
        set_backend(DequantBackend())
    assert len({repr(r) for r in results.values()}) == 1, results


@pytest.mark.parametrize("variant", ["k3", "qwen3"])
def test_inputs_of_exllamav3_paths_are_made_fp16_by_their_producers(pair, variant, monkeypatch) -> None:
    """In bf16, a norm whose linear takes exllamav3's paths (fused, recon: they read fp16) writes fp16
    itself, and so does SwiGLU for such a down projection: fewer conversions, the same logits to the bit
    (the values are the bf16 results either way)."""
    from draft_server.drafters import DraftItem, IngestItem
    from protocol import GREEDY

    converted: list[tuple[int, ...]] = []
    half = Exl3Backend._half

    def counting(x2, k):
        if x2.dtype != torch.float16:
            converted.append(tuple(x2.shape))
        return half(x2, k)

    monkeypatch.setattr(Exl3Backend, "_half", staticmethod(counting))
    q, _, target = pair[variant]
    rows = torch.randn(9, load_drafter(q, target, "cpu", "bfloat16", 1 << 20).contract.tap_width)
    got = {}
    try:
        for producers in (True, False):
            for max_rows in (1 << 20, 8):  # every path fused; block rows fused, the 9 ingest rows recon
                if not producers:
                    monkeypatch.setattr(Exl3Backend, "half_input", lambda self, parts, rows, dtype: False)
                d = load_drafter(q, target, "cpu", "bfloat16", 1 << 20)
                set_backend(Exl3Backend(fused_max_rows=max_rows, ext=FakeExt(), large="recon"))
                converted.clear()
                assert d.reserve(1, 0, 9 + d.contract.block_size)
                d.ingest([IngestItem(1, 0, 0, rows.to(torch.bfloat16).view(torch.int16).numpy().view("uint16"))])
                outs, logits = d.draft_debug([DraftItem(1, 0, 9, 5, d.contract.block_size, GREEDY)])
                got[producers, max_rows] = (outs[0].tokens, logits[0], len(converted))
    finally:
        set_backend(DequantBackend())
    for max_rows in (1 << 20, 8):
        (t1, l1, n1), (t0, l0, n0) = got[True, max_rows], got[False, max_rows]
        assert t1 == t0 and torch.equal(l1, l0)
        assert n1 < n0, (max_rows, n1, n0)  # the norms' and the activation's conversions went


def test_dense_model_keeps_the_plain_ops(pair) -> None:
    from draft_server.models import gemm
    from draft_server.models.layers import ops

    _, draft, target = pair["k3"]
    m = load_drafter(draft, target, "cpu", "float32", 1 << 20).model
    assert m.weight_info.format == "dense" and not m.linears
    assert (m.linear, m.linear_add, m.swiglu_add) == (gemm.linear, ops.linear_add, ops.swiglu_add)
    assert not {"linear", "linear_add", "swiglu_add"} & set(vars(m))


# -- exllamav3 1.6.5's own sources (the wheel the device run carries) --------------------------------------


@pytest.fixture(scope="module")
def exl3_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wheel = WHEEL
    if not wheel.exists():  # a fresh checkout: fetch the same wheel from the package index
        got = tmp_path_factory.mktemp("exl3wheel")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "exllamav3==1.6.5", "--no-deps", "-d", str(got)]
        if subprocess.run(cmd, capture_output=True, timeout=300).returncode != 0 or not list(got.glob("*.whl")):
            pytest.skip(f"no {WHEEL.relative_to(ROOT)} and no package index ({' '.join(cmd[2:])})")
        wheel = next(got.glob("*.whl"))
    root = tmp_path_factory.mktemp("exl3src")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(root)
    return root


def test_build_args_are_exllamav3s_own(exl3_src: Path) -> None:
    """Our JIT build of exllamav3_ext has exllamav3/ext.py's arguments (one shared TORCH_EXTENSIONS_DIR
    build), its source list is every CUDA translation unit, and the exllamav3 names we use exist."""
    probe = textwrap.dedent(
        f"""
        import importlib.machinery, inspect, json, os, sys, types
        sys.path.insert(0, {str(exl3_src)!r})
        sys.modules["llguidance"] = None  # optional in exllamav3, absent on the device
        sys.modules["marisa_trie"] = None
        from torch.utils import cpp_extension
        seen = {{}}
        fake = types.ModuleType("exllamav3_ext")
        def getattr_(n):
            if n.startswith("__"):
                raise AttributeError(n)
            return lambda *a, **k: None
        fake.__getattr__ = getattr_
        def load(**kw):
            seen.update(kw)
            return fake
        cpp_extension.load = load
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        from draft_server.models.exl3.cuda import build_args, package_root
        ours = build_args(package_root())
        import exllamav3  # runs exllamav3/ext.py, which calls load(): captured
        from exllamav3.modules.quant.exl3 import LinearEXL3
        from exllamav3.modules.quant.exl3_lib.quantize import quantize_exl3
        from exllamav3.modules.linear import Linear
        sig = lambda f: list(inspect.signature(f).parameters)
        print(json.dumps({{
            "same": ours == seen, "ours": {{k: v for k, v in ours.items() if k != "sources"}},
            "sources": ours["sources"],
            "LinearEXL3": sig(LinearEXL3.__init__), "forward": sig(LinearEXL3.forward),
            "inner": sig(LinearEXL3.get_inner_weight_tensor), "weight": sig(LinearEXL3.get_weight_tensor),
            "quantize_exl3": sig(quantize_exl3), "init_H_data": sig(Linear.init_H_data),
        }}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["same"], r["ours"]
    src = [os.path.relpath(s, exl3_src / "exllamav3" / "exllamav3_ext") for s in r["sources"]]
    assert "bindings.cpp" in src and "quant/exl3_gemm.cu" in src and "quant/reconstruct.cu" in src
    assert not any(s.startswith("rocm/") for s in src) and all(s.endswith((".cu", ".cpp", ".c")) for s in src)
    assert sum(s.endswith(".cu") for s in src) > 150 and sum(s.endswith(".cpp") for s in src) > 10
    assert "-O3" in r["ours"]["extra_cuda_cflags"] and "--use_fast_math" in r["ours"]["extra_cuda_cflags"]
    init = ["self", "config", "in_features", "out_features", "scale", "su", "sv", "suh", "svh", "trellis", "mcg"]
    assert r["LinearEXL3"][: len(init) + 3] == [*init, "mul1", "bias", "out_dtype"]
    assert r["forward"] == ["self", "x", "params", "out_dtype"]
    assert r["inner"][0] == "self" and r["weight"] == ["self"]
    assert r["quantize_exl3"][:5] == ["weight", "H_data", "quant_args", "return_weight_q", "progress_str"]
    assert r["init_H_data"] == ["self", "init_tensor"]


def test_exl3_gemm_binding_takes_what_we_pass(exl3_src: Path) -> None:
    ext = exl3_src / "exllamav3" / "exllamav3_ext"
    header = (ext / "quant" / "exl3_gemm.cuh").read_text()
    decl = header[header.index("int exl3_gemm\n") :]
    decl = decl[: decl.index(");")]
    params = [p.split()[-1].strip("&*") for p in decl[decl.index("(") + 1 :].split(",")]
    assert params == ["A", "B", "C", "suh", "A_had", "svh", "force_shape_idx", "mcg", "mul1", "force_num_sms"]
    assert 'm.def("exl3_gemm", &exl3_gemm' in (ext / "bindings.cpp").read_text()
    assert 'getenv("EXL3_INT8_GEMV")' in (ext / "quant" / "exl3_gemv_int8.cu").read_text()


def test_golden_job_reads_with_our_decoder(tmp_path: Path) -> None:
    """The golden job's CPU-side comparison (what it prints on the GPU box) on a CPU-made fixture."""
    from draft_tools.exl3_golden import compare

    t = random_linear(256, 128, 2, "mul1", seed=8)
    lin = Exl3Linear("x", 128, 256, t["trellis"], t["suh"], t["svh"], "mul1")
    from draft_server.models.exl3.decode import weight_fp16_like_exllamav3

    x = torch.randn(7, 128).half()
    w = weight_fp16_like_exllamav3(lin.inner(), lin.suh, lin.svh)
    fx = {**t, "inner": lin.inner(), "weight": w, "x": x, "y_gemm": (x.float() @ w.float()).half()}
    row = compare(SimpleNamespace(stem="f"), {"codebook": "mul1", "in": "128", "out": "256", "K": "2"}, fx)
    assert row["inner"] == "exact" and row["weight_err"] < 2e-3 and row["y_err"] < 1e-2
