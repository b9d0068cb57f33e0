"""A server whose batch rows equal its prefill chunk still drafts, for two clients at once.

``--max-batch-rows 512`` with the default 512-row prefill chunk is a valid setting that left
decode work a budget of 0 rows: every short step waited forever and the server went silent (found
on the H200 by the CUDA IPC test's server flags). Here one client streams a long prompt (chunked
prefill) while another, arriving a little later, steps short rows: both are drafted, every step.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from prometheus_client import CollectorRegistry

from protocol import Status
from target_client import ClientConfig, DraftClient, StepRequest
from tests.conftest import ServerProc


def _client(endpoint: str, name: str) -> DraftClient:
    c = DraftClient(ClientConfig(endpoint=endpoint, budget_ms=5000.0, name=name, registry=CollectorRegistry()))
    c.connect(wait=True)
    return c


def test_decode_is_drafted_beside_a_chunked_prefill_when_batch_rows_equal_the_chunk() -> None:
    srv = ServerProc("--max-batch-rows", "512", "--prefill-chunk-rows", "512").start()
    long_c, short_c = _client(srv.endpoint, "long"), _client(srv.endpoint, "short")
    width = long_c.contract.tap_width
    got: dict[str, list] = {"long": [], "short": []}

    def long_prompts() -> None:
        for i in range(3):  # 1,500 rows each: three 512-row chunks interleaved with the other's steps
            reply = long_c.step([StepRequest(f"long{i}", 0, 1500, 7, 4)], np.ones((1500, width), np.uint16))
            got["long"].append(reply[0])

    def short_steps() -> None:
        time.sleep(0.02)  # staggered: arrives while the first prompt is being ingested
        for i in range(12):
            reply = short_c.step([StepRequest("short", 12 * i, 12, 5, 4)], np.ones((12, width), np.uint16))
            got["short"].append(reply[0])

    try:
        threads = [threading.Thread(target=long_prompts), threading.Thread(target=short_steps)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for name, n in (("long", 3), ("short", 12)):
            assert len(got[name]) == n
            assert all(r.status == Status.OK and len(r.tokens) == 4 for r in got[name]), (name, got[name])
    finally:
        long_c.close()
        short_c.close()
        srv.kill()
