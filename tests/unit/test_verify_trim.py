"""Load-aware verification (``target_client.trim``): the cost model's fit and robustness, the
greedy prefix policy against brute force, its margin, and the Verifier's accounting."""

from __future__ import annotations

import itertools
import random

import pytest
from prometheus_client import CollectorRegistry

from target_client.trim import Line, StepCost, Verifier, plan, survival


def test_cost_model_fits_a_line_ignores_stalls_and_stays_bounded() -> None:
    c = StepCost(per_bucket=8, warmup=4)
    for _ in range(4):
        c.observe(6, 1.0)  # warm-up steps of a fresh engine: not its cost
    for _ in range(5):
        c.observe(10, 0.010 + 0.0001 * 10)
    assert c.line() is None  # one bucket: no slope yet
    rng = random.Random(0)
    for _ in range(400):
        t = rng.choice([6, 12, 40, 96, 300, 1000])
        c.observe(t, 0.010 + 0.0001 * t + rng.uniform(-1e-4, 1e-4))
    for t in (12, 96, 300):  # a few stalls (a preempted process, an idle gap) move nothing
        c.observe(t, 5.0)
    for _ in range(8):  # nor does a whole bucket of odd steps
        c.observe(2000, 0.001)
    line = c.line()
    assert line is not None
    assert line.base_s == pytest.approx(0.010, abs=5e-4)
    assert line.per_token_s == pytest.approx(0.0001, rel=0.05)
    for t in range(1, 100_000, 7):
        c.observe(t, 0.01)
    assert sum(len(q) for q in c._samples.values()) <= 8 * 200  # bounded by the bucket count


def test_cost_model_never_goes_negative_and_rejects_nonsense() -> None:
    c = StepCost(warmup=0)
    for _ in range(5):
        c.observe(10, 0.02)
        c.observe(100, 0.01)  # faster with more tokens: clamp the slope at 0
        c.observe(50, -1.0)
        c.observe(0, 0.01)
    line = c.line()
    assert line is not None and line.per_token_s == 0.0 and line.base_s > 0


def _brute(survs: list[list[float]], cost: Line, fixed_tokens: int, fixed_s: float) -> float:
    best = 0.0
    for keep in itertools.product(*[range(len(s) + 1) for s in survs]):
        e = len(survs) + sum(sum(s[:k]) for s, k in zip(survs, keep, strict=True))
        best = max(best, e / (fixed_s + cost(fixed_tokens + sum(keep))))
    return best


def test_greedy_prefix_policy_matches_brute_force() -> None:
    rng = random.Random(1)
    for _ in range(200):
        survs = [survival([rng.random() ** 0.3 for _ in range(rng.randint(0, 4))]) for _ in range(rng.randint(1, 4))]
        cost = Line(rng.uniform(0.001, 0.02), rng.uniform(0, 0.002))
        fixed_s = rng.uniform(0, 0.01)
        p = plan(survs, cost, len(survs), fixed_s, margin=0.0)
        got = (len(survs) + sum(sum(s[:k]) for s, k in zip(survs, p.keep, strict=True))) / (
            fixed_s + cost(len(survs) + sum(p.keep))
        )
        assert got == pytest.approx(_brute(survs, cost, len(survs), fixed_s), rel=1e-9)
        assert all(0 <= k <= len(s) for k, s in zip(p.keep, survs, strict=True))


def test_flat_cost_keeps_everything_and_steep_cost_trims_the_unlikely_tail() -> None:
    survs = [survival([0.9, 0.8, 0.5, 0.2]), survival([0.95, 0.9, 0.9, 0.9])]
    assert plan(survs, Line(0.01, 0.0), 2, 0.005, 0.03).keep == [4, 4]
    p = plan(survs, Line(0.01, 0.002), 2, 0.005, 0.0)
    assert p.keep[0] < 4 and p.keep[1] >= p.keep[0] and p.rate_kept > p.rate_all
    # a margin larger than the predicted gain keeps every draft
    gain = p.rate_kept / p.rate_all - 1
    assert plan(survs, Line(0.01, 0.002), 2, 0.005, gain * 1.01).keep == [4, 4]


def test_verifier_accounts_per_position_and_trims_only_with_a_fitted_model() -> None:
    v = Verifier(margin=0.0, registry=CollectorRegistry())
    conf = [[0.9, 0.5, 0.1, 0.1], None, [0.99, 0.99]]
    v.cost = StepCost(warmup=0)
    assert v.trim(conf, [4, 3, 2], 3) == [4, 3, 2]  # no cost model yet
    for t, s in [(8, 0.010), (40, 0.030), (100, 0.060)] * 5:
        v.cost.observe(t, s)  # steep: 0.5 ms per token
    keep = v.trim(conf, [4, 3, 2], 3)
    assert keep[1] == 3 and keep[2] == 2 and keep[0] < 4  # no confidence: kept whole
    v.verified(2)
    st = v.stats()
    assert st["per_position"]["received"] == [6, 6, 4, 2]
    assert sum(st["per_position"]["sent"]) == 9 + sum(keep)
    assert st["per_position"]["accepted"] == [1, 1]
    assert st["trimmed_drafts"] == 4 - keep[0] and st["trimmed_requests"] == 1
    off = Verifier(enabled=False, registry=CollectorRegistry())
    off.cost = v.cost
    assert off.trim(conf, [4, 3, 2], 3) == [4, 3, 2]
