"""Early taps whose commits follow at once (``Step.commit_follows``, predicted commits), on a running
engine thread: the engine waits for those commits instead of ingesting the rows alone, so rows and
drafts go in one batch (the commit folds into its taps); taps without the hint are ingested alone at
once, as before. Two clients, staggered; the wait ends at its bound when a commit never comes (counted)
and is never taken for taps whose client already sent its commits. The same with ``idle_spin_ms``,
where the engine polls through these waits unslept: a commit still ends the wait, a lost one still
holds the rows only to the bound. Drafts are the checksum of each session's rows throughout.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from draft_server.drafters.checksum import ChecksumDrafter, expected_drafts
from draft_server.engine.scheduler import Engine
from draft_server.engine.types import Call, Work
from draft_server.metrics import ServerMetrics
from protocol import GREEDY, Phase, Status, StepResult
from tests.conftest import check_on_time, time_marks, wait_for

ROWS, K, ANCHOR = 3, 4, 7


class Recording(ChecksumDrafter):
    """The checksum drafter, recording each batch as (owner-free) (rows ingested, drafts made)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[int, int]] = []

    def step(self, ingest, drafts):  # type: ignore[no-untyped-def, override]
        self.batches.append((sum(len(i.taps) for i in ingest), len(drafts)))
        return super().step(ingest, drafts)


class Harness:
    """An engine whose wait for commits ends at ``wait_s`` (the server's is 2 ms; the tests' commits come
    0.3 ms behind their taps, and the longer bound keeps a busy CI box from making that a timeout)."""

    def __init__(self, wait_s: float = 0.05, spin_ms: float = 0.0) -> None:
        self.d = Recording()
        self.metrics = ServerMetrics()
        self.replies: dict[tuple[bytes, int], StepResult] = {}
        self.got = threading.Condition()
        self.eng = Engine(
            self.d, self.metrics, self._reply, "e", "c",
            max_sessions=16, max_queue_rows=10_000, max_batch_rows=64, max_batch_sessions=16,
            prefill_chunk_rows=16, batch_window_ms=0.0, session_ttl_s=60.0, commit_wait_s=wait_s,
            idle_spin_ms=spin_ms,
        )  # fmt: skip
        self.wait_s = wait_s
        self.rows: dict[tuple[bytes, str], dict[int, bytes]] = {}
        self.rng = np.random.default_rng(0)

    def _reply(self, ident: bytes, res: StepResult, payloads: list) -> None:
        with self.got:
            self.replies[(ident, res.call_id)] = res
            self.got.notify_all()

    def reply(self, owner: bytes, call_id: int, timeout: float = 5.0) -> StepResult:
        with self.got:
            assert self.got.wait_for(lambda: (owner, call_id) in self.replies, timeout), f"no reply to {call_id}"
            return self.replies[(owner, call_id)]

    def taps(self, owner: bytes, call_id: int, sids: list[str], pos: int, follows: bool) -> None:
        now = time.monotonic()
        call = Call(owner, call_id, now, now + 5.0, [None] * len(sids), remaining=len(sids))
        call.commit_follows = follows
        works = []
        width = self.d.contract.tap_width
        for i, sid in enumerate(sids):
            t = self.rng.integers(0, 1 << 16, (ROWS, width), dtype=np.uint16)
            self.rows.setdefault((owner, sid), {}).update({pos + j: t[j].tobytes() for j in range(ROWS)})
            assert self.eng.admission.try_admit_rows(owner, ROWS)
            works.append(Work(call, i, sid, pos, t, 0, 0, GREEDY, pos + ROWS, phase=Phase.TAPS))
        self.eng.submit(works)
        self.eng.wake()

    def commit(self, owner: bytes, call_id: int, sids: list[str], pos: int, after: int) -> None:
        now = time.monotonic()
        call = Call(owner, call_id, now, now + 5.0, [None] * len(sids), remaining=len(sids))
        works = [
            Work(call, i, sid, pos, None, ANCHOR, K, GREEDY, pos, phase=Phase.COMMIT, after=after)
            for i, sid in enumerate(sids)
        ]
        self.eng.submit(works)
        self.eng.wake()

    def check_drafts(self, owner: bytes, call_id: int, sids: list[str], pos: int) -> None:
        res = self.reply(owner, call_id)
        vocab = self.d.contract.vocab_size
        for sid, r in zip(sids, res.results, strict=True):
            assert r.status == Status.OK, r
            assert list(r.drafts) == expected_drafts(self.rows[(owner, sid)], 0, pos, ANCHOR, K, vocab)


