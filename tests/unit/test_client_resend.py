"""Unit tests of the client's resend buffer (target_client.client.resend): pure logic, no sockets."""

from __future__ import annotations

import numpy as np

from target_client.client.resend import SessionRows, chunk_rows, cut_below, cut_from, keep_newest


def rows(start: int, n: int) -> np.ndarray:
    """Rows whose first column is their absolute position (easy to read back)."""
    a = np.zeros((n, 4), dtype=np.uint16)
    a[:, 0] = np.arange(start, start + n)
    return a


def positions(chunks) -> list[int]:
    out = []
    for pos, arr in chunks:
        assert list(arr[:, 0]) == list(range(pos, pos + len(arr))), "chunk rows must sit at their positions"
        out.extend(range(pos, pos + len(arr)))
    return out


def test_keep_newest_drops_oldest_rows_across_chunks() -> None:
    chunks = [(0, rows(0, 3)), (3, rows(3, 3)), (6, rows(6, 2))]
    kept, dropped = keep_newest(chunks, 4)
    assert positions(kept) == [4, 5, 6, 7] and dropped == 4
    kept, dropped = keep_newest(chunks, 100)
    assert kept is chunks and dropped == 0
    kept, dropped = keep_newest(chunks, 0)
    assert kept == [] and dropped == 8


def test_cut_helpers() -> None:
    chunks = [(10, rows(10, 4)), (14, rows(14, 2))]
    assert positions(cut_below(chunks, 12)) == [12, 13, 14, 15]
    assert cut_below(chunks, 16) == []
    kept, removed = cut_from(chunks, 13)
    assert positions(kept) == [10, 11, 12] and removed == 3


def test_take_contiguous_rollback_gap_and_limit() -> None:
    s = SessionRows(0.0)
    s.store([(0, rows(0, 4))], limit=64, call_id=1)
    prev, dropped = s.take(4, limit=64)  # contiguous: all 4 rows precede new rows at 4
    assert positions(prev) == [0, 1, 2, 3] and dropped == 0
    assert s.rows == 0 and s.call_id is None

    s.store([(0, rows(0, 4))], limit=64, call_id=2)
    prev, dropped = s.take(2, limit=64)  # rollback to 2: rows 2, 3 are superseded by the new rows
    assert positions(prev) == [0, 1] and dropped == 0

    s.store([(0, rows(0, 4))], limit=64, call_id=3)
    prev, dropped = s.take(9, limit=64)  # a gap: nothing to prepend, rows given up
    assert prev == [] and dropped == 4

    s.store([(0, rows(0, 10))], limit=64, call_id=4)
    prev, dropped = s.take(10, limit=3)
    assert positions(prev) == [7, 8, 9] and dropped == 7


def test_store_bounds_rows_and_ack_only_from_the_last_carrier() -> None:
    s = SessionRows(0.0)
    dropped = s.store([(0, rows(0, 5)), (5, rows(5, 5))], limit=6, call_id=7)
    assert dropped == 4 and positions(s.chunks) == [4, 5, 6, 7, 8, 9] and s.end == 10
    s.ack(6, 10)  # an older call's ack: the rows may have been rewritten since; ignored
    assert chunk_rows(s.chunks) == 6
    s.ack(7, 8)  # partial ack by the carrier
    assert positions(s.chunks) == [8, 9] and s.call_id == 7
    s.ack(7, 10)
    assert s.chunks == [] and s.call_id is None and s.end == -1


# ---------------------------------------------------------------- catching up after a burst


