"""``--idle-spin-ms``: the idle engine polls for work without sleeping around the next client due back
(for that long after its last batch when none is due). Two clients stepping with staggered idle gaps (a
target's forward) get exact drafts from a spinning server, and once the traffic stops the server goes
back to sleep: its CPU time over the next half second is a small share of it, where a spin that never
ended would take all of it."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from draft_server.drafters.checksum import expected_drafts
from target_client import ClientConfig, DraftClient, StepRequest
from tests.conftest import CHECKSUM_CONTRACT, ServerProc, run_all

pytestmark = pytest.mark.timeout(120)

W, VOCAB, K = CHECKSUM_CONTRACT.tap_width, CHECKSUM_CONTRACT.vocab_size, 4


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_spinning_server_drafts_exactly_and_sleeps_once_traffic_stops() -> None:
    srv = ServerProc("--idle-spin-ms", "30").start()

    def run(i: int) -> None:
        c = DraftClient(ClientConfig(endpoint=srv.endpoint, budget_ms=2000.0, name=f"spin-{i}"))
        c.connect(wait=True)
        rng = np.random.default_rng(i)
        rows: dict[int, bytes] = {}
        time.sleep(0.004 * i)  # staggered
        try:
            for step in range(40):
                pos = len(rows)
                taps = rng.integers(0, 1 << 15, (3, W), dtype=np.uint16)
                (r,) = c.step([StepRequest(f"s{i}", pos, 3, 7, K)], taps)
                for j in range(3):
                    rows[pos + j] = taps[j].tobytes()
                assert r.tokens == expected_drafts(rows, 0, len(rows), 7, K, VOCAB), step
                time.sleep(0.002 + 0.006 * (step % 3))  # the target's forward: the engine idles meanwhile
        finally:
            c.close()

    try:
        errors = run_all(run, [(0,), (1,)])
        assert not errors, errors
        assert srv.proc is not None
        time.sleep(0.2)  # past the spin after the last batch
        before, t0 = _cpu_s(srv.proc.pid), time.monotonic()
        time.sleep(0.5)
        share = (_cpu_s(srv.proc.pid) - before) / (time.monotonic() - t0)
        assert share < 0.3, f"the idle server used {share:.0%} of a core: still spinning"
    finally:
        srv.kill()
