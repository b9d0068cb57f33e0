"""The idle engine's spin (``idle_spin_ms``) around the next client due back, on a running engine thread:
two clients, each calling at its own cadence (a target between its forwards), staggered by half of it,
and one alone (its next call due after more than the engine's 50 ms idle wait).
Once their turnarounds are learnt, the engine is awake (polling unslept) just before each of their
calls lands and asleep through the middle of their gaps; its thread's CPU time stays well under the
wall time. Drafts are the checksum of each session's rows throughout. ``_spin_window`` itself: around
the first client due, and after the last batch when none is.
"""

from __future__ import annotations

import select as select_module
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from draft_server.drafters.checksum import ChecksumDrafter, expected_drafts
from draft_server.engine import scheduler
from draft_server.engine.scheduler import Engine, _Cadence
from draft_server.engine.types import Call, Work
from draft_server.metrics import ServerMetrics
from protocol import GREEDY, Status, StepResult

ROWS, K, ANCHOR = 3, 4, 7
GAP_S = 0.06  # each client's turnaround: its target's forward and sampling
SPIN_MS = 4.0


def _engine(drafter: ChecksumDrafter, reply: object, spin_ms: float) -> Engine:
    return Engine(
        drafter, ServerMetrics(), reply, "e", "c",  # type: ignore[arg-type]
        max_sessions=16, max_queue_rows=10_000, max_batch_rows=64, max_batch_sessions=16,
        prefill_chunk_rows=16, batch_window_ms=0.0, session_ttl_s=60.0, idle_spin_ms=spin_ms,
    )  # fmt: skip


def test_spin_window_is_around_the_first_client_due_and_after_the_batch_when_none_is() -> None:
    eng = _engine(ChecksumDrafter(), lambda *a: None, spin_ms=2.0)
    now = time.monotonic()
    eng._busy_t = now - 0.001
    assert eng._spin_window(now) == pytest.approx((now, now + 0.001), abs=1e-9)  # nobody due: after the batch
    eng._cadence[b"a"] = _Cadence(reply_t=now - 0.005, turn_s=0.010, awaiting=True, drafts=1)
    eng._cadence[b"b"] = _Cadence(reply_t=now - 0.001, turn_s=0.004, awaiting=True, drafts=1)
    eng._cadence[b"c"] = _Cadence(reply_t=now - 0.009, turn_s=0.001, awaiting=False, drafts=1)  # arrived
    lo, hi = eng._spin_window(now)
    assert abs(lo - (now + 0.001)) < 1e-9 and abs(hi - (now + 0.005)) < 1e-9  # b first: due at now + 3 ms
    eng._cadence[b"b"].reply_t = now - 0.1  # b overdue past its window (gone, or slow): a's is next
    lo, hi = eng._spin_window(now)
    assert abs(lo - (now + 0.003)) < 1e-9 and abs(hi - (now + 0.007)) < 1e-9
    eng._cadence[b"a"].reply_t = now - 0.1  # both overdue
    assert eng._spin_window(now) == pytest.approx((now, now + 0.001), abs=1e-9)


@pytest.mark.parametrize("clients", [2, 1])  # one client: its next call is due past the engine's 50 ms idle wait
def test_the_idle_engine_is_awake_when_each_client_comes_back_and_asleep_between(
    clients: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = ChecksumDrafter()
    replies: dict[tuple[bytes, int], StepResult] = {}
    got = threading.Condition()

    def reply(ident: bytes, res: StepResult, payloads: list) -> None:
        with got:
            replies[(ident, res.call_id)] = res
            got.notify_all()

    eng = _engine(d, reply, SPIN_MS)
    polls: list[float] = []  # when the engine polled without sleeping

    def select(r: list, w: list, x: list, timeout: float) -> tuple:
        if timeout == 0:
            polls.append(time.monotonic())
        return select_module.select(r, w, x, timeout)

    monkeypatch.setattr(scheduler, "select", SimpleNamespace(select=select, poll=select_module.poll))
    rng = np.random.default_rng(0)
    rows: dict[bytes, dict[int, bytes]] = {}
    arrivals: list[float] = []
    lock = threading.Lock()
    errors: list[str] = []

    def client(owner: bytes, offset: float, steps: int) -> None:
        time.sleep(offset)
        for i in range(steps):
            pos = i * ROWS
            t = rng.integers(0, 1 << 16, (ROWS, d.contract.tap_width), dtype=np.uint16)
            rows.setdefault(owner, {}).update({pos + j: t[j].tobytes() for j in range(ROWS)})
            now = time.monotonic()
            call = Call(owner, i + 1, now, now + 5.0, [None], remaining=1)
            assert eng.admission.try_admit_rows(owner, ROWS)
            with lock:
                arrivals.append(now)
            eng.submit([Work(call, 0, "s", pos, t, ANCHOR, K, GREEDY, pos + ROWS)])
            eng.wake()
            key = (owner, i + 1)
            with got:
                if not got.wait_for(lambda key=key: key in replies, 5.0):  # type: ignore[misc]
                    errors.append(f"{owner!r}: no reply to call {i + 1}")
                    return
                res = replies[key]
            r = res.results[0]
            if r.status != Status.OK or list(r.drafts) != expected_drafts(rows[owner], 0, pos + ROWS, ANCHOR, K,
                                                                          d.contract.vocab_size):  # fmt: skip
                errors.append(f"{owner!r} call {i + 1}: {r}")
            time.sleep(GAP_S)  # the target's forward: the next call comes a turnaround after the reply

    eng.start()
    clock = time.pthread_getcpuclockid(eng._thread.ident)  # type: ignore[arg-type]
    try:
        cpu0, wall0 = time.clock_gettime(clock), time.monotonic()
        who = ((b"a", 0.0), (b"b", GAP_S / 2))[:clients]
        threads = [threading.Thread(target=client, args=(o, off, 32 // clients)) for o, off in who]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        cpu, wall = time.clock_gettime(clock) - cpu0, time.monotonic() - wall0
    finally:
        eng.stop()
    assert not errors, errors
    assert len(arrivals) == 32
    learnt = sorted(arrivals)[8:]  # after the clients' first calls: turnarounds known
    spin_s = SPIN_MS / 1000.0
    awake = [t for t in learnt if any(t - spin_s <= p < t for p in polls)]
    # the clients' own sleeps overshoot on a busy box, so not every arrival lands in its window
    assert len(awake) >= 0.6 * len(learnt), (len(awake), len(learnt))
    # between the windows it sleeps: polls far from every arrival are few, and the thread is mostly idle
    far = [p for p in polls if p > learnt[0] and all(abs(p - t) > 2 * spin_s for t in arrivals)]
    assert len(far) <= 0.2 * len(polls), (len(far), len(polls))
    assert cpu < 0.5 * wall, (cpu, wall)