def test_a_burst_is_behind_only_after_a_miss_and_ends_on_a_prompt_ack_at_or_below_it() -> None:
    from target_client.client.resend import CATCH_UP_MAX_S

    s = SessionRows(0.0)
    assert not s.fell_behind(1.0)  # no burst sent: a miss is an ordinary miss
    s.sent_big(5, 0)  # call 5 carried rows from 0 the buffer cannot keep
    assert not s.catching_up(1.0)  # sent, not missed: the step waits as usual
    assert s.fell_behind(1.0) and s.catching_up(1.1)
    assert not s.fell_behind(1.2)  # already behind: the bound runs from the first miss
    s.acked(5, prompt=True, start=0)  # the burst's own ack says admitted, not ingested
    s.acked(6, prompt=False, start=0)  # a late ack: the server is not taking rows in time yet
    s.acked(7, prompt=True, start=300)  # a guess past the burst: rows still queued ahead of it
    assert s.catching_up(1.3)
    s.acked(8, prompt=True, start=0)  # prompt, holding the burst: the next step is a trial
    assert not s.catching_up(1.4) and s.big_call == 5
    assert s.fell_behind(1.5) and s.catching_up(1.5)  # the trial missed: behind again
    s.drafted(4, on_time=True)  # an older call's drafts prove nothing
    s.drafted(9, on_time=False)  # late drafts neither
    assert s.catching_up(1.6)
    s.drafted(9, on_time=True)
    assert s.big_call is None and not s.catching_up(1.7) and not s.fell_behind(1.8)
    s.sent_big(10, 100)
    assert s.fell_behind(2.0) and s.catching_up(2.0 + CATCH_UP_MAX_S - 0.01)
    assert not s.catching_up(2.0 + CATCH_UP_MAX_S) and s.big_call is None  # the bound: lost after all


def test_a_session_catching_up_sends_rows_ingest_only_resends_nothing_in_flight_and_is_answered_locally() -> None:
    from protocol import Phase, StepEntry
    from target_client.client.calls import StepCall
    from target_client.client.step_builder import CATCHING_UP, merge_rows

    sessions: dict[str, SessionRows] = {}
    burst = rows(0, 100)
    call = StepCall(
        (StepEntry("a", 0, 100, 7, 4), StepEntry("b", 0, 2, 7, 4)), np.concatenate([burst, rows(0, 2)]), 1.0, True
    )
    m = merge_rows(call, sessions, 0.0, 1, None, room=64, limit=64)
    assert [e.rows for e in m.entries] == [100, 2] and not m.local
    assert sessions["a"].big_call == 1 and sessions["b"].big_call is None  # only a's rows exceed the buffer
    assert sessions["a"].fell_behind(0.1) and not sessions["b"].fell_behind(0.1)
    # the next step: a's 3 new rows go alone (its buffered rows are on their way in call 1), k=0; b as usual
    call = StepCall(
        (StepEntry("a", 100, 3, 8, 4), StepEntry("b", 2, 1, 8, 4)),
        np.concatenate([rows(100, 3), rows(2, 1)]),
        1.0,
        True,
    )
    m = merge_rows(call, sessions, 0.2, 2, None, room=64, limit=64)
    assert [(e.session, e.pos, e.rows, e.k) for e in m.entries] == [("a", 100, 3, 0), ("b", 0, 3, 4)]
    assert m.behind == 1 and m.local[0].message == CATCHING_UP and m.local[0].tokens == [] and 1 not in m.local
    assert positions(sessions["a"].chunks) == list(range(39, 103)) and sessions["a"].call_id == 2  # the newest 64
    # a commit of a session catching up is not sent; an early taps span goes as a plain ingest-only entry
    call = StepCall((StepEntry("a", 103, 0, 9, 4, phase=Phase.COMMIT),), None, 1.0, True, phase=Phase.COMMIT)
    m = merge_rows(call, sessions, 0.3, 3, None, room=64, limit=64)
    assert m.entries == [] and m.behind == 1 and sessions["a"].call_id == 2
    call = StepCall((StepEntry("a", 103, 5, 0, 0, phase=Phase.TAPS),), rows(103, 5), 1.0, True, phase=Phase.TAPS)
    m = merge_rows(call, sessions, 0.4, 4, None, room=64, limit=64)
    assert [(e.pos, e.rows, e.k, e.phase) for e in m.entries] == [(103, 5, 0, Phase.WHOLE)]
    # rows that never left (the send failed) are resent even while catching up
    sessions["a"].unsent()
    call = StepCall((StepEntry("a", 108, 1, 9, 4),), rows(108, 1), 1.0, True)
    m = merge_rows(call, sessions, 0.5, 5, None, room=64, limit=64)
    assert [(e.pos, e.rows, e.k) for e in m.entries] == [(44, 65, 0)] and m.resent == 64


