"""Transport "cuda_ipc" refused at Hello against a real server without CUDA, in one line, counted on both
sides (the transfers themselves need GPUs: ``tests/gpu_cuda_ipc``).

1. A server whose drafter runs on the CPU refuses a Hello announcing a CUDA IPC buffer with one
   TRANSPORT line saying why (``draft_server_bad_messages_total{code="transport"}``), and a Step
   naming a buffer it never imported with TRANSPORT (the client then says Hello again).
2. A client asking for cuda_ipc in a process without CUDA gets ``ContractMismatchError`` with one
   line naming the transport and why (``draft_client_handshake_refusals_total{reason="transport"}``;
   on a machine with CUDA: the server's line), drafting stays off; a client whose buffer could be
   made (faked here) gets the server's line.
"""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from protocol import Error, ErrorCode, Hello, RowsAt, Step, StepEntry, TensorSpec
from protocol.messages import DType
from target_client import ClientConfig, ContractMismatchError, DraftClient, StepRequest
from tests.conftest import CHECKSUM_CONTRACT, RawPeer, ServerProc
from tests.unit.test_cuda_ipc import FakeCudaRing, announce

NO_CUDA = (
    "transport 'cuda_ipc' refused: server accepts frames, shm "
    "(the server has no CUDA device: its drafter runs on the CPU)"
)


def cuda_here() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.timeout(120)
def test_a_server_without_cuda_refuses_in_one_line(monkeypatch) -> None:
    srv = ServerProc().start()
    peer = RawPeer(srv.endpoint)
    try:
        peer.send(Hello(protocol_version=1, client_name="raw", call_id=7, cuda_ipc=announce()))
        err = peer.recv()
        assert isinstance(err, Error) and err.call_id == 7 and err.code == ErrorCode.TRANSPORT
        assert err.message == NO_CUDA
        w = CHECKSUM_CONTRACT.tap_width
        at = RowsAt(announce().name, 0, 2 * w * 2, 1)
        peer.send(Step(8, 1000.0, (StepEntry("s", 0, 2, 1, 2),), TensorSpec(DType.BF16, (2, w), -1), rows_at=at))
        err = peer.recv()
        assert isinstance(err, Error) and err.code == ErrorCode.TRANSPORT and "send a Hello" in err.message
        assert srv.metrics()['draft_server_bad_messages_total{code="transport"}'] == 2

        reg = CollectorRegistry()
        c = DraftClient(ClientConfig(endpoint=srv.endpoint, transport="cuda_ipc", registry=reg))
        with pytest.raises(ContractMismatchError) as e:  # no CUDA here (else: the server's own line)
            c.connect(wait=True)
        msg = str(e.value)
        assert "\n" not in msg and e.value.fields == ("transport",), msg
        mine = "transport 'cuda_ipc' refused: this process has no CUDA device"
        assert mine in msg or (cuda_here() and msg.endswith(NO_CUDA)), msg
        with pytest.raises(ValueError, match="numpy array"):  # host rows only from a process without CUDA
            c.step([StepRequest("s", 0, 1, 1, 2)], [[0] * w])  # type: ignore[arg-type]
        assert c.step([StepRequest("s", 0, 1, 1, 2)], np.zeros((1, w), np.uint16))[0].tokens == []  # off
        c.close()
        assert reg.get_sample_value("draft_client_handshake_refusals_total", {"reason": "transport"}) >= 1

        import target_client.cuda.ipc as ipc  # a buffer that could be made: the server's own line comes back

        monkeypatch.setattr(ipc, "CudaRing", FakeCudaRing)
        c = DraftClient(ClientConfig(endpoint=srv.endpoint, transport="cuda_ipc", cuda_device=0, registry=reg))
        with pytest.raises(ContractMismatchError) as e:
            c.connect(wait=True)
        assert str(e.value).endswith(f"refused the handshake: {NO_CUDA}"), str(e.value)
        c.close()
        assert srv.metrics()['draft_server_bad_messages_total{code="transport"}'] >= 3
    finally:
        peer.close()
        srv.kill()
