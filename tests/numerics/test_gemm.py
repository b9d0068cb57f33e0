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


def test_the_markov_chain_takes_the_launch_shape_timed_fastest_only_while_tuning(monkeypatch) -> None:
    """``TUNER.markov_launch``: off while tuning is off or a stream captures (the default, the first
    candidate, nothing timed or kept); on, every candidate's chain is timed once, one that cannot launch
    is left out, the fastest is kept only if it beats the default by MIN_GAIN, and a kept shape is
    looked up without timing again."""
    from triton.runtime.errors import OutOfResources

    from draft_server.models.kernels import fused

    cands = fused.markov_candidates(64)
    assert cands[0] == fused.markov_launch(64) and len(set(cands)) == len(cands) > 2
    cost = {str(cands[0]): 1.0, str(cands[1]): 0.5, str(cands[2]): 0.1}  # the third cannot launch
    timed: list[str] = []
    ran: list[fused.MarkovLaunch] = []

    def fake_graph_ms(fn) -> float:
        fn()
        name = str(ran[-1])
        timed.append(name)
        if name == str(cands[2]):
            raise OutOfResources(1 << 20, 1 << 17, "shared memory")
        return cost.get(name, 0.99)

    capturing = [False]
    monkeypatch.setattr(gemm, "graph_ms", fake_graph_ms)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    tuner = gemm.GemmTuner()
    key = (64, 1000, 256, torch.bfloat16)
    assert tuner.markov_launch(key, ran.append, cands) == cands[0] and not timed and not tuner.markov
    tuner.tuning = True
    capturing[0] = True
    assert tuner.markov_launch(key, ran.append, cands) == cands[0] and not timed and not tuner.markov
    capturing[0] = False
    assert tuner.markov_launch(key, ran.append, cands) == cands[1]
    assert timed == [str(c) for c in cands] and str(cands[2]) not in tuner.markov_timings[key]
    assert tuner.markov_launch(key, ran.append, cands) == cands[1] and len(timed) == len(cands)  # kept
    assert tuner.markov_summary() == {repr(key): str(cands[1])}
    other = (32, 1000, 256, torch.bfloat16)
    cost[str(cands[1])] = 0.98  # 2% faster than the default: not enough
    assert tuner.markov_launch(other, ran.append, cands) == cands[0]
