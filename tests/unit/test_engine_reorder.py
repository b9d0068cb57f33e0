"""Early taps that arrive after a newer step of their session (a Step held back on the way: the
chaos proxy's ``delay`` reorders a connection's messages) never change what the session holds.

A verify span carries the step's rejected rows after its accepted ones. Applied late, by position,
an older span overwrote the newer span's accepted rows with its own rejected ones, and a commit
that names no Taps call (its span was acknowledged already) then drafted from them: drafts that
are not the checksum of the context (draft-soak ``--chaos taps,delay``: about 1,400 mismatched
entries in 30 s, one server). In a session with early taps, an entry of a call older than the
newest call that reached it (call ids grow per connection) now applies nothing and is answered
MISSING_ROWS (not applied: the client resends the rows). Likewise a span acknowledged when queued
whose rows are then dropped for want of KV room leaves no stale rows to draft from.
"""

from __future__ import annotations

import numpy as np

from draft_server.drafters.checksum import expected_drafts
from draft_server.engine.types import Call, Work
from protocol import GREEDY, Phase, Status
from tests.unit.test_engine_batching import Counting, _drain, _engine

OWNER = b"engine"


def _work(
    eng, call_id: int, pos: int, taps: np.ndarray | None, k: int, phase: Phase, after: int = 0, restart: bool = False
) -> Work:
    n = 0 if taps is None else len(taps)
    if n:
        assert eng.admission.try_admit_rows(OWNER, n)
    call = Call(OWNER, call_id, 0.0, 1e9, [None], remaining=1)
    return Work(call, 0, "s", pos, taps, 7, k, GREEDY, pos + n, phase=phase, after=after, restart=restart)


def _primed(seed: int):
    """An engine whose session holds a 7-row prompt (call 1) and a span of 8 rows at 7 (call 3)."""
    d = Counting()
    eng = _engine(d)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 1 << 16, (7, d.contract.tap_width), dtype=np.uint16)
    span = rng.integers(0, 1 << 16, (8, d.contract.tap_width), dtype=np.uint16)
    eng.submit([_work(eng, 1, 0, prompt, 0, Phase.WHOLE)])
    eng.submit([_work(eng, 3, 7, span, 0, Phase.TAPS)])
    _drain(eng)
    return d, eng, rng, prompt, span


def _late_then_commit(eng, late: Work, commit: Work):
    """Submit an overtaken entry, then a commit, each drained; (late result, commit result)."""
    for w in (late, commit):
        eng.submit([w])
        _drain(eng)
    return late.call.results[0], commit.call.results[0]


def _drafts_of(d, prompt: np.ndarray, span: np.ndarray, accepted: int) -> list[int]:
    """The checksum drafts over the prompt and the span's first ``accepted`` rows (anchor 7, k 4)."""
    held = {p: prompt[p].tobytes() for p in range(7)} | {7 + i: span[i].tobytes() for i in range(accepted)}
    return expected_drafts(held, 0, 7 + accepted, 7, 4, d.contract.vocab_size)


def test_an_older_span_arriving_late_never_overwrites_a_newer_one() -> None:
    d, eng, rng, prompt, newer = _primed(7)
    junk = rng.integers(0, 1 << 16, (5, d.contract.tap_width), dtype=np.uint16)
    older = np.concatenate([prompt[4:7], junk])  # the span at 4 (call 2): its rejected rows over 7..11
    late = _work(eng, 2, 4, older, 0, Phase.TAPS)  # held back on the way: arrives after call 3
    commit = _work(eng, 4, 9, None, 4, Phase.COMMIT)  # 2 of the newer span accepted; call 3 acked: no ``after``
    lr, r = _late_then_commit(eng, late, commit)
    assert lr is not None and lr.status == Status.MISSING_ROWS
    assert r is not None and r.status == Status.OK and (r.start, r.end) == (0, 9)
    assert list(r.drafts) == _drafts_of(d, prompt, newer, 2)
    assert eng.admission.queued_rows == 0
    assert eng.metrics.registry.get_sample_value("draft_server_stale_steps_total", {"why": "reordered"}) == 1


