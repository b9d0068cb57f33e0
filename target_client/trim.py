"""Load-aware verification (DSpark paper Algorithm 1; DESIGN §6): how many of each request's
drafts go to the target for verification this step.

Owns the verification-cost model and the trimming policy. It knows nothing of vLLM, sockets or
the draft model: the caller feeds it the engine's step times, the drafts' confidences and the
time a step spends outside the target's forward.

* ``StepCost``: the target's step time as a function of the tokens the step runs, fitted online
  from the engine's own step times. Per token-count bucket (exact below 32 tokens, then 16
  buckets per octave) the median of its last ``per_bucket`` samples, so a stalled step or an
  idle gap moves nothing and memory is bounded; a Theil-Sen line ``base + per_token * T``
  through the bucket medians (robust to a whole odd bucket). The engine's first steps are
  skipped (warm-up). It answers only once samples cover two buckets far enough apart; until
  then nothing is trimmed.
* ``plan``: the paper's greedy prefix scheduler for one step. Candidates (request r, draft j)
  enter in descending prefix survival a_{r,j} = ∏_{i≤j} c_{r,i}; each adds one verified token
  and a_{r,j} expected accepted tokens; the step's expected tokens per second is
  (requests + Σ a) / (fixed_s + cost(T)). The prefix of candidates with the best rate is kept,
  but only when its predicted rate beats keeping every draft by ``margin``: a model that says
  trimming barely pays is within its own error, and an unneeded trim loses accepted tokens.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from target_client.metrics import position_label, verify_metrics_for


def survival(confidence: Sequence[float]) -> list[float]:
    """Prefix survival a_j = ∏_{i≤j} c_i of per-draft conditional confidences (clamped to [0, 1])."""
    out, a = [], 1.0
    for c in confidence:
        a *= min(1.0, max(0.0, float(c)))
        out.append(a)
    return out


def _bucket(tokens: int) -> int:
    if tokens < 32:
        return tokens
    shift = tokens.bit_length() - 5  # 16 buckets per octave
    return (tokens >> shift) << shift


@dataclass(frozen=True, slots=True)
class Line:
    base_s: float
    per_token_s: float

    def __call__(self, tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens


class StepCost:
    """Step time (seconds) vs tokens in the step, fitted online (see the module docstring)."""

    def __init__(self, per_bucket: int = 16, min_samples: int = 5, min_span: float = 1.25, warmup: int = 32) -> None:
        self.per_bucket = per_bucket
        self.min_samples = min_samples
        self.min_span = min_span  # the largest fitted bucket is at least this multiple of the smallest
        self.warmup = warmup  # the engine's first steps (allocations, first-shape work) are not its cost
        self._samples: dict[int, deque[float]] = {}
        self._line: Line | None = None
        self._dirty = False
        self.observed = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not 0.0 < seconds < 60.0:
            return
        self.observed += 1
        if self.observed <= self.warmup:
            return
        b = _bucket(int(tokens))
        q = self._samples.get(b)
        if q is None:
            q = self._samples[b] = deque(maxlen=self.per_bucket)
        q.append(float(seconds))
        self._dirty = True

    def line(self) -> Line | None:
        """The fitted line, or None while the samples cannot tell a slope."""
        if self._dirty:
            self._dirty = False
            self._line = self._fit()
        return self._line

    def _fit(self) -> Line | None:
        """Theil-Sen through the bucket medians: the median of the pairwise slopes, then the median
        intercept, so one bucket of odd steps (a stall, a first-of-its-shape step) cannot tilt it."""
        pts = sorted((b, statistics.median(q)) for b, q in self._samples.items() if len(q) >= self.min_samples)
        if len(pts) < 2 or pts[-1][0] < self.min_span * max(1, pts[0][0]):
            return None
        slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(pts) for x2, y2 in pts[i + 1 :]]
        slope = max(0.0, statistics.median(slopes))
        base = statistics.median(y - slope * x for x, y in pts)
        return Line(max(0.0, base), slope)


@dataclass(frozen=True, slots=True)
class Plan:
    keep: list[int]  # drafts kept per request
    rate_all: float  # predicted tokens per second keeping every draft
    rate_kept: float  # ... keeping ``keep``


def plan(
    survivals: Sequence[Sequence[float]],
    cost: Line,
    fixed_tokens: int,
    fixed_s: float,
    margin: float,
) -> Plan:
    """Drafts to keep per request (module docstring). ``survivals[r]``: request r's prefix
    survival per draft (empty: no drafts); ``fixed_tokens``: tokens of the step that are not
    these drafts (one anchor per request, at least); ``fixed_s``: seconds of a step outside the
    target's forward (drafting, scheduling)."""
    n_drafts = [len(s) for s in survivals]
    cands = sorted(
        ((a, j, r) for r, s in enumerate(survivals) for j, a in enumerate(s)), key=lambda c: (-c[0], c[1], c[2])
    )
    expected = float(len(survivals))  # every request gains its bonus / correction token
    best_m, best_rate = 0, expected / max(1e-9, fixed_s + cost(fixed_tokens))
    for m, (a, _j, _r) in enumerate(cands, start=1):
        expected += a
        rate = expected / max(1e-9, fixed_s + cost(fixed_tokens + m))
        if rate > best_rate:
            best_m, best_rate = m, rate
    rate_all = expected / max(1e-9, fixed_s + cost(fixed_tokens + len(cands)))
    if best_m == len(cands) or best_rate < rate_all * (1.0 + margin):
        return Plan(n_drafts, rate_all, rate_all)
    keep = [0] * len(survivals)
    for _a, _j, r in cands[:best_m]:
        keep[r] += 1  # descending survival within a request: its candidates come in draft order
    return Plan(keep, rate_all, best_rate)


