"""Drafts through the server over a real socket equal drafts of the same model in process.

Both variants, 16 concurrent sessions with staggered arrivals, appends, overwrites after a
rejected block and a gap restart; float64 on both sides so batching cannot flip a token.
"""

from __future__ import annotations

import numpy as np
import pytest

from draft_server.drafters.base import DraftItem, IngestItem
from draft_server.models import load_drafter
from draft_server.models.tiny import make_tiny
from protocol import GREEDY, Status
from target_client import ClientConfig, DraftClient, StepRequest
from tests.conftest import ServerProc


@pytest.mark.timeout(240)
@pytest.mark.parametrize("variant", ["qwen3", "k3"])
def test_remote_drafts_equal_in_process_drafts_16_sessions(tmp_path, variant):
    paths = make_tiny(variant, str(tmp_path / variant), seed=3)
    srv = ServerProc(
        "--model",
        paths.draft,
        "--target-model",
        paths.target,
        "--device",
        "cpu",
        "--dtype",
        "float64",
        drafter="dspark",
    ).start()
    local = load_drafter(paths.draft, paths.target, "cpu", "float64")
    contract = local.contract
    client = DraftClient(ClientConfig(endpoint=srv.endpoint, budget_ms=30000.0, name="eq", expect=contract))
    try:
        client.connect(wait=True)
        rng = np.random.default_rng(7)
        k = contract.block_size
        n = 16
        ends = [0] * n
        starts = [0] * n
        compared = 0
        for step in range(8):
            reqs, taps = [], []
            for i in range(n):
                if step < i // 4:  # staggered arrivals
                    continue
                if ends[i] == 0:
                    pos, rows = 0, int(rng.integers(5, 40))
                elif step == 5 and i % 3 == 0:  # overwrite after a rejected block
                    pos, rows = ends[i] - 2, 2
                elif step == 6 and i % 5 == 0:  # gap: the session restarts here
                    pos, rows = ends[i] + 10, 3
                else:
                    pos, rows = ends[i], int(rng.integers(1, k + 2))
                reqs.append(StepRequest(f"s{i}", pos, rows, int(rng.integers(0, contract.vocab_size)), k))
                taps.append(
                    (rng.standard_normal((rows, contract.tap_width)).astype(np.float32).view(np.uint32) >> 16).astype(
                        np.uint16
                    )
                )
            tap_arr = np.ascontiguousarray(np.concatenate(taps))
            replies = client.step(reqs, tap_arr)
            # the same operations, in process, one session at a time
            for r, t, rep in zip(reqs, taps, replies, strict=True):
                i = int(r.session[1:])
                if not (starts[i] <= r.pos <= ends[i]) or ends[i] == 0:
                    starts[i] = r.pos
                ends[i] = r.pos + r.rows
                assert local.reserve(i, starts[i], ends[i] + k)
                local.ingest([IngestItem(i, starts[i], r.pos, t)])
                want = local.draft([DraftItem(i, starts[i], ends[i], r.anchor, k, GREEDY)])[0].tokens
                assert rep.status == Status.OK, (step, r.session, rep.status, rep.message)
                assert rep.tokens == want, f"{variant} step {step} {r.session}: remote != local"
                compared += 1
        assert compared >= 100
    finally:
        client.close()
        srv.kill()
