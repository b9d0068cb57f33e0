"""Wire formats over real sockets (``protocol.wire``), against real server processes.

1. One tiny K3 DSpark server in float32 and three clients at once, one per format (bf16,
   projected, fp8), four sessions each, the same taps: projected drafts equal bf16 drafts token
   for token, fp8 drafts mostly do; all twelve sessions live in the server's batches together.
2. Refusals at Hello, one line naming both sides, drafting off, counted on both sides: fp8 asked
   of a server started with ``--wire-formats bf16,projected``; projected rows made with another
   checkpoint's projection.
3. The checksum drafter takes fp8 rows (digests over the bytes as sent) and refuses projected.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from draft_server.drafters.checksum import expected_drafts
from draft_server.models.tiny import make_tiny
from protocol import DType, Status
from target_client import ClientConfig, ContractMismatchError, DraftClient, StepRequest
from target_client.projection import Projection
from target_client.vllm.wire import WireEncoder
from tests.conftest import CHECKSUM_CONTRACT, ServerProc

FORMATS = ("bf16", "projected", "fp8")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str, str]:
    root = tmp_path_factory.mktemp("wire")
    p = make_tiny("k3", str(root / "k3"), seed=5)
    other = make_tiny("k3", str(root / "other"), seed=6)
    return p.draft, p.target, other.draft


def _dspark(tiny: tuple[str, str, str], *extra: str) -> ServerProc:
    draft, target, _ = tiny
    args = ("--model", draft, "--target-model", target, "--device", "cpu", "--dtype", "float32", *extra)
    return ServerProc(*args, "--kv-budget-mib", "32", drafter="dspark").start()


def _client(srv: ServerProc, fmt: str, proj: Projection | None = None, **kw) -> DraftClient:
    return DraftClient(
        ClientConfig(
            endpoint=srv.endpoint,
            budget_ms=30000.0,
            name=f"wire-{fmt}",
            wire_format=fmt,
            projection_id=proj.id if proj is not None else "",
            **kw,
        )
    )


@pytest.mark.timeout(240)
def test_three_formats_at_once_projected_equals_bf16(tiny) -> None:
    srv = _dspark(tiny)
    proj = Projection.load(tiny[0])
    clients = {f: _client(srv, f, proj) for f in FORMATS}
    enc = {f: WireEncoder(f, proj) for f in FORMATS}
    try:
        for f, c in clients.items():
            w = c.connect(wait=True)
            assert w is not None and set(w.wire.formats) == set(FORMATS) and w.wire.projection_id == proj.id
            # the Welcome says what the weights are: the tiny checkpoint is dense float32
            assert (w.weights.format, w.weights.bits) == ("dense", 32.0) and w.weights.nbytes > 0
            assert c.row_layout == (
                {"bf16": (DType.BF16, w.contract.tap_width), "fp8": (DType.U8, w.contract.tap_width + 4)}.get(f)
                or (DType.F32, w.wire.projected_width)
            )
        contract = clients["bf16"].contract
        assert contract is not None
        W, k = contract.tap_width, contract.block_size
        g = torch.Generator().manual_seed(3)
        ends = dict.fromkeys(range(4), 0)
        same_tokens = total = 0
        with ThreadPoolExecutor(3) as pool:
            for step in range(6):
                reqs, parts = [], []
                for s in ends:
                    rows = 12 + 5 * s if step == 0 else 1 + (s + step) % 3
                    reqs.append(StepRequest(f"s{s}", ends[s], rows, 7 + s, k))
                    parts.append(torch.randn(rows, W, generator=g) * 2)
                    ends[s] += rows
                taps = torch.cat(parts)
                futs = {
                    f: pool.submit(c.step, reqs, enc[f](taps, DType.F32))  # the Welcome's projected dtype: f32
                    for f, c in clients.items()
                }
                out = {f: fut.result() for f, fut in futs.items()}
                for f in FORMATS:
                    assert all(r.status == Status.OK for r in out[f]), (f, [r.message for r in out[f]])
                for b, p, q in zip(out["bf16"], out["projected"], out["fp8"], strict=True):
                    assert len(b.tokens) == k and p.tokens == b.tokens
                    same_tokens += sum(x == y for x, y in zip(q.tokens, b.tokens, strict=True))
                    total += k
        print(f"fp8 drafts agree with bf16 on {same_tokens}/{total} tokens")
        assert same_tokens >= 0.75 * total, f"fp8 agreed on {same_tokens}/{total} draft tokens"
        met = srv.metrics()
        assert met["draft_server_sessions"] == 12
        assert not any(k.startswith("draft_server_bad_messages_total{") and v for k, v in met.items())
    finally:
        for c in clients.values():
            c.close()
        srv.kill()


@pytest.mark.timeout(240)
def test_refused_at_hello_with_one_line(tiny) -> None:
    srv = _dspark(tiny, "--wire-formats", "bf16,projected")
    reg = CollectorRegistry()
    fp8 = _client(srv, "fp8", registry=reg)
    stranger = _client(srv, "projected", Projection.load(tiny[2]), registry=reg)
    try:
        with pytest.raises(ContractMismatchError) as e:
            fp8.connect(wait=True)
        msg = str(e.value)
        assert "\n" not in msg and e.value.fields == ("wire_format",)
        assert msg.endswith("wire format 'fp8' refused: server accepts bf16, projected"), msg
        with pytest.raises(ContractMismatchError) as e:
            stranger.connect(wait=True)
        msg = str(e.value)
        ours, theirs = Projection.load(tiny[2]).id, Projection.load(tiny[0]).id
        assert "\n" not in msg and "wire format 'projected' refused" in msg and ours in msg and theirs in msg, msg
        for c in (fp8, stranger):
            assert c.gate == "breaker_open" and c.stats()["wire_format_refusals"] >= 1
            reply = c.step([StepRequest("s", 0, 0, 1, 2)], None)
            assert reply[0].tokens == [] and reply[0].status is None  # drafting stays off
        assert reg.get_sample_value("draft_client_handshake_refusals_total", {"reason": "wire_format"}) >= 2
        assert srv.metrics()['draft_server_bad_messages_total{code="wire_format"}'] >= 2
        ok = _client(srv, "projected", Projection.load(tiny[0]))  # the right weights still get in
        try:
            assert ok.connect(wait=True) is not None and ok.gate is None
        finally:
            ok.close()
    finally:
        fp8.close()
        stranger.close()
        srv.kill()


def test_checksum_drafter_takes_fp8_rows_and_refuses_projected(server) -> None:
    fp8 = DraftClient(ClientConfig(endpoint=server.endpoint, budget_ms=5000.0, wire_format="fp8"))
    projected = DraftClient(ClientConfig(endpoint=server.endpoint, wire_format="projected", projection_id="x"))
    try:
        assert fp8.connect(wait=True).wire.formats == ("bf16", "fp8")  # type: ignore[union-attr]
        enc = WireEncoder("fp8")
        taps = torch.randn(7, CHECKSUM_CONTRACT.tap_width)
        rows = enc(taps)
        assert rows.shape == (7, CHECKSUM_CONTRACT.tap_width + 4) and rows.dtype == np.uint8
        r = fp8.step([StepRequest("a", 0, 4, 5, 3), StepRequest("b", 10, 3, 6, 3)], rows)
        v = CHECKSUM_CONTRACT.vocab_size
        assert r[0].tokens == expected_drafts({p: rows[p].tobytes() for p in range(4)}, 0, 4, 5, 3, v)
        assert r[1].tokens == expected_drafts({10 + p: rows[4 + p].tobytes() for p in range(3)}, 10, 13, 6, 3, v)
        with pytest.raises(ContractMismatchError, match="wire format 'projected' refused: server accepts bf16, fp8"):
            projected.connect(wait=True)
    finally:
        fp8.close()
        projected.close()


def test_a_server_restarted_without_the_format_is_refused_again(server) -> None:
    """fp8 steps to a server that restarts with --wire-formats bf16: the first Step is answered
    WIRE_FORMAT, the client handshakes again and is refused in the one line; drafting stays off."""
    c = DraftClient(ClientConfig(endpoint=server.endpoint, budget_ms=2000.0, wire_format="fp8"))
    try:
        c.connect(wait=True)
        rows = WireEncoder("fp8")(torch.randn(2, CHECKSUM_CONTRACT.tap_width))
        assert c.step([StepRequest("a", 0, 2, 5, 3)], rows)[0].status == Status.OK
        server.args += ["--wire-formats", "bf16"]
        server.restart()
        deadline = time.monotonic() + 20.0
        while not c.stats()["refused"] and time.monotonic() < deadline:
            c.step([StepRequest("a", 2, 0, 5, 3)], None)
            time.sleep(0.02)
        assert c.stats()["refused"].endswith("wire format 'fp8' refused: server accepts bf16")
        assert c.gate == "breaker_open" and c.stats()["wire_format_refusals"] >= 1
        assert server.metrics()['draft_server_bad_messages_total{code="wire_format"}'] >= 1
    finally:
        c.close()
