"""The engine's session table and admission: one LRU, eviction only of idle sessions, never the
session that needs the room, and the queued-row counter that never goes negative."""

from __future__ import annotations

import numpy as np

from draft_server.drafters.checksum import ChecksumDrafter
from draft_server.engine.admission import Admission
from draft_server.engine.sessions import SessionTable
from draft_server.engine.types import Call, Work
from draft_server.metrics import ServerMetrics
from protocol import GREEDY, Status


def _table(capacity: int, max_sessions: int = 16) -> tuple[ChecksumDrafter, SessionTable, Admission]:
    d = ChecksumDrafter(capacity_tokens=capacity)
    m = ServerMetrics()
    t = SessionTable(d, m, max_sessions=max_sessions, ttl_s=60.0)
    return d, t, Admission(d, t, m, max_queue_rows=100, max_batch_rows=64)


def _work(sid: str) -> Work:
    call = Call(b"c", 1, 0.0, 1.0, [None])
    return Work(call, 0, sid, 0, None, 0, 1, GREEDY, 0)


def test_room_is_made_by_evicting_idle_sessions_least_recently_used_first() -> None:
    d, t, adm = _table(capacity=120)
    a, b, c = (t.open((b"c", s)) for s in "abc")
    for s in (a, b, c):
        assert s is not None and adm.reserve(s, 0, 40)
    assert t.open((b"c", "a")) is a  # a is now the most recently used
    c.pending.append(_work("c"))  # c has queued work: never evicted
    new = t.open((b"c", "new"))  # one client: every session is its own
    assert new is not None
    assert adm.reserve(new, 0, 40)  # 40 more: one idle session must go, the oldest idle one (b)
    assert t.get((b"c", "b")) is None and t.get((b"c", "a")) is a and t.get((b"c", "c")) is c
    assert not adm.reserve(new, 0, 120)  # would need a and c gone; c is busy -> refused
    assert t.get((b"c", "c")) is c and d.used_tokens() <= d.capacity_tokens()


def test_session_cap_evicts_an_idle_session_or_refuses() -> None:
    _, t, _ = _table(capacity=1000, max_sessions=2)
    a, b = t.open((b"x", "a")), t.open((b"x", "b"))
    assert a is not None and b is not None
    a.pending.append(_work("a"))
    assert t.open((b"x", "c")) is not None and t.get((b"x", "b")) is None  # b was idle
    t.get((b"x", "c")).pending.append(_work("c"))  # type: ignore[union-attr]
    assert t.open((b"x", "d")) is None  # everything busy: no room, nothing evicted
    assert len(t) == 2


def test_queued_rows_are_admitted_up_to_the_cap_and_retired_once() -> None:
    _, _, adm = _table(capacity=1000)
    assert adm.try_admit_rows(b"a", 60) and adm.try_admit_rows(b"a", 40)
    assert not adm.try_admit_rows(b"a", 1)
    adm.retire_rows(b"a", 100)
    assert adm.queued_rows == 0 and adm.try_admit_rows(b"a", 100)
    r = adm.overloaded("queue full")
    assert r.status == Status.OVERLOADED and r.retry_after_ms >= 1.0


def test_kv_full_prefill_retires_its_rows_once() -> None:
    """A prefill that meets a full KV cache used to retire its rows twice (counter below zero)."""
    from draft_server.engine.scheduler import Engine

    d = ChecksumDrafter(capacity_tokens=8)
    replies: list = []
    eng = Engine(
        d, ServerMetrics(), lambda ident, msg, payloads: replies.append(msg), "e", "c",
        max_sessions=4, max_queue_rows=1000, max_batch_rows=64, max_batch_sessions=4,
        prefill_chunk_rows=16, batch_window_ms=0.0, session_ttl_s=60.0,
    )  # fmt: skip
    rows = np.zeros((40, d.contract.tap_width), np.uint16)
    assert eng.admission.try_admit_rows(b"c", 40)
    call = Call(b"c", 7, 0.0, 1e9, [None], remaining=1)
    eng.submit([Work(call, 0, "s", 0, rows, 1, 2, GREEDY, 40)])
    eng._drain_inbox()
    eng._iteration()
    assert eng.admission.queued_rows == 0
    assert replies and replies[0].results[0].status == Status.OVERLOADED


