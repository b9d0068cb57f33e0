"""The skinny weight GEMM (``kernels/skinny.py``) against the product it replaces, under Triton's
interpreter on the CPU (compiled on a GPU): every k split, with and without the residual, row counts
below and at the tile, a column tile cut by the output's edge; the split's partials summed the same
way on every call (its arrival counters reset); ``gemm`` dispatching a tuned shape to it."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from draft_server.models import gemm
from draft_server.models.kernels.skinny import SkinnyConfig, SkinnyGemm

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.bfloat16] if DEV.type == "cuda" else [torch.float32, torch.bfloat16]  # fp32 dots: TF32 on a GPU
N, K = 80, 256  # 80 = 2.5 column tiles of 32


def _operands(M: int, dtype: torch.dtype, residual: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(DEV, dtype)
    h = torch.randn(M, N, generator=g).to(DEV, dtype) if residual else None
    want = x.double() @ w.double().t() + (h.double() if h is not None else 0)
    return x, w, h, want


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("M", [1, 7, 16, 33, 112])
def test_skinny_gemm_computes_the_product_the_same_way_every_call(
    M: int, residual: bool, split: int, dtype: torch.dtype
) -> None:
    x, w, h, want = _operands(M, dtype, residual)
    k = SkinnyGemm(M, N, K, SkinnyConfig(block_n=32, block_k=32, split=split), DEV)
    first = k(x, w, h)
    assert first.shape == (M, N) and first.dtype == dtype
    torch.testing.assert_close(first.double(), want, **_tol(dtype))
    assert int(k.cnt.abs().sum()) == 0  # the last program of every tile reset its counter
    again = k(x, w, h)
    assert torch.equal(first, again)  # the partials summed in the same order; nothing left from the first call


def test_skinny_gemm_reads_row_strided_operands_in_place() -> None:
    x, w, h, _ = _operands(7, torch.bfloat16, True, seed=3)
    wide = torch.zeros(7, 2 * K, dtype=x.dtype, device=DEV)
    wide[:, :K] = x
    k = SkinnyGemm(7, N, K, SkinnyConfig(block_n=32, block_k=64, split=2), DEV)
    assert torch.equal(k(wide[:, :K], w, h), k(x, w, h))


def test_skinny_gemm_refuses_shapes_it_was_not_made_for() -> None:
    cfg = SkinnyConfig(block_n=32, block_k=64, split=2)
    with pytest.raises(ValueError, match="at most 128 rows"):
        SkinnyGemm(129, N, K, cfg, DEV)
    with pytest.raises(ValueError, match="multiple of split x block_k"):
        SkinnyGemm(7, N, 192, cfg, DEV)
    assert not SkinnyGemm.fits(7, 192, cfg) and SkinnyGemm.fits(7, 256, cfg)
    k = SkinnyGemm(7, N, K, cfg, DEV)
    x, w, h, _ = _operands(8, torch.bfloat16, False)
    with pytest.raises(ValueError, match="made for"):
        k(x, w, h)


def test_a_shape_tuned_to_skinny_runs_its_kernel_and_a_strided_call_falls_back_to_plain() -> None:
    x, w, h, want = _operands(7, torch.bfloat16, True, seed=5)
    key = (N, K, 7, torch.bfloat16, True)
    k = SkinnyGemm(7, N, K, SkinnyConfig(block_n=32, block_k=64, split=2), DEV)
    calls = []

    def counted(*a):
        calls.append(1)
        return k(*a)

    gemm.TUNER.choice[key] = "skinny"
    gemm.TUNER.skinny[key, x.device] = counted
    try:
        y = gemm._gemm(x, w, h)
        assert len(calls) == 1 and torch.equal(y, k(x, w, h))
        torch.testing.assert_close(y.double(), want, **_tol(torch.bfloat16))
        assert gemm.TUNER.summary()["skinny"] >= 1
        w_strided = torch.zeros(N, 2 * K, dtype=w.dtype, device=DEV)[:, ::2]  # last dim strided: plain
        w_strided.copy_(w)
        y2 = gemm._gemm(x, w_strided, h)
        assert len(calls) == 1
        torch.testing.assert_close(y2.double(), want, **_tol(torch.bfloat16))
    finally:
        del gemm.TUNER.choice[key], gemm.TUNER.skinny[key, x.device]


def test_the_tuner_offers_skinny_only_for_few_half_precision_rows() -> None:
    w = torch.randn(N, 1024, dtype=torch.bfloat16, device=DEV)
    few = gemm.TUNER._skinny_kernels(torch.randn(7, 1024, dtype=torch.bfloat16, device=DEV), w, None)
    assert few and all(name.startswith("skinny ") for name in few)
    assert not gemm.TUNER._skinny_kernels(torch.randn(65, 1024, dtype=torch.bfloat16, device=DEV), w, None)
    assert not gemm.TUNER._skinny_kernels(torch.randn(7, 1024, device=DEV), w.float(), None)
