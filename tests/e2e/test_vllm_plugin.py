"""Fast checks of the vLLM plugin and of RemoteDSparkProposer's step logic, without an engine.

* the entry point is installed and ``register()`` wraps the 4 runner methods + compute_hash,
  idempotently; a changed vLLM signature fails loudly, naming the version;
* the compute_hash wrapper gives custom_class-with-aux configs their own key per tap layer set
  and leaves every other config's hash alone;
* the step logic against a fake client: rows per request (rejected drafts excluded), positions,
  anchors, chunked-prefill rows as k=0 ingest, tap columns in contract order (vLLM hands aux
  states in ascending layer order), bf16 bit patterns, lifecycle (free on finish, rollback and
  prefix-start counting), and that a client fault or an internal error yields [] drafts;
* ``DRAFT_WIRE_FORMAT``: fp8 rows and projected rows (with ``DRAFT_MODEL_DIR``'s projection, its
  id in the client's config) of the same step, and the one-line errors of a bad setting.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch

from protocol import DType, ModelContract
from target_client.vllm import plugin as vllm_plugin
from target_client.vllm.plugin import DraftStepContext, register

HIDDEN, VOCAB, LAYERS, K = 8, 100, 4, 3


def test_entry_point_and_register() -> None:
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "draft_service"]
    assert eps and eps[0].value == "target_client.vllm.plugin:register"
    register()
    register()  # idempotent
    from vllm.config.speculative import SpeculativeConfig
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for name in vllm_plugin._RUNNER_SIGNATURES:
        fn = getattr(GPUModelRunner, name)
        assert getattr(fn, "__draft_service_wrapped__", False), name
        assert getattr(CPUModelRunner, name) is fn  # the CPU runner inherits the wrapper
        assert not getattr(fn.__draft_service_original__, "__draft_service_wrapped__", False)  # wrapped once
    assert getattr(SpeculativeConfig.compute_hash, "__draft_service_wrapped__", False)


def test_signature_change_fails_loudly() -> None:
    class Runner:
        def _setup_eagle3_aux_hidden_state_outputs(self) -> None: ...
        def _get_eagle3_aux_layers_from_config(self) -> None: ...
        def _update_states(self, scheduler_output: Any, extra: int) -> None: ...
        def propose_draft_token_ids(self) -> None: ...

    class Spec:
        def compute_hash(self) -> str:
            return ""

    with pytest.raises(RuntimeError, match=r"_update_states has parameters .*installed vLLM 0\.32"):
        vllm_plugin._check_signatures(Runner, Spec)


def test_compute_hash_key() -> None:
    register()
    from vllm.config.speculative import SpeculativeConfig

    from target_client.vllm.proposer import CLASS_PATH

    def spec(method: str, model: str | None) -> Any:
        return SimpleNamespace(method=method, model=model, draft_model_config=None, enable_adaptive_verification=False)

    orig = SpeculativeConfig.compute_hash.__draft_service_original__
    other = spec("custom_class", "json.JSONDecoder")  # a class without wants_aux_hidden_states
    assert SpeculativeConfig.compute_hash(other) == orig(other)
    ngram = spec("ngram", None)
    assert SpeculativeConfig.compute_hash(ngram) == orig(ngram)
    ours = spec("custom_class", CLASS_PATH)
    saved = dict(vllm_plugin.RESOLVED_AUX_LAYERS)
    try:
        vllm_plugin.RESOLVED_AUX_LAYERS[CLASS_PATH] = (1, 3)
        h13 = SpeculativeConfig.compute_hash(ours)
        vllm_plugin.RESOLVED_AUX_LAYERS[CLASS_PATH] = (1, 2)
        h12 = SpeculativeConfig.compute_hash(ours)
    finally:
        vllm_plugin.RESOLVED_AUX_LAYERS.clear()
        vllm_plugin.RESOLVED_AUX_LAYERS.update(saved)
    assert len({h13, h12, orig(ours)}) == 3
    assert len(h13) == len(orig(ours))


# ---------------------------------------------------------------- step logic against a fake client


class FakeClient:
    contract: Any = None
    row_layout: Any = None
    advised_k = -1  # the server's load advice (none)
    last_timing: Any = None  # no server: no timing

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.calls: list[tuple[list[Any], np.ndarray | None]] = []
        self.freed: list[str] = []
        self.fail = False

    def connect(self, wait: bool = True) -> Any:
        FakeClient.contract = ModelContract("fake", (3, 1), HIDDEN, VOCAB, 8, VOCAB - 1, DType.BF16)
        return SimpleNamespace(contract=FakeClient.contract)

    def step(self, requests: list[Any], taps: np.ndarray | None) -> list[Any]:
        if self.fail:
            raise RuntimeError("boom")
        self.calls.append((list(requests), None if taps is None else taps.copy()))
        return [SimpleNamespace(tokens=[(r.anchor + j + 1) % VOCAB for j in range(r.k)]) for r in requests]

    def free(self, sessions: list[str]) -> None:
        self.freed.extend(sessions)

    def ping(self, timeout_ms: float = 100.0) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def _vllm_config() -> Any:
    hf = SimpleNamespace(num_hidden_layers=LAYERS)
    model = SimpleNamespace(get_hidden_size=lambda: HIDDEN, get_vocab_size=lambda: VOCAB, hf_text_config=hf)
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=model,
        device_config=SimpleNamespace(device_type="cpu"),
    )


def _make_proposer(monkeypatch: pytest.MonkeyPatch, client: type) -> Any:
    """A RemoteDSparkProposer over the fake ``client`` class, default settings."""
    from target_client.vllm import proposer as vllm_proposer

    monkeypatch.setattr(vllm_proposer, "DraftClient", client)
    monkeypatch.setenv("DRAFT_SERVER_ENDPOINT", "tcp://127.0.0.1:1")
    for name in ("DRAFT_TAP_LAYERS", "DRAFT_DEBUG_CHECKS", "DRAFT_PREDICTED_COMMIT"):
        monkeypatch.delenv(name, raising=False)
    return vllm_proposer.RemoteDSparkProposer(_vllm_config())


@pytest.fixture
def proposer(monkeypatch: pytest.MonkeyPatch) -> Any:
    p = _make_proposer(monkeypatch, FakeClient)
    yield p
    p.close()


def test_endpoint_list_or_dns_name_drafts_through_a_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    from target_client.vllm import proposer as vllm_proposer

    class FakeFleet(FakeClient):
        pass

    monkeypatch.setattr(vllm_proposer, "DraftClient", FakeClient)
    monkeypatch.setattr(vllm_proposer, "FleetClient", FakeFleet)
    monkeypatch.delenv("DRAFT_TAP_LAYERS", raising=False)
    for endpoint, fleet in (
        ("tcp://10.0.0.5:5557", False),
        ("tcp://10.0.0.5:5557,tcp://10.0.0.6:5557", True),
        ("dns+tcp://draft-server.default.svc:5557", True),
    ):
        monkeypatch.setenv("DRAFT_SERVER_ENDPOINT", endpoint)
        p = vllm_proposer.RemoteDSparkProposer(_vllm_config())
        assert isinstance(p.client, FakeFleet) is fleet and p.client.cfg.endpoint == endpoint
        p.close()
    monkeypatch.setenv("DRAFT_SERVER_ENDPOINT", "tcp://10.0.0.5:5557,10.0.0.6:5557")  # an item without a scheme
    with pytest.raises(ValueError, match="no scheme"):
        vllm_proposer.RemoteDSparkProposer(_vllm_config())


def _code(token: np.ndarray | torch.Tensor, col: np.ndarray | torch.Tensor, sign: float) -> Any:
    """A value exact in bf16 (integers <= 256) naming the token, the column and the layer (sign)."""
    return sign * (token * HIDDEN + col + 1)


def _aux(num_tokens: int) -> list[torch.Tensor]:
    """Aux states in vLLM's ascending layer order (1, 3); layer 1 positive codes, layer 3 negative."""
    tok = torch.arange(num_tokens, dtype=torch.float32)[:, None]
    col = torch.arange(HIDDEN, dtype=torch.float32)[None, :]
    return [_code(tok, col, 1.0).contiguous(), _code(tok, col, -1.0).contiguous()]