def test_early_taps_rows_given_up_unacknowledged_mark_entries_restart_until_a_context_starts_past_them() -> None:
    """Early taps: the server may hold a span's rejected rows past its commit. Rows the buffer gives
    up unacknowledged at or past such a position mark the session's entries ``restart`` (the server
    starts the session at their first row) until an OK names a context starting past them; rows
    given up below every superseded position (a prompt), or only carried by a call that is then
    acknowledged, mark nothing."""
    from protocol import Phase, StepEntry
    from target_client.client.calls import StepCall
    from target_client.client.step_builder import merge_rows

    sessions: dict[str, SessionRows] = {}
    in_flight: set[int] = set()

    def go(cid: int, e: StepEntry, new: np.ndarray | None, room: int = 64, limit: int = 64) -> StepEntry | None:
        call = StepCall((e,), new, 1.0, True, phase=e.phase)
        m = merge_rows(call, sessions, 0.0, cid, None, room, limit, in_flight.__contains__)
        if e.phase == Phase.TAPS:
            in_flight.add(cid)
        return m.entries[0] if m.entries else None

    def taps(cid: int, pos: int, n: int, **kw: int) -> StepEntry | None:
        return go(cid, StepEntry("s", pos, n, 0, 0, phase=Phase.TAPS), rows(pos, n), **kw)

    def commit(cid: int, pos: int, **kw: int) -> StepEntry | None:
        return go(cid, StepEntry("s", pos, 0, 5, 4, phase=Phase.COMMIT), None, **kw)

    s = sessions.setdefault("s", SessionRows(0.0))
    e = taps(1, 0, 10, limit=4)  # a prompt longer than the buffer: rows 0..5 only in call 1
    assert e is not None and not e.restart and s.unsure_call == 1
    assert commit(2, 10, limit=4).after == 1  # type: ignore[union-attr]
    s.resynced(1, 0)  # call 1's OK: its rows are held
    in_flight.discard(1)
    s.ack(1, 10)
    assert s.lost_end == -1 and s.unsure_call is None
    e = taps(3, 10, 5)  # span [10, 15), acknowledged; its commit (at 11) lost: the server keeps 11..14
    in_flight.discard(3)
    s.ack(3, 15)
    assert commit(4, 11).after == 0  # type: ignore[union-attr]
    assert s.tail_from == 11
    taps(5, 11, 5)  # span [11, 16), never acknowledged; 3 of it accepted
    assert commit(6, 14).after == 5  # type: ignore[union-attr]
    in_flight.discard(5)  # it failed: the next Taps resends rows 11..13, room for 1 of them only
    e = taps(7, 14, 5, room=1)
    assert e is not None and e.restart and (e.pos, e.rows) == (13, 6) and s.lost_end == 13
    e = taps(8, 15, 5)  # no OK since: still marked (the marked call 7 may be lost)
    assert e is not None and e.restart and e.pos == 13
    s.resynced(7, 10)  # an OK naming a context from 10: rows 11, 12 may still be in it
    assert s.lost_end == 13
    s.resynced(8, 13)  # the session restarted at 13
    assert s.lost_end == -1
    e = taps(9, 16, 5)
    assert e is not None and not e.restart and e.pos == 13


def test_a_commit_answered_ok_acknowledges_the_rows_of_the_taps_call_it_names() -> None:
    # the early Taps call 5 carried rows 10..14 of a 5-row span; its reply is lost (or late). Commit 6
    # names it (after=5) and is answered OK at end 13: the server drafted from every row below 13,
    # which that call brought, so they are acknowledged; 13 and 14 (rejected drafts) stay buffered
    from types import SimpleNamespace

    from protocol import EntryResult, Status
    from target_client.client.calls import Pending
    from target_client.client.io_loop import IoLoop

    def buffered(status: Status, after: int, carrier: int = 5) -> int:
        s = SessionRows(0.0)
        s.tapped = True
        s.store([(10, np.zeros((5, 4), np.uint16))], 64, carrier)
        p = Pending("step", 6, 1.0, 0.0, None, ("s",), (0,), (4,), None, 1, (after,))
        r = EntryResult(status, drafts=(1, 2, 3, 4) if status == Status.OK else (), end=13, start=0)
        IoLoop._ack(SimpleNamespace(sessions={"s": s}), p, (r,), 0.5)  # type: ignore[arg-type]
        return s.rows

    assert buffered(Status.OK, after=5) == 2  # 10..12 acknowledged by the commit
    assert buffered(Status.OK, after=0) == 5  # a commit naming no call: the Taps reply must come
    assert buffered(Status.EXPIRED, after=5) == 5  # not drafted: the rows were never shown held
    assert buffered(Status.OK, after=5, carrier=7) == 5  # a newer call carries them now: its reply acks
