"""Transport "cuda_ipc" on a real GPU: this test process is the target engine with its taps on GPU 0,
a ``draft-server`` subprocess serves the shipped tiny drafter on the same GPU and, when two are
visible, on GPU 1 too (every test runs once per server GPU: the deployment of issue 18, the copy
then a peer copy). Skipped without CUDA. About a minute per server GPU on an H200 (three server
starts):

1. Drafts through cuda_ipc equal drafts through tcp exactly, at 1 and 3 sessions per step (the same
   steps, one after the other, so the batches are the same), every step through the buffer.
2. The producer killed (kill -9) while the server holds its import: another client keeps drafting
   every step, the server releases the import within a few seconds (its pid is gone), the GPU's free
   memory returns to the baseline (the producer's 512 MiB buffer is gone) and so does the memory
   the server's tensors hold.
3. The server killed and restarted while the producer's buffer lives: the client names the same
   buffer anew, the new server imports it, and drafting comes back within 2 steps of the first
   step the new server answers; the client made no second buffer.

    .venv/bin/pytest -q tests/gpu_cuda_ipc
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("transport cuda_ipc needs a CUDA GPU", allow_module_level=True)

from prometheus_client import CollectorRegistry  # noqa: E402

from target_client import ClientConfig, DraftClient, StepRequest  # noqa: E402
from tests.conftest import ROOT, ServerProc, wait_for  # noqa: E402

ASSETS = os.path.join(ROOT, "draft_tools", "tiny_pair", "assets")
SERVER_ARGS = (
    "--model",
    os.path.join(ASSETS, "draft"),
    "--target-model",
    os.path.join(ASSETS, "target"),
    "--dtype",
    "float32",
    "--max-batch-sessions",
    "8",
    "--max-batch-rows",
    "512",
    "--wire-formats",
    "bf16",
    "--session-ttl-s",
    "600",
)
MIB = 1 << 20


SERVER_GPUS = [0, 1] if torch.cuda.device_count() >= 2 else [0]  # the producer (this process) is on GPU 0


def tiny_server(gpu: int) -> ServerProc:
    return ServerProc(*SERVER_ARGS, "--device", f"cuda:{gpu}", drafter="dspark").start(timeout=180)


@pytest.fixture(scope="module", params=SERVER_GPUS, ids=lambda g: f"server-gpu{g}")
def server(request: pytest.FixtureRequest) -> Iterator[ServerProc]:
    srv = tiny_server(request.param)
    yield srv
    srv.kill()


def client(endpoint: str, transport: str, reg: CollectorRegistry, **kw) -> DraftClient:
    kw.setdefault("budget_ms", 5000.0)
    c = DraftClient(ClientConfig(endpoint=endpoint, transport=transport, registry=reg, **kw))
    c.connect(wait=True)
    return c


def run(c: DraftClient, prefix: str, sessions: int, steps: int, host: bool) -> list[list[tuple]]:
    """``steps`` steps of ``sessions`` sessions (a 12-row prefill, then 3 rows per step), the same
    taps and anchors whatever the transport: device rows (cuda_ipc) or their host copy (tcp)."""
    contract = c.contract
    assert contract is not None
    w, k = contract.tap_width, contract.block_size
    gen = torch.Generator(device="cuda").manual_seed(1234)
    anchors = np.random.default_rng(5)
    out = []
    for step in range(steps):
        rows = 12 if step == 0 else 3
        pos = 0 if step == 0 else 12 + 3 * (step - 1)
        reqs = [
            StepRequest(f"{prefix}{s}", pos, rows, int(anchors.integers(0, contract.vocab_size)), k)
            for s in range(sessions)
        ]
        taps = torch.randn(rows * sessions, w, generator=gen, device="cuda").to(torch.bfloat16)
        if host:
            taps = taps.view(torch.int16).cpu().numpy().view(np.uint16)
        replies = c.step(reqs, taps)
        out.append([(r.status, tuple(r.tokens), r.start) for r in replies])
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sessions", [1, 3])
def test_drafts_through_cuda_ipc_equal_drafts_through_tcp(server: ServerProc, sessions: int) -> None:
    reg = CollectorRegistry()
    tcp = client(server.endpoint, "frames", reg, name="tcp")
    ipc = client(server.endpoint, "cuda_ipc", reg, name="cuda-ipc")
    try:
        assert "cuda_ipc" in ipc.welcome.transports  # type: ignore[union-attr]
        want = run(tcp, f"tcp{sessions}-", sessions, 8, host=True)
        got = run(ipc, f"ipc{sessions}-", sessions, 8, host=False)
        assert all(r[1] for step in want for r in step), "tcp steps without drafts"
        assert got == want
        assert reg.get_sample_value("draft_client_cuda_ipc_steps_total") == 8
        assert reg.get_sample_value("draft_client_cuda_ipc_fallbacks_total", {"reason": "buffer_full"}) == 0
        assert server.metrics()["draft_server_cuda_ipc_buffers"] >= 1
    finally:
        tcp.close()
        ipc.close()


PRODUCER = """
import sys, torch
from target_client import ClientConfig, DraftClient, StepRequest
c = DraftClient(ClientConfig(endpoint=sys.argv[1], transport="cuda_ipc", cuda_ipc_mib=int(sys.argv[2]), budget_ms=2000))
w = c.connect(wait=True).contract.tap_width
for i in range(10**9):
    taps = torch.randn(4 * 3, w, device="cuda").to(torch.bfloat16)
    r = c.step([StepRequest(f"p{j}", 3 * i, 3, 1, 2) for j in range(4)], taps)
    if i == 20:
        print("STEPPING", flush=True)
