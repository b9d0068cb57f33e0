"""``ClientConfig.wait_spin_ms``: a caller waiting in ``step()`` sleeps until its reply is due (its
previous wait's length) less the spin, then polls without sleeping for at most twice the spin.

Two clients, staggered, against a server whose drafts take 15 ms: every draft exact, each caller's
CPU per step shows that it spun (more than a sleeping caller's) but slept through most of the
wait (far less than the wait itself, which a spin from the start would cost). Then the server is
paused: a spinning caller still gives up at its deadline, having slept through most of it, and
drafts exactly again once the server resumes."""

from __future__ import annotations

import time

import numpy as np
import pytest

from draft_server.drafters.checksum import expected_drafts
from target_client import ClientConfig, DraftClient, StepRequest
from tests.conftest import CHECKSUM_CONTRACT, ServerProc, run_all

pytestmark = pytest.mark.timeout(180)

W, VOCAB, K = CHECKSUM_CONTRACT.tap_width, CHECKSUM_CONTRACT.vocab_size, 4
DELAY_MS, SPIN_MS = 15.0, 2.0


class Session:
    def __init__(self, client: DraftClient, sid: str, seed: int) -> None:
        self.c, self.sid = client, sid
        self.rng = np.random.default_rng(seed)
        self.rows: dict[int, bytes] = {}
        self.pending: list[tuple[int, np.ndarray]] = []  # rows sent in a step that got no drafts

    def step(self) -> tuple[list[int], list[int]]:
        """One step of 3 new rows; (drafts, the drafts the server owes if it has every row)."""
        pos = len(self.rows)
        taps = self.rng.integers(0, 1 << 15, (3, W), dtype=np.uint16)
        (r,) = self.c.step([StepRequest(self.sid, pos, 3, 7, K)], taps)
        for j in range(3):
            self.rows[pos + j] = taps[j].tobytes()
        return r.tokens, expected_drafts(self.rows, 0, len(self.rows), 7, K, VOCAB)


def test_a_spinning_caller_drafts_exactly_spins_only_near_its_reply_and_gives_up_on_time() -> None:
    srv = ServerProc("--checksum-delay-ms", str(DELAY_MS)).start()
    cpu: dict[str, float] = {}

    def run(i: int, spin_ms: float) -> None:
        cfg = ClientConfig(endpoint=srv.endpoint, budget_ms=2000.0, name=f"spin-{i}", wait_spin_ms=spin_ms)
        c = DraftClient(cfg)
        c.connect(wait=True)
        s = Session(c, f"s{i}", i)
        time.sleep(0.005 * i)  # staggered
        try:
            for _ in range(3):  # the first waits are not yet predicted
                got, want = s.step()
                assert got == want
            t0 = time.thread_time()
            steps = 25
            for step in range(steps):
                got, want = s.step()
                assert got == want, step
            cpu[f"{i}:{spin_ms}"] = (time.thread_time() - t0) / steps * 1000.0
        finally:
            c.close()

    try:
        errors = run_all(run, [(0, SPIN_MS), (1, SPIN_MS), (2, 0.0)])
        assert not errors, errors
        for i in (0, 1):
            ms = cpu[f"{i}:{SPIN_MS}"]
            # spun: over the sleeping caller's CPU and most of a millisecond; slept: well under the wait
            assert ms > max(0.6, cpu[f"2:{0.0}"] + 0.3), cpu
            assert ms < 0.5 * DELAY_MS, cpu

        # the server stops answering: the spinning caller returns at its deadline, mostly asleep
        c = DraftClient(ClientConfig(endpoint=srv.endpoint, budget_ms=100.0, name="spin-pause", wait_spin_ms=SPIN_MS))
        c.connect(wait=True)
        s = Session(c, "p", 7)
        for _ in range(4):
            got, want = s.step()
            assert got == want
        srv.pause()
        try:
            t0, c0 = time.monotonic(), time.thread_time()
            got, _ = s.step()
            waited, spent = time.monotonic() - t0, time.thread_time() - c0
            assert got == []
            assert 0.09 <= waited < 0.5, waited
            assert spent < 0.5 * waited, (spent, waited)
        finally:
            srv.resume()
        deadline = time.monotonic() + 30.0
        while True:  # drafting comes back (the breaker may take a probe or two)
            got, want = s.step()
            if got:
                assert got == want
                break
            assert time.monotonic() < deadline, "no drafts after the server resumed"
        c.close()
    finally:
        srv.kill()


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "2"])
def test_wait_spin_ms_must_be_a_finite_number_at_least_zero(bad: object) -> None:
    with pytest.raises(ValueError, match="wait_spin_ms"):
        ClientConfig(endpoint="tcp://127.0.0.1:1", wait_spin_ms=bad)  # type: ignore[arg-type]
