"""Predicted commits that miss, in a real vLLM engine (CPU) with the shipped tiny trained pair.

A repetition penalty is applied by vLLM's sampler after the forward, so the argmax of the raw
logits the plugin hands the proposer (the prediction) is not always the token greedy sampling
picks: some predicted commits miss. Every way a miss settles then runs in a real runner: a
commit at the real end (fewer drafts accepted, or another anchor) and, when sampling accepted
more drafts than the raw argmax said, the rows past the predicted end encoded from the runner's
aux hidden states at settle time (the early taps stopped at the predicted end). The greedy output
must equal vLLM without speculation under the same penalty, token for token.

The rows travel through the shared-memory ring (``DRAFT_TRANSPORT=shm``), written straight into
regions the proposer claims (``DraftClient.claim_rows``), the rows encoded at settle time too,
and the engine thread waits for its drafts spinning near their due time (``DRAFT_WAIT_SPIN_MS``).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from draft_tools.common import start_server, stop_server
from draft_tools.demo.part_vllm import PROMPTS, _run_worker
from draft_tools.tiny_pair.pair import ASSET_DIR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_mispredicted_commits_keep_greedy_output_equal_to_plain() -> None:
    draft, target = ASSET_DIR / "draft", ASSET_DIR / "target"
    proc, endpoint, _ = start_server(
        ["--model", str(draft), "--target-model", str(target), "--device", "cpu", "--dtype", "float32"]
    )
    # a budget no step misses on a loaded 2-core machine: the drafts, and so the run, are deterministic
    env = {**os.environ, "DRAFT_SERVER_ENDPOINT": endpoint, "DRAFT_BUDGET_MS": "5000", "DRAFT_TRANSPORT": "shm"}
    env["DRAFT_WAIT_SPIN_MS"] = "0.5"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = {"target": str(target), "prompts": PROMPTS, "max_tokens": 48, "repetition_penalty": 1.3}
    try:
        remote = _run_worker({**cfg, "k": 4}, env)
        plain = _run_worker(cfg, env)
    finally:
        stop_server(proc)
    assert remote["ids"] == plain["ids"]
    d = remote["drafter"]
    seen = {k: d.get(k, 0) for k in ("predicted_commits", "predicted_hits", "predicted_misses", "predicted_rows_again")}
    assert d.get("internal_errors", 0) == 0 and d.get("bad_drafts", 0) == 0, d
    assert seen["predicted_hits"] > 0 and seen["predicted_misses"] > 0, seen
    assert seen["predicted_rows_again"] > 0, seen  # rows encoded from the aux states after sampling
    assert remote["spec"].get("vllm:spec_decode_num_accepted_tokens", 0) > 0
    assert 0 < d["client"]["rows_in_place"] <= d["ring_claimed_steps"], d  # several misses' rows: one copy