def test_an_older_commit_arriving_late_cuts_nothing() -> None:
    d, eng, _rng, prompt, span = _primed(8)
    stale = _work(eng, 2, 5, None, 4, Phase.COMMIT)  # an older step's commit, overtaken by call 3
    lr, r = _late_then_commit(eng, stale, _work(eng, 4, 10, None, 4, Phase.COMMIT, after=3))
    assert lr is not None and lr.status == Status.MISSING_ROWS and not lr.drafts
    assert r is not None and r.status == Status.OK and list(r.drafts) == _drafts_of(d, prompt, span, 3)


def test_a_late_span_sent_as_an_ingest_only_whole_entry_applies_nothing_either() -> None:
    # A client catching up sends its spans as plain ingest-only entries (WHOLE, k=0), rejected rows
    # and all: overtaken, such an entry overwrote the newer span's rows as a late Taps did.
    d, eng, rng, prompt, newer = _primed(9)
    junk = rng.integers(0, 1 << 16, (5, d.contract.tap_width), dtype=np.uint16)
    late = _work(eng, 2, 4, np.concatenate([prompt[4:7], junk]), 0, Phase.WHOLE)
    lr, r = _late_then_commit(eng, late, _work(eng, 4, 10, None, 4, Phase.COMMIT))
    assert lr is not None and lr.status == Status.MISSING_ROWS
    assert r is not None and r.status == Status.OK and list(r.drafts) == _drafts_of(d, prompt, newer, 3)


def test_a_session_without_early_taps_applies_late_entries_by_position_as_before() -> None:
    """Only committed rows there (any client version, which may not know MISSING_ROWS): a late
    single message still applies by position (its rows are the truth; the newer context is cut)."""
    d = Counting()
    eng = _engine(d)
    rows = np.random.default_rng(10).integers(0, 1 << 16, (10, d.contract.tap_width), dtype=np.uint16)
    eng.submit([_work(eng, 1, 0, rows[:7], 0, Phase.WHOLE), _work(eng, 3, 7, rows[7:10], 0, Phase.WHOLE)])
    _drain(eng)
    late = _work(eng, 2, 4, rows[4:7], 0, Phase.WHOLE)
    eng.submit([late])
    _drain(eng)
    r = late.call.results[0]
    assert r is not None and r.status == Status.OK and r.end == 7


def test_a_span_marked_restart_starts_its_session_at_its_first_row() -> None:
    """A client that gave up unacknowledged rows below its resend (the session holds an older
    span's rejected rows there: the span at 7, call 3) marks its next entries ``restart``: the
    session starts at the marked span's first row, and the commit drafts from exactly the rows
    from there, never from the rejected ones below it. A marked commit with no rows of its own is
    answered MISSING_ROWS; the same span unmarked overwrites by position as before."""
    d, eng, rng, _prompt, _span = _primed(11)
    resent = rng.integers(0, 1 << 16, (6, d.contract.tap_width), dtype=np.uint16)  # rows 10..15
    bare = _work(eng, 4, 12, None, 4, Phase.COMMIT, restart=True)
    eng.submit([bare])
    _drain(eng)
    r = bare.call.results[0]
    assert r is not None and r.status == Status.MISSING_ROWS and (r.start, r.end) == (0, 15)
    taps = _work(eng, 5, 10, resent, 0, Phase.TAPS, restart=True)
    lr, r = _late_then_commit(eng, taps, _work(eng, 6, 13, None, 4, Phase.COMMIT, after=5))
    assert lr is not None and lr.status == Status.OK and lr.start == 10
    assert r is not None and r.status == Status.OK and (r.start, r.end) == (10, 13)
    held = {10 + i: resent[i].tobytes() for i in range(3)}
    assert list(r.drafts) == expected_drafts(held, 10, 13, 7, 4, d.contract.vocab_size)
    assert eng.metrics.registry.get_sample_value("draft_server_session_restarts_total", {"cause": "gap"}) == 1
    unmarked = _work(eng, 7, 11, resent[1:], 0, Phase.TAPS)  # by position: overwrites from 11
    lr, r = _late_then_commit(eng, unmarked, _work(eng, 8, 12, None, 4, Phase.COMMIT, after=7))
    assert lr is not None and lr.start == 10 and r is not None and (r.start, r.end) == (10, 12)
    assert eng.admission.queued_rows == 0


