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
