"""Rows from ``PinnedRows`` through a real client and server (checksum drafter, subprocess).

The buffer is small, so its regions are reused every few steps; each step's source rows are
overwritten right after the call. A region handed out again while the client still holds its rows
(a frame in flight, rows kept for resend while the server is paused) would change what the server
ingests, and the checksum drafts would differ from ``expected_drafts`` over what was sent.
"""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import torch

from target_client import StepRequest
from target_client.vllm.wire import PinnedRows
from tests.conftest import random_taps, wait_for
from tests.integration.test_client_server import MISS_BUDGET, VOCAB, Context, check_step, make_client, timed_step

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def test_two_clients_through_small_pinned_buffers_keep_exact_drafts_across_a_pause(server) -> None:
    clients = [make_client(server.endpoint, f"pinned-{i}", breaker_backoff_ms=100.0) for i in range(2)]
    pools = [PinnedRows(8 * 1024, pin=False) for _ in clients]  # 5-16 steps of rows: reused all the time
    errors: list[str] = []
    served = [0, 0]
    paused = threading.Event()
    resumed = threading.Event()
    try:
        for c in clients:
            c.connect(wait=True)

        def engine(ci: int) -> None:
            client, pool = clients[ci], pools[ci]
            rng = np.random.default_rng(10 + ci)
            src = torch.empty(8, random_taps(rng, 1).shape[1], dtype=torch.bfloat16)  # the target's reused buffer
            ctx = {f"s{j}": Context() for j in range(2)}
            end = dict.fromkeys(ctx, 0)
            try:
                time.sleep(0.004 * ci)  # staggered arrivals
                for it in range(40):
                    if ci == 0 and it == 15:
                        paused.set()
                        resumed.wait(30)
                    rows = [int(rng.integers(1, 4)) for _ in ctx]
                    taps = random_taps(rng, sum(rows))
                    src[: len(taps)].view(torch.int16).copy_(torch.from_numpy(taps.view(np.int16)))
                    host = pool.host_rows(src[: len(taps)])
                    reqs = [
                        StepRequest(s, end[s], r, anchor=int(rng.integers(0, VOCAB)), k=4)
                        for s, r in zip(ctx, rows, strict=True)
                    ]
                    budget = MISS_BUDGET if paused.is_set() and not resumed.is_set() else None
                    out = timed_step(client, reqs, host, budget)
                    del host  # only the client holds the rows now
                    src.fill_(float("nan"))  # the target reuses its buffer at once
                    answered, wrong = check_step(ctx, end, reqs, taps, out)
                    served[ci] += answered
                    errors.extend(f"client {ci} step {it} {w}" for w in wrong)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(f"client {ci}: {exc!r}")

        threads = [threading.Thread(target=engine, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        assert paused.wait(60), errors[:5]
        server.pause()  # SIGSTOP: client 1's steps miss, their rows stay buffered in its pool's regions
        try:
            assert wait_for(lambda: clients[1].stats()["timeouts"] >= 2, timeout=30.0)
        finally:
            server.resume()
            resumed.set()
        for t in threads:
            t.join(90)
        assert not errors, errors[:5]
        assert min(served) > 30, served  # of 80 requests each: most are drafted, and checked
        assert clients[1].stats()["resent_rows"] > 0  # the rows held through the pause went again
        for pool in pools:
            # >= 2 rows of 256 bytes a step: the buffer went round at least twice
            assert pool.taken + pool.fallbacks == 40 and pool.taken >= 32, (pool.taken, pool.fallbacks)
    finally:
        for c in clients:
            c.close()
    gc.collect()
    assert all(wait_for(lambda p=p: p.free_bytes == p.size, timeout=10.0) for p in pools)  # nothing leaked