class Verifier:
    """Load-aware verification for one engine: the cost model fed from step timings, the policy
    applied per step, and the draft_client_verify_* metrics.

    Timing hooks, in engine order: ``step_started`` when the engine starts executing a step (the
    target's forward follows), ``propose_started(tokens)`` when that step's drafting begins (so
    ``tokens`` — every token the step ran — took the time in between), ``propose_done`` when the
    drafts go back. The rest of a step (drafting, scheduling, output handling) is ``fixed_s``:
    the medians of the recent gaps. ``enabled`` False: the same accounting, nothing trimmed.
    """

    def __init__(self, margin: float = 0.03, enabled: bool = True, registry: Any = None, window: int = 64) -> None:
        self.margin = margin
        self.enabled = enabled
        self.cost = StepCost()
        self.m = verify_metrics_for(registry)
        self._step_t: float | None = None
        self._propose_t: float | None = None
        self._done_t: float | None = None
        self._outside_s: deque[float] = deque(maxlen=window)  # propose done -> next step starts
        self._propose_s: deque[float] = deque(maxlen=window)  # our own time per step (drafting RPC)
        self.counts: dict[str, list[int]] = {s: [] for s in ("received", "sent", "accepted")}
        self.trimmed = 0
        self.trimmed_requests = 0
        self.planned_steps = 0
        self.trimmed_steps = 0

    # -- timing ------------------------------------------------------------------------------
    def step_started(self) -> None:
        now = time.perf_counter()
        if self._done_t is not None:
            self._outside_s.append(now - self._done_t)
            self._done_t = None
        self._step_t = now

    def propose_started(self, step_tokens: int) -> None:
        now = time.perf_counter()
        if self._step_t is not None:
            self.cost.observe(step_tokens, now - self._step_t)
            self._step_t = None
        self._propose_t = now

    def propose_done(self) -> None:
        now = time.perf_counter()
        if self._propose_t is not None:
            self._propose_s.append(now - self._propose_t)
            self._propose_t = None
        self._done_t = now

    def fixed_s(self) -> float:
        return sum(statistics.median(q) for q in (self._outside_s, self._propose_s) if q)

    # -- accounting --------------------------------------------------------------------------
    def _count(self, stage: str, n: int) -> None:
        row = self.counts[stage]
        if len(row) < n:
            row.extend([0] * (n - len(row)))
        for j in range(n):
            row[j] += 1
            self.m.drafts.labels(stage, position_label(j + 1)).inc()

    def verified(self, num_accepted: int) -> None:
        """One request's outcome of the drafts it was sent last step (``num_accepted`` of them)."""
        self._count("accepted", num_accepted)

    # -- the policy --------------------------------------------------------------------------
    def trim(
        self, confidences: Sequence[Sequence[float] | None], drafts: Sequence[int], fixed_tokens: int
    ) -> list[int]:
        """Drafts to keep per request. ``drafts[r]``: drafts request r received; ``confidences[r]``
        their per-draft confidence (None or short: that request is kept whole and its drafts still
        count as tokens of the step); ``fixed_tokens``: the next step's tokens besides drafts."""
        keep = list(drafts)
        for n in drafts:
            self._count("received", n)
        line = self.cost.line()
        if self.enabled and line is not None:
            self.m.cost.labels("base").set(line.base_s)
            self.m.cost.labels("per_token").set(line.per_token_s)
            idx = [r for r, (c, n) in enumerate(zip(confidences, drafts, strict=True)) if n and c and len(c) >= n]
            whole = sum(n for r, n in enumerate(drafts) if r not in set(idx))
            if idx:
                self.planned_steps += 1
                p = plan(
                    [survival(confidences[r][: drafts[r]]) for r in idx],  # type: ignore[index]
                    line,
                    fixed_tokens + whole,
                    self.fixed_s(),
                    self.margin,
                )
                for r, k in zip(idx, p.keep, strict=True):
                    keep[r] = k
        cut = sum(drafts) - sum(keep)
        if cut:
            self.trimmed += cut
            self.trimmed_steps += 1
            n_req = sum(1 for k, n in zip(keep, drafts, strict=True) if k < n)
            self.trimmed_requests += n_req
            self.m.trimmed.inc(cut)
            self.m.trimmed_requests.inc(n_req)
        for k in keep:
            self._count("sent", k)
        return keep

    def stats(self) -> dict[str, Any]:
        line = self.cost.line()
        return {
            "enabled": self.enabled,
            "margin": self.margin,
            "per_position": {s: list(v) for s, v in self.counts.items()},
            "trimmed_drafts": self.trimmed,
            "trimmed_requests": self.trimmed_requests,
            "planned_steps": self.planned_steps,
            "trimmed_steps": self.trimmed_steps,
            "cost_base_ms": None if line is None else round(line.base_s * 1e3, 4),
            "cost_per_token_ms": None if line is None else round(line.per_token_s * 1e3, 5),
            "cost_samples": self.cost.observed,
            "fixed_ms": round(self.fixed_s() * 1e3, 4),
        }