def test_a_client_within_its_share_keeps_its_sessions_when_another_floods() -> None:
    """Table full: a flooding client may only displace its own idle sessions; a client within
    its fair share never loses one; a client under its share may displace the flooder's."""
    _, t, _ = _table(capacity=10_000, max_sessions=8)
    calm = [t.open((b"calm", f"c{i}")) for i in range(2)]
    flood = [t.open((b"flood", f"f{i}")) for i in range(6)]
    assert all(calm) and all(flood) and len(t) == 8
    for i in range(6, 30):  # the flood keeps opening: it recycles its own idle sessions only
        assert t.open((b"flood", f"f{i}")) is not None
        assert all(t.get((b"calm", f"c{j}")) is calm[j] for j in range(2))
    assert t.client_sessions(b"calm") == 2 and t.client_sessions(b"flood") == 6
    for s in t:  # every flood session busy: the flood is refused, nothing of calm's goes
        if s.owner == b"flood":
            s.pending.append(_work(s.key[1]))
    assert t.open((b"flood", "more")) is None and t.client_sessions(b"calm") == 2
    # a third client under its share (8 // 3 = 2) may not take a busy session; once one is idle it may
    next(s for s in t if s.owner == b"flood").pending.clear()
    assert t.open((b"new", "n0")) is not None and t.client_sessions(b"flood") == 5


def test_a_row_flood_is_held_to_its_share_of_the_queue() -> None:
    _, _, adm = _table(capacity=1000)
    assert adm.try_admit_rows(b"flood", 90)  # alone: the whole queue
    assert not adm.try_admit_rows(b"calm", 20)  # total bound
    adm.retire_rows(b"flood", 60)
    assert adm.try_admit_rows(b"calm", 20)  # two clients: 50 each
    assert not adm.try_admit_rows(b"flood", 30)  # 30 + 30 > 50: the flood is over its share
    assert adm.try_admit_rows(b"calm", 30)


def test_one_steps_entries_are_admitted_in_order_as_one_at_a_time_would_be() -> None:
    _, _, adm = _table(capacity=1000)  # max_queue_rows=100
    assert adm.try_admit_rows(b"calm", 10)  # two clients: 50 rows each
    # flood's entries: 20 and 25 fit its share, 10 more would not, rowless entries always go, 5 still fits
    assert adm.admit_rows(b"flood", [20, 0, 25, 10, 0, 5]) == [True, True, True, False, True, True]
    assert adm.queued_rows == 60
    assert adm.admit_rows(b"flood", [1]) == [False]  # at its share exactly
    assert adm.admit_rows(b"calm", [40, 1]) == [True, False]  # the queue's bound: 100 in all
    adm.retire_rows(b"flood", 50)
    adm.retire_rows(b"calm", 50)
    assert adm.queued_rows == 0 and adm.admit_rows(b"flood", [0, 0]) == [True, True]
    assert adm.admit_rows(b"flood", [100, 1]) == [True, False]  # alone: the whole queue, no more


def test_advised_k_shrinks_as_the_queue_fills() -> None:
    _, _, adm = _table(capacity=1000)  # max_queue_rows=100
    assert adm.advised_k(5) == -1  # empty queue: no advice
    assert adm.try_admit_rows(b"a", 25)
    assert adm.advised_k(5) == -1  # a quarter full: still none
    assert adm.try_admit_rows(b"a", 15)
    assert adm.advised_k(5) == 4  # 40 %: 5 * 0.6 / 0.75
    assert adm.try_admit_rows(b"a", 60)
    assert adm.advised_k(5) == 0  # full: ingest only
    adm.retire_rows(b"a", 100)
    assert adm.advised_k(5) == -1


