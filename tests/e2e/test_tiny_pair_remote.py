"""Issue 4, must-show 3: on the trained pair, acceptance through the server equals in process.

Four held-out prompts run side by side the way an engine runs them: every step is one Step
for all live requests (committed rows = anchor + accepted drafts, new anchor = the target's
correction/bonus token), sent to a draft server process serving the shipped drafter. The
per-prompt acceptance must equal ``tiny_pair.acceptance`` (the plain in-process harness) and
the mean must stay above 1.5.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from draft_tools.tiny_pair import pair as tp
from protocol import Status
from target_client import ClientConfig, DraftClient, StepRequest
from tests.conftest import ServerProc

pytest.importorskip("transformers")

NEW_TOKENS = 48


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


@pytest.mark.timeout(300)
def test_acceptance_through_server_equals_in_process():
    torch.set_num_threads(1)
    target = tp.load_target()
    draft = tp.load_draft(target=target)
    prompts = [p["ids"] for p in json.loads((tp.ASSET_DIR / "eval_prompts.json").read_text())[:4]]
    k = draft.c.block_size
    local = [tp.acceptance(target, draft, p, NEW_TOKENS, k).mean for p in prompts]

    srv = ServerProc(
        "--model",
        str(tp.DRAFT_DIR),
        "--target-model",
        str(tp.TARGET_DIR),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        drafter="dspark",
    ).start()
    client = DraftClient(ClientConfig(endpoint=srv.endpoint, budget_ms=30000.0, name="accept"))
    try:
        client.connect(wait=True)
        runs = []
        for i, p in enumerate(prompts):
            ids = tp.greedy_generate(target, torch.tensor([p]), NEW_TOKENS)
            taps, _ = tp.target_taps(target, ids, draft.c.target_layer_ids)
            runs.append(
                {"sid": f"p{i}", "seq": ids[0].tolist(), "taps": taps[0], "p": len(p), "sent": 0, "steps": 0, "acc": 0}
            )
        while True:
            live = [r for r in runs if r["p"] < len(r["seq"]) - 1]
            if not live:
                break
            reqs, rows = [], []
            for r in live:  # rows not yet sent: the prompt first, then anchor + accepted drafts
                reqs.append(StepRequest(r["sid"], r["sent"], r["p"] - r["sent"], r["seq"][r["p"]], k))
                rows.append(bf16_bits(r["taps"][r["sent"] : r["p"]]))
            replies = client.step(reqs, np.ascontiguousarray(np.concatenate(rows)))
            for r, rep in zip(live, replies, strict=True):
                assert rep.status == Status.OK, rep
                seq, p = r["seq"], r["p"]
                acc = 0
                while acc < k and p + 1 + acc < len(seq) and rep.tokens[acc] == seq[p + 1 + acc]:
                    acc += 1
                r["sent"] = p
                r["p"] = p + acc + 1
                r["steps"] += 1
                r["acc"] += acc + 1
        remote = [r["acc"] / r["steps"] for r in runs]
        client.free([r["sid"] for r in runs])
    finally:
        client.close()
        srv.kill()
    assert remote == pytest.approx(local, abs=1e-12), (remote, local)
    assert sum(remote) / len(remote) > 1.5
