"""The step's GEMM strategies (``draft_server.models.gemm``): every way computes the product the plain
op computes, with and without the residual, at row counts that are and are not tile multiples; the
tuner keeps the plain op off CUDA and when tuning is off."""

from __future__ import annotations

import pytest
import torch

from draft_server.models import gemm


@pytest.mark.parametrize("M", [7, 64, 130, 448])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("name", gemm.STRATEGIES)
def test_every_strategy_computes_the_plain_product(M: int, residual: bool, name: str) -> None:
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 96, generator=g, dtype=torch.float64)
    w = torch.randn(80, 96, generator=g, dtype=torch.float64)
    h = torch.randn(M, 80, generator=g, dtype=torch.float64) if residual else None
    want = x @ w.t() + (h if h is not None else 0)
    got = gemm._RUN[name](x, w, h)
    assert got.shape == (M, 80) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_linear_and_linear_add_keep_shapes_and_use_plain_off_cuda() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 32, generator=g)
    w = torch.randn(48, 32, generator=g)
    h = torch.randn(3, 7, 48, generator=g)
    before = dict(gemm.TUNER.choice)
    gemm.TUNER.tuning = True
    try:
        torch.testing.assert_close(gemm.linear(x, w), torch.nn.functional.linear(x, w))
        torch.testing.assert_close(gemm.linear_add(h, x, w), h + torch.nn.functional.linear(x, w))
    finally:
        gemm.TUNER.tuning = False
    assert gemm.TUNER.choice == before  # nothing tuned on the CPU


def test_an_untuned_shape_is_plain_and_a_tuned_one_is_looked_up() -> None:
    x, w = torch.randn(5, 8), torch.randn(6, 8)
    key = (6, 8, 5, torch.float32, False)
    assert gemm.TUNER.strategy(key, x, w, None) == "plain"
    gemm.TUNER.choice[key] = "split"
    try:
        assert gemm.TUNER.strategy(key, x, w, None) == "split"
        assert gemm.TUNER.summary()["split"] >= 1
    finally:
        del gemm.TUNER.choice[key]
