"""Per-session bookkeeping of rows sent but not yet acknowledged (the resend buffer).

Owns ``SessionRows``: for one session, the contiguous rows the server has not confirmed, as
references (views, never copies) into the caller's earlier taps arrays, plus the call that last
carried them and the server's retry hint. Only the client's I/O thread touches these objects,
so there are no locks. The rules (DESIGN.md §4, positions make appends idempotent):

* an entry at ``pos`` first takes the buffered rows that end exactly at ``pos`` (rows at or
  after ``pos`` are superseded by the new rows; rows that leave a gap are dropped, since the
  server restarts the session at the first row it gets, which is legal);
* at most ``limit`` rows are kept per session, the oldest dropped first;
* an OK/EXPIRED result of the call that last carried the rows acknowledges rows below the
  server's reported ``end``; results of older calls are ignored (a later call may have
  overwritten those positions with different rows, e.g. after a rollback).

Rows given up in a session with early taps (``lost_end``). There the server also holds rows that
are not committed: a span's rejected drafts past its commit, until a later span or resend
overwrites them. An entry at ``pos`` tells the server that its rows below ``pos`` are right, which
only holds while every row this buffer gave up had been acknowledged. So when the buffer gives up
unacknowledged rows (the bound above, a step's resend room, a gap, a restarted server) at or past
the first position a sent row was superseded (``tail_from``: below it the server never held a
rejected row), the session's entries are marked ``restart`` (the server starts the session at
their first row, as after a gap) until an OK names a context that starts at or past the rows given
up (``resynced``).

Catching up (a burst larger than the budget: a prefill of many rows, K3 taps of 16 sessions x
256 rows = 294 MB in one step). An entry carrying more rows than the buffer keeps (``limit``)
leaves rows that only the server can hold: they are *unproven* (``big_pos``, ``big_call``) until
the session is drafted on time by that call or a later one (``drafted``). A step of the session
that misses its budget, or is answered EXPIRED, while they are unproven means the server is
still receiving or ingesting them and no draft for the session can come in time before it has:
the session is *behind* (``fell_behind``). While it is (``catching_up``), the I/O thread sends
the session's rows ingest-only and nobody waits for its drafts (``step_builder.merge_rows``):
one missed budget per burst instead of one per step until the server is through it, and every
committed row still goes out. Rows on their way are not sent again, so each entry relies on the
call before it arriving; with early taps it names that call (``after``), and unless that call's
rows reached the session last the server answers MISSING_ROWS (nothing applied: the rows below may
be an older span's rejected ones), which ends catching up (the next step resends from the buffer).
Otherwise it ends when a later call is acknowledged within its budget with a context start at or
below the burst (``acked``: the server is taking rows promptly again and holds the burst), and the
next step is then a trial that waits as usual: drafted on time, the burst is proven; missed or
EXPIRED, the session is behind again. A new server epoch ends it, and
so does ``CATCH_UP_MAX_S`` (the rows were lost after all, say with a reply the network dropped:
the session then drafts from what the server holds, as after any gap).
"""

from __future__ import annotations

import numpy as np

Chunk = tuple[int, np.ndarray]  # (absolute position of row 0, rows [n, tap_width])
_NEVER = 1 << 62  # SessionRows.tail_from before any sent row was superseded

# The longest a session stays behind without the server showing that it holds its burst (see the
# module docstring). A K3 burst of 64 sessions x 256 rows is 1.2 GB: about 0.5 s over loopback.
CATCH_UP_MAX_S = 5.0


def chunk_rows(chunks: list[Chunk]) -> int:
    if len(chunks) == 1:
        return len(chunks[0][1])
    return sum(len(a) for _, a in chunks)


def keep_newest(chunks: list[Chunk], limit: int) -> tuple[list[Chunk], int]:
    """The newest ``limit`` rows of contiguous ``chunks``, and how many rows were dropped."""
    if len(chunks) == 1 and len(chunks[0][1]) <= limit:  # the common case: one chunk that fits
        return chunks, 0
    total = chunk_rows(chunks)
    drop = total - limit
    if drop <= 0:
        return chunks, 0
    out: list[Chunk] = []
    skip = drop
    for pos, arr in chunks:
        if skip >= len(arr):
            skip -= len(arr)
            continue
        out.append((pos + skip, arr[skip:]) if skip else (pos, arr))
        skip = 0
    return out, drop