@pytest.mark.parametrize("spin_ms", [0.0, 20.0])
def test_taps_wait_for_the_commits_that_follow_and_go_in_one_batch_with_their_drafts(spin_ms: float) -> None:
    h = Harness(spin_ms=spin_ms)
    h.eng.start()
    try:
        a, b = b"predicting", b"plain"
        sa, sb = ["a0", "a1"], ["b0", "b1", "b2"]
        # step 1, both clients: a predicts (hint on), b commits after its sampling (no hint)
        h.taps(a, 1, sa, 0, follows=True)
        time.sleep(0.0003)  # a's step-building: its commit comes right behind its taps
        h.commit(a, 2, sa, ROWS, after=1)
        h.check_drafts(a, 2, sa, ROWS)
        h.taps(b, 1, sb, 0, follows=False)
        h.reply(b, 1)  # b's taps acknowledged at admission
        assert wait_for(lambda: len(h.d.batches) == 2)  # b samples; its taps are ingested alone meanwhile
        h.commit(b, 2, sb, ROWS, after=1)
        h.check_drafts(b, 2, sb, ROWS)
        # a's rows and drafts went in one batch; b's rows alone, then its drafts without rows
        assert h.d.batches == [(len(sa) * ROWS, len(sa)), (len(sb) * ROWS, 0), (0, len(sb))]
        # step 2, staggered the other way round: b's taps first, then a's with the hint
        h.taps(b, 3, sb, ROWS, follows=False)
        assert wait_for(lambda: len(h.d.batches) == 4)  # b's taps ingested alone before a's come
        h.taps(a, 3, sa, ROWS, follows=True)
        time.sleep(0.0003)
        h.commit(a, 4, sa, 2 * ROWS, after=3)
        h.check_drafts(a, 4, sa, 2 * ROWS)
        h.commit(b, 4, sb, 2 * ROWS, after=3)
        h.check_drafts(b, 4, sb, 2 * ROWS)
        assert h.d.batches[3:5] == [(len(sb) * ROWS, 0), (len(sa) * ROWS, len(sa))]
        assert h.metrics.commit_wait_timeouts._value.get() == 0
        h.metrics.later.flush()
        assert h.metrics.commit_wait._sum.get() > 0  # the waits were observed
    finally:
        h.eng.stop()


@pytest.mark.parametrize("spin_ms", [0.0, 20.0])
def test_a_commit_that_never_comes_holds_the_taps_only_to_the_bound_and_is_counted(spin_ms: float) -> None:
    h = Harness(spin_ms=spin_ms)
    h.eng.start()
    try:
        a, b = b"lost", b"other"
        sent = time.monotonic()
        marks = time_marks()
        h.taps(a, 1, ["a0", "a1"], 0, follows=True)  # its commit is lost
        time.sleep(0.0005)
        h.taps(b, 1, ["b0"], 0, follows=True)  # b's comes, late but within the bound
        time.sleep(0.0005)
        h.commit(b, 2, ["b0"], ROWS, after=1)
        h.check_drafts(b, 2, ["b0"], ROWS)
        deadline = time.monotonic() + 5.0
        while sum(r for r, _ in h.d.batches) < 3 * ROWS and time.monotonic() < deadline:
            time.sleep(0.001)
        assert time.monotonic() - sent >= h.wait_s  # a's rows waited for the bound, no longer than it
        check_on_time(marks, h.wait_s * 1000.0 + 20.0, "the wait for a lost commit")  # one bound, not two
        assert sum(r for r, _ in h.d.batches) == 3 * ROWS  # every row went in, none twice
        assert h.metrics.commit_wait_timeouts._value.get() == 1  # a's call, once
        # a's commit after all (its sampler disagreed, say): drafted from the rows it holds
        h.commit(a, 2, ["a0", "a1"], ROWS, after=1)
        h.check_drafts(a, 2, ["a0", "a1"], ROWS)
    finally:
        h.eng.stop()


def test_taps_of_a_client_whose_commits_came_already_are_not_held() -> None:
    h = Harness()
    h.eng.start()
    try:
        a = b"mixed"
        # one call of taps, the hint on: s0's commit is predicted and follows; s1's comes after sampling
        h.taps(a, 1, ["s0", "s1"], 0, follows=True)
        time.sleep(0.0003)
        h.commit(a, 2, ["s0"], ROWS, after=1)
        h.check_drafts(a, 2, ["s0"], ROWS)
        deadline = time.monotonic() + 5.0
        while len(h.d.batches) < 2 and time.monotonic() < deadline:
            time.sleep(0.0005)
        assert h.d.batches == [(ROWS, 1), (ROWS, 0)]  # s0 with its drafts; s1's rows next, not held
        assert h.metrics.commit_wait_timeouts._value.get() == 0
        h.commit(a, 3, ["s1"], ROWS, after=1)
        h.check_drafts(a, 3, ["s1"], ROWS)
    finally:
        h.eng.stop()