def test_early_taps_wait_for_a_batch_without_drafting() -> None:
    """A session with nothing but early taps queued is left out of a batch that drafts for others
    (its rows are not urgent yet) and ingested in the next, draft-free batch; a commit arriving for
    it folds into its taps and makes it urgent at once."""
    from draft_server.engine.scheduler import Engine
    from protocol import Phase

    class Recording(ChecksumDrafter):
        def __init__(self) -> None:
            super().__init__()
            self.batches: list[tuple[list[str], list[str]]] = []  # (sessions ingested, sessions drafted)

        def ingest(self, items: list) -> None:  # type: ignore[override]
            self.batches.append(([name(it.key) for it in items], []))
            super().ingest(items)

        def draft(self, items: list) -> list:  # type: ignore[override]
            self.batches[-1][1].extend(name(it.key) for it in items)
            return super().draft(items)

    def name(handle: int) -> str:
        return next(s.key[1] for s in eng.sessions if s.handle == handle)

    d = Recording()
    eng = Engine(
        d, ServerMetrics(), lambda ident, msg, payloads: None, "e", "c",
        max_sessions=8, max_queue_rows=1000, max_batch_rows=64, max_batch_sessions=8,
        prefill_chunk_rows=16, batch_window_ms=0.0, session_ttl_s=60.0,
    )  # fmt: skip
    W = d.contract.tap_width

    def work(sid: str, rows: int, k: int, phase: Phase, pos: int = 0) -> Work:
        call = Call(b"c", 1, 0.0, 1e9, [None], remaining=1)
        taps = np.ones((rows, W), np.uint16) if rows else None
        assert not rows or eng.admission.try_admit_rows(b"c", rows)
        return Work(call, 0, sid, pos, taps, 1, k, GREEDY, pos + rows, phase=phase)

    eng.submit([work("early", 3, 0, Phase.TAPS), work("drafting", 2, 3, Phase.WHOLE)])
    eng._drain_inbox()
    assert eng._iteration()
    assert d.batches[-1] == (["drafting"], ["drafting"])  # the early taps wait
    assert eng._iteration()
    assert d.batches[-1] == (["early"], [])  # and go in the next batch, which drafts nothing
    eng.submit([work("late", 3, 0, Phase.TAPS), work("other", 2, 3, Phase.WHOLE)])
    eng.submit([work("late", 0, 3, Phase.COMMIT, pos=2)])  # its commit: rows 0-1 accepted
    eng._drain_inbox()
    assert eng._iteration()
    ingested, drafted = d.batches[-1]
    assert sorted(ingested) == ["late", "other"] and sorted(drafted) == ["late", "other"]


def test_decode_runs_when_the_prefill_chunk_takes_the_whole_batch() -> None:
    """max_batch_rows == prefill_chunk_rows (a valid config) left decode a budget of 0 rows: a
    12-row step was never drafted and the server went silent. Decode entries now get the rows the
    prefill leaves, the first one always, beside a prefill chunk as well as alone."""
    from draft_server.engine.scheduler import Engine

    d = ChecksumDrafter()
    eng = Engine(
        d, ServerMetrics(), lambda ident, msg, payloads: None, "e", "c",
        max_sessions=8, max_queue_rows=10_000, max_batch_rows=16, max_batch_sessions=8,
        prefill_chunk_rows=16, batch_window_ms=0.0, session_ttl_s=60.0,
    )  # fmt: skip
    W = d.contract.tap_width

    def work(sid: str, rows: int, k: int) -> Work:
        call = Call(b"c", 1, 0.0, 1e9, [None], remaining=1)
        assert eng.admission.try_admit_rows(b"c", rows)
        return Work(call, 0, sid, 0, np.ones((rows, W), np.uint16), 1, k, GREEDY, rows)

    small, long = work("small", 12, 3), work("long", 40, 3)
    eng.submit([small])
    eng._drain_inbox()
    assert eng._iteration() and small.call.results[0] is not None and small.call.results[0].drafts
    second = work("second", 12, 3)
    eng.submit([long, second])
    eng._drain_inbox()
    assert eng._iteration()  # one decode entry beside the first prefill chunk
    assert second.call.results[0] is not None and second.call.results[0].drafts