def _ctx(
    req_ids: list[str],
    qsl: list[int],
    num_draft: list[int],
    sampled: list[list[int]],
    computed: list[int],
    token_table: np.ndarray,
) -> DraftStepContext:
    n_tok = qsl[-1]
    return DraftStepContext(
        req_ids=req_ids,
        query_start_loc=np.array(qsl, dtype=np.int32),
        num_draft_tokens=num_draft,
        sampled_token_ids=sampled,
        num_computed_tokens=np.array(computed, dtype=np.int32),
        num_tokens_no_spec=np.zeros(len(req_ids), dtype=np.int32),
        token_ids_cpu=token_table,
        positions=torch.zeros(n_tok, dtype=torch.int64),
        aux_hidden_states=_aux(n_tok + 5),  # padded beyond num_tokens, as vLLM may hand them
        num_tokens=n_tok,
        num_spec_tokens=K,
    )


def test_step_rows_anchors_taps(proposer: Any) -> None:
    assert proposer.tap_layer_ids == (3, 1) and proposer.aux_layer_ids == (1, 3)
    table = np.arange(4 * 64, dtype=np.int32).reshape(4, 64) % VOCAB
    # row a: decode, 3 drafts scheduled (4 tokens), 1 accepted + bonus -> 2 valid rows, anchor 77
    # row b: last prefill chunk of 5 tokens, sampled 42 -> 5 rows, anchor 42
    # row c: middle prefill chunk of 6 tokens, no sample -> k=0 ingest, anchor = next prompt token
    ctx = _ctx(["a", "b", "c"], [0, 4, 9, 15], [3, 0, 0], [[11, 77], [42], []], [20, 30, 6], table)
    out = proposer.propose_remote(ctx)
    assert out == [[78, 79, 80], [43, 44, 45], []]
    (reqs, taps), *_ = proposer.client.calls
    assert [(r.session, r.pos, r.rows, r.anchor, r.k) for r in reqs] == [
        ("a", 20, 2, 77, K),
        ("b", 30, 5, 42, K),
        ("c", 6, 6, int(table[2, 12]), 0),
    ]
    assert taps.dtype == np.uint16 and taps.shape == (13, 2 * HIDDEN) and taps.flags.c_contiguous
    assert _flat_rows(taps) == [0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # rejected drafts (flat 2, 3) skipped


def _flat_rows(taps: np.ndarray) -> list[int]:
    """Which flat tokens of ``_aux`` these bf16 wire rows are (each row checked whole, in contract
    order: tap 3, then tap 1)."""
    vals = (taps.astype(np.uint32) << 16).view(np.float32)
    tok = np.rint((-vals[:, 0] - 1) / HIDDEN).astype(np.int64)  # tap 3, column 0: -(t * HIDDEN + 1)
    col = np.arange(HIDDEN, dtype=np.float32)[None, :]
    t = tok.astype(np.float32)[:, None]
    expect = np.concatenate([_code(t, col, -1.0), _code(t, col, 1.0)], axis=1)
    np.testing.assert_array_equal(vals, expect)
    return tok.tolist()


def test_advised_k_caps_requests_and_confidence_trims_drafts(proposer: Any) -> None:
    from target_client.trim import Line

    table = np.arange(4 * 64, dtype=np.int32).reshape(4, 64) % VOCAB
    ctx = _ctx(["a", "b", "c"], [0, 4, 9, 15], [3, 0, 0], [[11, 77], [42], []], [20, 30, 6], table)
    proposer.client.advised_k = 2  # the server advises a smaller k: every request asks for 2
    assert proposer.propose_remote(ctx) == [[78, 79], [43, 44], []]
    assert [r.k for r in proposer.client.calls[-1][0]] == [2, 2, 0]
    proposer.client.advised_k = -1
    step = proposer.client.step

    def with_confidence(requests: list[Any], taps: Any) -> list[Any]:
        replies = step(requests, taps)
        for r in replies:
            r.confidence = [0.9, 0.3, 0.05][: len(r.tokens)]
        return replies

    proposer.client.step = with_confidence

    class Steep:  # verifying a token costs as much as a step: the unlikely tail goes
        observed = 0

        def line(self) -> Line:
            return Line(0.001, 0.001)

        def observe(self, tokens: int, seconds: float) -> None:
            pass

    proposer.verifier.cost, proposer.verifier.margin = Steep(), 0.0
    # survivals 0.9, 0.27, 0.0135: rates 2/4, 2.9/5, 3.8/6, 4.07/7 per ms for 0..3 of the 6 drafts
    assert proposer.propose_remote(ctx) == [[78], [43], []]
    v = proposer.stats()["verify"]
    assert v["trimmed_drafts"] == 4 and v["trimmed_requests"] == 2
    assert v["per_position"]["received"] == [4, 4, 2] and v["per_position"]["sent"] == [4, 2]
    proposer.verifier.enabled = False  # DRAFT_TRIM=0
    assert proposer.propose_remote(ctx) == [[78, 79, 80], [43, 44, 45], []]


def test_wire_formats_encode_the_steps_rows(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from safetensors.torch import save_file

    from draft_server.models.staging import dequantize_fp8
    from target_client.projection import Projection
    from target_client.vllm import proposer as vllm_proposer

    monkeypatch.setattr(vllm_proposer, "DraftClient", FakeClient)
    monkeypatch.setenv("DRAFT_SERVER_ENDPOINT", "tcp://127.0.0.1:1")
    monkeypatch.delenv("DRAFT_TAP_LAYERS", raising=False)
    table = np.arange(4 * 64, dtype=np.int32).reshape(4, 64) % VOCAB
    flat_rows = [0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    tok, col = np.array(flat_rows, np.float32)[:, None], np.arange(HIDDEN, dtype=np.float32)[None, :]
    want = torch.from_numpy(np.concatenate([_code(tok, col, -1.0), _code(tok, col, 1.0)], axis=1))

    def rows(fmt: str, layout: Any = None) -> tuple[Any, np.ndarray]:
        monkeypatch.setenv("DRAFT_WIRE_FORMAT", fmt)
        p = vllm_proposer.RemoteDSparkProposer(_vllm_config())
        p.client.row_layout = layout
        try:
            ctx = _ctx(["a", "b", "c"], [0, 4, 9, 15], [3, 0, 0], [[11, 77], [42], []], [20, 30, 6], table)
            assert p.propose_remote(ctx) == [[78, 79, 80], [43, 44, 45], []]
            return p.client.cfg, p.client.calls[0][1]
        finally:
            p.close()

    cfg, taps = rows("fp8")
    assert cfg.wire_format == "fp8" and taps.dtype == np.uint8 and taps.shape == (13, 2 * HIDDEN + 4)
    back = dequantize_fp8(torch.from_numpy(taps), torch.float32)
    assert ((back - want).abs() <= want.abs() / 16 + want.abs().amax(1, keepdim=True) / 448 / 1024).all()

    g = torch.Generator().manual_seed(0)
    fc, norm = torch.randn(16, 2 * HIDDEN, generator=g) / 8, 1 + torch.randn(16, generator=g) / 10
    save_file(
        {"fc.weight": fc.to(torch.bfloat16), "hidden_norm.weight": norm.to(torch.bfloat16)}, tmp_path / "m.safetensors"
    )
    (tmp_path / "config.json").write_text('{"rms_norm_eps": 1e-6}')
    with pytest.raises(ValueError, match="DRAFT_WIRE_FORMAT=projected needs DRAFT_MODEL_DIR"):
        rows("projected")
    monkeypatch.setenv("DRAFT_MODEL_DIR", str(tmp_path))
    cfg, taps = rows("projected", (DType.F32, 16))
    assert cfg.wire_format == "projected" and cfg.projection_id == Projection.load(str(tmp_path)).id
    y = want.to(torch.bfloat16).float() @ fc.to(torch.bfloat16).float().T
    c = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.to(torch.bfloat16).float()
    assert taps.dtype == np.float32 and taps.shape == (13, 16)
    torch.testing.assert_close(torch.from_numpy(taps), c, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="DRAFT_WIRE_FORMAT='fp4' is not one of bf16, projected, fp8"):
        rows("fp4")


def test_lifecycle_and_faults(proposer: Any) -> None:
    table = np.zeros((4, 64), dtype=np.int32)
    # a request whose first rows start at pos 32 (prefix-cache hit)
    proposer.propose_remote(_ctx(["p"], [0, 4], [0], [[5]], [32], table))
    # rows again from 0 (recompute after preemption): a rollback
    so = SimpleNamespace(finished_req_ids=set(), preempted_req_ids={"p"}, scheduled_cached_reqs=None)
    proposer.on_scheduler_output(so)
    proposer.propose_remote(_ctx(["p"], [0, 8], [0], [[5]], [0], table))
    s = proposer.stats()
    assert s["prefix_starts"] == 1 and s["rollbacks"] == 1 and s["preempted"] == 1 and s["live_requests"] == 1
    so = SimpleNamespace(finished_req_ids={"p"}, preempted_req_ids=None, scheduled_cached_reqs=None)
    proposer.on_scheduler_output(so)
    assert proposer.client.freed == ["p"] and proposer.stats()["live_requests"] == 0
    # the client failing (it never should) or an internal error: no drafts, no exception
    proposer.client.fail = True
    assert proposer.propose_remote(_ctx(["q"], [0, 1], [0], [[5]], [0], table)) == [[]]
    assert proposer.stats()["internal_errors"] == 1
    # drafts outside the vocabulary are dropped
    proposer.client.fail = False
    proposer.client.step = lambda reqs, taps: [SimpleNamespace(tokens=[VOCAB + 1, 1, 2]) for _ in reqs]
    assert proposer.propose_remote(_ctx(["r"], [0, 1], [0], [[5]], [0], table)) == [[]]
    assert proposer.stats()["bad_drafts"] == 1


class EarlyClient(FakeClient):
    """A fake client that takes early taps: records each call; a commit's drafts name its
    request's (pos, anchor), a step's its rows too, so a test sees which call each came from."""

    early_taps = True

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.log: list[tuple[str, list[Any], Any]] = []
        self._next = "commit"  # what the next submit_commit is: right after the taps, the predicted one
        self.exact: list[bool] = []  # send_taps' exact, per call
        self.follows: list[bool] = []  # send_taps' commit_follows, per call

    def send_taps(self, requests: list[Any], taps: Any, exact: bool = False, commit_follows: bool = False) -> bool:
        self.log.append(("taps", list(requests), taps.copy()))
        self.exact.append(exact)
        self.follows.append(commit_follows)
        self._next = "predicted"
        return True

    def _ticket(self, kind: str, requests: list[Any], taps: Any = None) -> Any:
        self.log.append((kind, list(requests), None if taps is None else taps.copy()))
        tag = {"predicted": 1, "commit": 2, "step": 3}[kind]
        replies = [SimpleNamespace(tokens=[tag, r.pos, r.anchor][: r.k], status=None) for r in requests]
        return SimpleNamespace(collect=lambda: replies)

    def submit_commit(self, requests: list[Any]) -> Any:
        kind, self._next = self._next, "commit"
        return self._ticket(kind, requests)

    def submit_step(self, requests: list[Any], taps: Any) -> Any:
        return self._ticket("step", requests, taps)


@pytest.fixture
def early_proposer(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A proposer over ``EarlyClient``, early taps and predicted commits on."""
    p = _make_proposer(monkeypatch, EarlyClient)
    yield p
    p.close()


def test_predicted_commits_hit_miss_and_resend_the_rows_past_a_short_prediction(early_proposer: Any) -> None:
    p = early_proposer
    c = p.client
    table = np.zeros((6, 64), dtype=np.int32)
    # five rows, each 3 drafts (4 tokens) but e (a middle prefill chunk of 4, no sample):
    # a: argmax [5, 6, 9, 1] vs drafts [5, 6, 7]: 2 accepted, anchor 9 predicted; real: the same
    # b: predicted 0 accepted (anchor 8), real 2 accepted (a processor changed the pick), anchor 4
    # c: predicted 2 accepted (anchor 3), real 1 accepted, anchor 12
    # d: sampled (temperature 0.8): no prediction
    # e: a prefill chunk that samples nothing (its rows end below the prompt's length)
    ids = ["a", "b", "c", "d", "e"]
    qsl, nd, pos = [0, 4, 8, 12, 16, 20], [3, 3, 3, 3, 0], [10, 20, 30, 40, 0]
    ctx = _ctx(ids, qsl, nd, None, pos, table)  # type: ignore[arg-type]
    ctx.num_tokens_no_spec = np.array([11, 21, 31, 41, 9], dtype=np.int32)
    ctx.sampling = [(0.0, 0, 1.0, None)] * 3 + [(0.8, 0, 1.0, None), (0.0, 0, 1.0, None)]
    ctx.draft_ids = [[5, 6, 7], [1, 2, 3], [7, 7, 7], [1, 1, 1], []]
    ctx.raw_argmax = [[5, 6, 9, 1], [8, 2, 3, 4], [7, 7, 3, 0], [1, 1, 1, 1], [4]]
    p.on_scheduler_output(SimpleNamespace(finished_req_ids=(), preempted_req_ids=None, scheduled_cached_reqs=None))
    p.send_taps(ctx)
    kinds = [e[0] for e in c.log]
    assert kinds == ["taps", "predicted"], kinds
    predicted = [(r.session, r.pos, r.anchor, r.k) for r in c.log[1][1]]
    assert predicted == [("a", 13, 9, K), ("b", 21, 8, K), ("c", 33, 3, K)]  # pos + 1 + accepted
    # the taps: a predicted request's rows up to its predicted end; d (sampled) and e whole
    spans = [(r.session, r.pos, r.rows) for r in c.log[0][1]]
    assert spans == [("a", 10, 3), ("b", 20, 1), ("c", 30, 3), ("d", 40, 4), ("e", 0, 4)], spans
    assert _flat_rows(c.log[0][2]) == [0, 1, 2, 4, 8, 9, 10, 12, 13, 14, 15, 16, 17, 18, 19]
    assert c.exact == [False]  # d's rejected rows ride along: the span may be declined for its size
    assert c.follows == [True]  # its predicted commits go right after: the server may wait for them
    sampled = [[5, 6, 9], [1, 2, 4], [7, 12], [1, 9], []]
    out = p.propose_remote(_ctx(ids, qsl, nd, sampled, pos, table))
    assert out[0] == [1, 13, 9]  # a: the predicted call's drafts, nothing sent for it
    assert out[1] == [3, 21, 4]  # b: rows 21..22 again with the real commit (anchor 4 at 23)
    assert out[2] == [2, 32, 12]  # c: an ordinary commit at its real end
    assert out[3] == [2, 42, 9]  # d: sampled, committed after sampling as before
    assert out[4] == []
    later = c.log[2:]
    assert sorted(e[0] for e in later) == ["commit", "step"]
    commit = next(e for e in later if e[0] == "commit")
    assert [(r.session, r.pos, r.rows, r.anchor) for r in commit[1]] == [("c", 32, 0, 12), ("d", 42, 0, 9)]
    step = next(e for e in later if e[0] == "step")
    assert [(r.session, r.pos, r.rows, r.anchor) for r in step[1]] == [("b", 21, 2, 4)]
    assert _flat_rows(step[2]) == [5, 6]  # b's rows at positions 21, 22 (not in its taps)
    s = p.stats()
    assert s["predicted_commits"] == 3 and s["predicted_hits"] == 1 and s["predicted_misses"] == 2


def test_a_request_that_keeps_missing_its_prediction_is_not_predicted_every_step(early_proposer: Any) -> None:
    p = early_proposer
    c = p.client
    table = np.zeros((2, 64), dtype=np.int32)
    predicted: list[list[str]] = []
    for step in range(4):  # "a" always samples 1 where its raw argmax says 9 (a processor); "b" as predicted
        pos = [10 + step, 30 + step]
        ctx = _ctx(["a", "b"], [0, 1, 2], [0, 0], None, pos, table)  # type: ignore[arg-type]
        ctx.num_tokens_no_spec = np.array([11 + step, 31 + step], dtype=np.int32)
        ctx.draft_ids, ctx.raw_argmax = [[], []], [[9], [5]]
        p.on_scheduler_output(SimpleNamespace(finished_req_ids=(), preempted_req_ids=None, scheduled_cached_reqs=None))
        n = len(c.log)
        p.send_taps(ctx)
        predicted.append([r.session for kind, reqs, _ in c.log[n:] if kind == "predicted" for r in reqs])
        out = p.propose_remote(_ctx(["a", "b"], [0, 1, 2], [0, 0], [[1], [5]], pos, table))
        assert out[0][0] == 2 and out[1][0] == 1  # a: an ordinary commit; b: the predicted call's drafts
    assert predicted == [["a", "b"], ["a", "b"], ["b"], ["b"]], predicted  # a missed twice: not predicted
    assert c.exact == [True, True, False, False]  # a span with an unpredicted greedy request is not exact
    assert c.follows == [True] * 4  # b is predicted every step: its commit follows its taps
    assert p.stats()["predicted_misses"] == 2