def cut_below(chunks: list[Chunk], end: int) -> list[Chunk]:
    """Chunks without the rows at positions < ``end``."""
    out: list[Chunk] = []
    for pos, arr in chunks:
        if pos + len(arr) <= end:
            continue
        out.append((end, arr[end - pos :]) if pos < end else (pos, arr))
    return out


def cut_from(chunks: list[Chunk], pos: int) -> tuple[list[Chunk], int]:
    """Chunks without the rows at positions >= ``pos``, and how many rows that removed."""
    out: list[Chunk] = []
    removed = 0
    for p, arr in chunks:
        if p >= pos:
            removed += len(arr)
        elif p + len(arr) > pos:
            out.append((p, arr[: pos - p]))
            removed += p + len(arr) - pos
        else:
            out.append((p, arr))
    return out, removed


class SessionRows:
    """Unacknowledged rows of one session (I/O thread only)."""

    __slots__ = (
        "behind_since",
        "big_call",
        "big_pos",
        "call_id",
        "chunks",
        "last_used",
        "lost_end",
        "retry_at",
        "sent_end",
        "tail_from",
        "tapped",
        "unsure_call",
        "unsure_end",
    )

    def __init__(self, now: float) -> None:
        self.chunks: list[Chunk] = []  # contiguous, ascending positions
        self.call_id: int | None = None  # the call that last carried all of ``chunks`` (None: never sent)
        self.retry_at = 0.0  # monotonic time before which the server asked us not to send
        self.last_used = now
        self.big_call: int | None = None  # the call that sent rows only the server holds (None: none unproven)
        self.big_pos = -1  # the first of those rows
        self.behind_since = -1.0  # when the session fell behind them (< 0: it is not behind)
        self.tapped = False  # early taps were sent for the session (``lost_end`` applies)
        self.sent_end = 0  # the end of the furthest row sent
        self.tail_from = _NEVER  # the first position whose sent row a later entry superseded
        self.lost_end = -1  # >= 0: entries are marked ``restart`` until a context starts here or later
        self.unsure_call: int | None = None  # the call that alone carried rows given up below ``unsure_end``
        self.unsure_end = -1

    @property
    def rows(self) -> int:
        return chunk_rows(self.chunks)

    @property
    def end(self) -> int:
        if not self.chunks:
            return -1
        pos, arr = self.chunks[-1]
        return pos + len(arr)

    def take(self, pos: int, limit: int) -> tuple[list[Chunk], int]:
        """Remove and return the buffered rows that can precede new rows at ``pos``.

        Returns (chunks ending exactly at ``pos``, at most ``limit`` rows; rows dropped).
        """
        self.took(pos)
        chunks, self.chunks = self.chunks, []
        self.call_id = None
        if not chunks:
            return [], 0
        chunks, _superseded = cut_from(chunks, pos)  # rollback / overwrite: the new rows win
        dropped = 0
        if chunks and chunks[-1][0] + len(chunks[-1][1]) != pos:  # a gap: useless for resend
            dropped += chunk_rows(chunks)
            chunks = []
            self.gave_up(pos)
        kept = self.trimmed(chunks, limit, pos)
        return kept, dropped + chunk_rows(chunks) - chunk_rows(kept)

    def took(self, pos: int) -> None:
        """New rows at ``pos`` overwrite what was sent from there on (``take`` without the rows)."""
        if self.sent_end > pos:  # rows sent at pos and later are superseded: perhaps rejected drafts there
            self.tail_from = min(self.tail_from, pos)
        if self.lost_end > pos:  # the new rows overwrite from pos: a context from pos on is clean
            self.lost_end = pos

    def store(self, chunks: list[Chunk], limit: int, call_id: int | None) -> int:
        """Buffer ``chunks`` (what was just sent, or held back) as unacknowledged; rows dropped."""
        if not chunks:  # a step without rows for the session (its earlier ones acknowledged)
            self.chunks, self.call_id = [], None
            return 0
        if len(chunks) == 1 and 0 < len(chunks[0][1]) <= limit:  # the common case: one chunk that fits
            end = chunks[0][0] + len(chunks[0][1])
            if call_id is not None and end > self.sent_end:
                self.sent_end = end
            self.chunks, self.call_id = chunks, call_id
            return 0
        chunks = [c for c in chunks if len(c[1])]
        end = chunks[-1][0] + len(chunks[-1][1]) if chunks else 0
        if call_id is not None:
            self.sent_end = max(self.sent_end, end)
        before = chunk_rows(chunks)
        self.chunks = self.trimmed(chunks, limit, end, call_id)
        self.call_id = call_id if self.chunks else None
        return before - self.rows

    def trimmed(self, chunks: list[Chunk], limit: int, end: int, carrier: int | None = None) -> list[Chunk]:
        """The newest ``limit`` rows of ``chunks`` (contiguous, ending at ``end``). Rows left out are
        given up (``gave_up``), or, when call ``carrier`` has just sent them, given up only if a
        resend goes before that call is acknowledged (``resending``)."""
        kept, dropped = keep_newest(chunks, limit)
        if dropped:
            front = kept[0][0] if kept else end
            if carrier is None:
                self.gave_up(front)
            else:
                self.unsure_call, self.unsure_end = carrier, front
        return kept

    def resending(self) -> None:
        """Rows go from the buffer's front (no Taps call in flight stands for the rows below it): rows
        only an unacknowledged call carried are given up now."""
        if self.unsure_call is not None:
            self.unsure_call = None
            self.gave_up(self.unsure_end)

    def gave_up(self, end: int) -> None:
        """Unacknowledged rows below ``end`` are no longer kept (module docstring: ``lost_end``)."""
        if self.tapped and end > self.tail_from:
            self.lost_end = max(self.lost_end, end)

    def resynced(self, call_id: int, start: int) -> None:
        """An OK of call ``call_id`` named the context ``[start, ...)``: its rows are held, and none of
        the rows given up is in that context any more."""
        if call_id == self.unsure_call:
            self.unsure_call = None
        if 0 <= self.lost_end <= start:
            self.lost_end = -1

    def ack(self, call_id: int, end: int) -> None:
        """The server applied call ``call_id``'s rows of this session; its context ends at ``end``."""
        if call_id == self.call_id and end >= 0:
            self.chunks = cut_below(self.chunks, end)
            if not self.chunks:
                self.call_id = None

    def unsent(self) -> None:
        """The call that carried the rows never left the client: they are buffered, not in flight."""
        self.call_id = None

    # -- catching up (module docstring)

    def sent_big(self, call_id: int, pos: int) -> None:
        """Call ``call_id`` carries rows from ``pos`` on that the buffer cannot keep."""
        if self.big_call is None or pos < self.big_pos:
            self.big_call, self.big_pos = call_id, pos

    def fell_behind(self, now: float) -> bool:
        """A step of the session missed or expired: behind, if rows only the server holds are unproven."""
        if self.big_call is None or self.behind_since >= 0:
            return False
        self.behind_since = now
        return True

    def catching_up(self, now: float) -> bool:
        """Whether the session is behind (its steps do not wait for drafts); ends at the bound."""
        if self.behind_since < 0:
            return False
        if now - self.behind_since < CATCH_UP_MAX_S:
            return True
        self.caught_up()
        return False

    def acked(self, call_id: int, prompt: bool, start: int) -> None:
        """An OK of call ``call_id`` naming context ``start``, within its budget (``prompt``) or not:
        a later call's prompt OK at or below the burst ends catching up (the next step is a trial)."""
        big = self.big_call
        if self.behind_since >= 0 and big is not None and prompt and call_id > big and 0 <= start <= self.big_pos:
            self.behind_since = -1.0

    def drafted(self, call_id: int, on_time: bool) -> None:
        """Drafts of call ``call_id`` for the session: on time from the burst's call or a later one,
        the burst is proven (the server drafted from all it holds, in time)."""
        if on_time and self.big_call is not None and call_id >= self.big_call:
            self.caught_up()

    def caught_up(self) -> None:
        """Nothing of a burst left to wait for (proven, refused, lost with a server restart, or the bound)."""
        self.big_call, self.big_pos, self.behind_since = None, -1, -1.0