class Full(Counting):
    """The checksum drafter whose KV cache refuses every reservation while ``full``."""

    full = False

    def reserve(self, key: int, start: int, end: int) -> bool:
        return not self.full and super().reserve(key, start, end)


def test_a_span_dropped_for_kv_room_after_its_ack_leaves_no_stale_rows_to_draft_from() -> None:
    """A span (call 5) at 9, over the older span's rejected rows 9..14, is acknowledged when queued
    (ingest only) and then finds no KV room: its rows are dropped. Its commit (2 rows accepted,
    naming call 5) must not draft from the rows the session held at 9 and 10 (the older span's):
    the session no longer claims rows from 9 on, so the commit is MISSING_ROWS and the client
    resends; once room is back, the resent rows draft as the client's context says."""
    d = Full()
    eng = _engine(d)
    rng = np.random.default_rng(9)
    prompt = rng.integers(0, 1 << 16, (7, d.contract.tap_width), dtype=np.uint16)
    older = rng.integers(0, 1 << 16, (8, d.contract.tap_width), dtype=np.uint16)
    eng.submit([_work(eng, 1, 0, prompt, 0, Phase.WHOLE)])
    eng.submit([_work(eng, 3, 7, older, 0, Phase.TAPS)])
    _drain(eng)
    newer = rng.integers(0, 1 << 16, (6, d.contract.tap_width), dtype=np.uint16)
    span = _work(eng, 5, 9, newer, 0, Phase.TAPS)
    d.full = True
    eng.submit([span])
    _drain(eng)
    d.full = False
    assert span.call.results[0].status == Status.OK  # acknowledged when queued, then dropped
    commit = _work(eng, 6, 11, None, 4, Phase.COMMIT, after=5)
    eng.submit([commit])
    _drain(eng)
    assert commit.call.results[0].status == Status.MISSING_ROWS, commit.call.results[0]
    resent = _work(eng, 7, 9, newer[:2], 4, Phase.WHOLE)  # the rows again, with the anchor
    resent.anchor = 7
    eng.submit([resent])
    _drain(eng)
    held = {p: prompt[p].tobytes() for p in range(7)} | {7: older[0].tobytes(), 8: older[1].tobytes()}
    held |= {9: newer[0].tobytes(), 10: newer[1].tobytes()}
    r = resent.call.results[0]
    assert r.status == Status.OK and list(r.drafts) == expected_drafts(held, 0, 11, 7, 4, d.contract.vocab_size)


def test_a_span_relying_on_rows_of_a_call_that_never_reached_its_session_applies_nothing() -> None:
    """A client catching up sends a span's new rows alone, naming the call with the rows below them
    (``after``). Call 4 (the span at 7's accepted rows and more) never arrived: the session holds
    the span at 7's rejected rows below 9, so the span at 9 is MISSING_ROWS, nothing applied, and so
    is the next one, which relies on it; a span marked ``restart`` is its own context and applies."""
    d, eng, rng, _prompt, _span = _primed(12)
    for cid, pos, after in ((5, 9, 4), (6, 12, 5)):
        rows = rng.integers(0, 1 << 16, (3, d.contract.tap_width), dtype=np.uint16)
        w = _work(eng, cid, pos, rows, 0, Phase.WHOLE, after=after)
        eng.submit([w])
        _drain(eng)
        r = w.call.results[0]
        assert r is not None and r.status == Status.MISSING_ROWS and (r.start, r.end) == (0, 15), r
    fresh = rng.integers(0, 1 << 16, (3, d.contract.tap_width), dtype=np.uint16)
    lr, r = _late_then_commit(
        eng, _work(eng, 7, 9, fresh, 0, Phase.WHOLE, after=6, restart=True), _work(eng, 8, 11, None, 4, Phase.COMMIT)
    )
    assert lr is not None and lr.status == Status.OK and lr.start == 9
    held = {9 + i: fresh[i].tobytes() for i in range(2)}
    assert r is not None and r.status == Status.OK and (r.start, r.end) == (9, 11)
    assert list(r.drafts) == expected_drafts(held, 9, 11, 7, 4, d.contract.vocab_size)
    assert eng.admission.queued_rows == 0