"""


@pytest.mark.timeout(300)
def test_a_producer_killed_while_the_server_holds_its_import(server: ServerProc) -> None:
    reg = CollectorRegistry()
    other = client(server.endpoint, "cuda_ipc", reg, name="other", budget_ms=2000.0)
    try:
        steps = iter(range(10**6))

        def step_other() -> None:  # every step of the other client drafts, whatever happens beside it
            i = next(steps)
            taps = torch.randn(2 * 3, other.contract.tap_width, device="cuda").to(torch.bfloat16)  # type: ignore[union-attr]
            replies = other.step([StepRequest(f"o{j}", 3 * i, 3, 1, 2) for j in range(2)], taps)
            assert all(r.tokens for r in replies), [(r.status, r.message) for r in replies]

        for _ in range(5):
            step_other()
        torch.cuda.synchronize()
        met = server.metrics()
        base_free, base_alloc = torch.cuda.mem_get_info(0)[0], met["draft_server_gpu_memory_allocated_bytes"]
        base_buffers = met["draft_server_cuda_ipc_buffers"]
        p = subprocess.Popen(
            [sys.executable, "-c", PRODUCER, server.endpoint, "512"], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "STEPPING"
            assert server.metrics()["draft_server_cuda_ipc_buffers"] == base_buffers + 1
            assert torch.cuda.mem_get_info(0)[0] < base_free - 512 * MIB  # its buffer (and context) on GPU 0
            step_other()
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
        t0 = time.monotonic()

        def released() -> bool:
            step_other()
            met = server.metrics()
            return (
                met["draft_server_cuda_ipc_buffers"] == base_buffers
                and torch.cuda.mem_get_info(0)[0] >= base_free - 64 * MIB
                and abs(met["draft_server_gpu_memory_allocated_bytes"] - base_alloc) <= 16 * MIB
            )

        assert wait_for(released, 10.0), (
            f"after 10 s: {server.metrics()['draft_server_cuda_ipc_buffers']} buffers (baseline {base_buffers}), "
            f"{(base_free - torch.cuda.mem_get_info(0)[0]) / MIB:.0f} MiB below the free baseline"
        )
        took = time.monotonic() - t0
        assert took < 5.0, f"released after {took:.1f} s"
        for _ in range(10):
            step_other()
        assert server.proc is not None and server.proc.poll() is None
    finally:
        other.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("gpu", SERVER_GPUS, ids=lambda g: f"server-gpu{g}")
def test_a_server_restart_while_the_buffer_lives(gpu: int) -> None:
    srv = tiny_server(gpu)
    reg = CollectorRegistry()
    c = client(srv.endpoint, "cuda_ipc", reg, name="restart", budget_ms=500.0)
    w = c.contract.tap_width  # type: ignore[union-attr]
    pos = 0

    def step() -> bool:
        nonlocal pos
        taps = torch.randn(2 * 3, w, device="cuda").to(torch.bfloat16)
        replies = c.step([StepRequest(f"r{j}", pos, 3, 1, 2) for j in range(2)], taps)
        pos += 3
        time.sleep(0.05)  # an engine step
        return all(r.tokens for r in replies)

    try:
        assert all(step() for _ in range(10))
        ring = c._io.handshake.ring
        first, token = ring.name, ring.token  # type: ignore[union-attr]
        torch.cuda.synchronize()
        alloc = torch.cuda.memory_allocated()
        srv.kill()  # SIGKILL mid-traffic
        for _ in range(2):  # (few: five misses in a row would open the breaker)
            assert not step()  # no server: empty drafts within the budget
        srv.start(timeout=180)
        answered = drafted = None
        for i in range(40):
            ok = step()
            if answered is None and c.epoch == srv.epoch:
                answered = i  # the first step the new server answered (it did not know the buffer)
            if ok:
                drafted = i
                break
        assert answered is not None and drafted is not None, (answered, drafted, c.stats())
        assert drafted - answered <= 2, f"drafting back {drafted - answered} steps after the new server answered"
        ring = c._io.handshake.ring
        assert ring.token == token and ring.name != first  # type: ignore[union-attr]  # the same memory, named anew
        before = reg.get_sample_value("draft_client_cuda_ipc_steps_total")
        assert all(step() for _ in range(5))
        assert reg.get_sample_value("draft_client_cuda_ipc_steps_total") >= before + 5
        assert srv.metrics()["draft_server_cuda_ipc_buffers"] == 1
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - alloc < 8 * MIB  # no second buffer in the client
    finally:
        c.close()
        srv.kill()
