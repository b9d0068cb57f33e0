"""The decode batch takes a session's queued entries in runs: a session with many ingest-only
entries queued (a client catching up after a burst sends rows ingest-only step after step) is
drained in as many ``drafter.step`` calls as the rows need at ``max_batch_rows``, not one call
per entry, with every other client's head entry in the batch first and positions unchanged."""

from __future__ import annotations

import math

import numpy as np

from draft_server.drafters.checksum import ChecksumDrafter, expected_drafts
from draft_server.engine.scheduler import Engine
from draft_server.engine.types import Call, Work
from draft_server.metrics import ServerMetrics
from protocol import GREEDY, Phase, Status

BATCH_ROWS = 64


class Counting(ChecksumDrafter):
    """The checksum drafter, recording each ``step``: the rows it ingested per session, the sessions
    it drafted; and that every ingest item lies inside the KV its session has reserved."""

    def __init__(self, capacity_tokens: int = 1 << 22) -> None:
        super().__init__(capacity_tokens=capacity_tokens)
        self.steps: list[tuple[dict[int, int], list[int]]] = []
        self.room: dict[int, tuple[int, int]] = {}
        self.longest = 0  # rows of the longest ingest item

    def reserve(self, key: int, start: int, end: int) -> bool:
        ok = super().reserve(key, start, end)
        if ok:
            self.room[key] = (start, end)
        return ok

    def step(self, ingest, drafts):  # type: ignore[no-untyped-def, override]
        rows: dict[int, int] = {}
        for it in ingest:
            lo, hi = self.room[it.key]
            assert lo <= it.start <= it.pos and it.pos + len(it.taps) <= hi, "rows outside the session's KV"
            rows[it.key] = rows.get(it.key, 0) + len(it.taps)
            self.longest = max(self.longest, len(it.taps))
        self.steps.append((rows, [it.key for it in drafts]))
        return super().step(ingest, drafts)


def _engine(d: ChecksumDrafter) -> Engine:
    return Engine(
        d, ServerMetrics(), lambda ident, msg, payloads: None, "e", "c",
        max_sessions=8, max_queue_rows=100_000, max_batch_rows=BATCH_ROWS, max_batch_sessions=8,
        prefill_chunk_rows=16, batch_window_ms=0.0, session_ttl_s=60.0,
    )  # fmt: skip


class Client:
    """One client's sessions: queues entries on the engine (one Step each) and keeps every row it
    sent, by position, so the drafts can be checked against ``expected_drafts``."""

    def __init__(self, eng: Engine, owner: bytes, seed: int) -> None:
        self.eng, self.owner = eng, owner
        self.rng = np.random.default_rng(seed)
        self.rows: dict[str, dict[int, bytes]] = {}
        self.calls = 0

    def entry(self, sid: str, pos: int, n: int, k: int = 0, phase: Phase = Phase.WHOLE) -> Work:
        width = self.eng.drafter.contract.tap_width
        taps = self.rng.integers(0, 1 << 16, (n, width), dtype=np.uint16)
        assert self.eng.admission.try_admit_rows(self.owner, n)
        held = self.rows.setdefault(sid, {})
        for p in [p for p in held if p >= pos]:  # an overwrite cuts the rows past it, as the server does
            del held[p]
        held.update({pos + i: taps[i].tobytes() for i in range(n)})
        self.calls += 1
        call = Call(self.owner, self.calls, 0.0, 1e9, [None], remaining=1)
        w = Work(call, 0, sid, pos, taps, 7, k, GREEDY, pos + n, phase=phase)
        self.eng.submit([w])
        return w

    def expected(self, sid: str, k: int) -> list[int]:
        held = self.rows[sid]
        start, end = min(held), max(held) + 1
        return expected_drafts(held, start, end, 7, k, self.eng.drafter.contract.vocab_size)


def _drain(eng: Engine, most: int = 200) -> None:
    eng._drain_inbox()
    for _ in range(most):
        if not eng._iteration():
            return
    raise AssertionError("the engine did not go idle")


def test_a_sessions_queued_ingest_only_entries_drain_in_few_steps() -> None:
    """30 ingest-only entries of 3 rows (a client catching up), its drafting entry after them and
    another client's drafting entry: 94 rows, so ceil(94 / 64) = 2 steps, not one per entry (31);
    the other client drafts in the first, and the drafts are those of the whole context."""
    d = Counting()
    eng = _engine(d)
    burst, other = Client(eng, b"burst", 1), Client(eng, b"other", 2)
    acks = [burst.entry("s", 3 * i, 3) for i in range(30)]
    last = burst.entry("s", 90, 2, k=4)
    mine = other.entry("t", 0, 2, k=4)
    _drain(eng)
    total = 30 * 3 + 2 + 2
    assert len(d.steps) <= math.ceil(total / BATCH_ROWS), f"{len(d.steps)} drafter.step calls for {total} rows"
    assert all(sum(rows.values()) <= BATCH_ROWS for rows, _ in d.steps)
    assert d.longest <= 16  # a run's rows go in items of at most a prefill chunk (no item longer than an entry)
    t = eng.sessions.get((b"other", "t"))
    assert t is not None and t.handle in d.steps[0][1]  # not behind the burst
    for w in acks:  # acknowledged at admission, as before
        r = w.call.results[0]
        assert r is not None and r.status == Status.OK and r.end == w.end and not r.drafts
    r = last.call.results[0]
    assert r is not None and r.status == Status.OK and (r.start, r.end) == (0, 92)
    assert list(r.drafts) == burst.expected("s", 4)
    r = mine.call.results[0]
    assert r is not None and r.status == Status.OK and list(r.drafts) == other.expected("t", 4)
    assert eng.admission.queued_rows == 0


def test_two_clients_backlogs_share_every_batch() -> None:
    """Two clients each with a long ingest-only backlog: neither fills a batch alone."""
    d = Counting()
    eng = _engine(d)
    a, b = Client(eng, b"a", 3), Client(eng, b"b", 4)
    for i in range(40):
        a.entry("s", 2 * i, 2)
        b.entry("s", 2 * i, 2)
    wa, wb = a.entry("s", 80, 1, k=3), b.entry("s", 80, 1, k=3)
    _drain(eng)
    assert len(d.steps) <= math.ceil(2 * 81 / BATCH_ROWS)
    for rows, _ in d.steps:
        assert len(rows) == 2 and abs(max(rows.values()) - min(rows.values())) <= 2, rows
    for c, w in ((a, wa), (b, wb)):
        r = w.call.results[0]
        assert r is not None and list(r.drafts) == c.expected("s", 3)


def test_a_run_ends_at_a_gap_or_a_full_kv_cache() -> None:
    """A resend (an overwrite from inside the entry before it) joins the run, that entry's rows past
    it cut, never ingested; a gap waits for the next step. Every item of a step lies in the KV its
    session holds; positions work as before."""
    d = Counting()
    eng = _engine(d)
    c = Client(eng, b"c", 5)
    for i in range(4):
        c.entry("s", 3 * i, 3)
    c.entry("s", 10, 3)  # a resend from 10 (rows 10-11 overwritten)
    c.entry("s", 13, 3)
    c.entry("s", 20, 2)  # a gap: the session restarts at 20
    w = c.entry("s", 22, 2, k=5)
    _drain(eng)
    s = eng.sessions.get((b"c", "s"))
    assert s is not None
    assert d.steps == [({s.handle: 16}, []), ({s.handle: 4}, [s.handle])]  # 0-15 (9-11 cut to 9), then 20-23
    r = w.call.results[0]
    assert r is not None and (r.start, r.end) == (20, 24)
    c.rows["s"] = {p: v for p, v in c.rows["s"].items() if p >= 20}
    assert list(r.drafts) == c.expected("s", 5)

    d = Counting(capacity_tokens=10)  # the fourth entry finds no room: dropped, the run ends there
    eng = _engine(d)
    c = Client(eng, b"c", 6)
    for i in range(5):
        c.entry("s", 3 * i, 3)
    _drain(eng)
    assert [rows for rows, _ in d.steps] == [{1: 9}, {1: 3}]  # then 12-14 as a gap restart
    s = eng.sessions.get((b"c", "s"))
    assert s is not None and (s.start, s.end) == (12, 15) and not s.pending
    assert eng.admission.queued_rows == 0


def test_overlapping_spans_drain_in_runs_without_their_rejected_rows() -> None:
    """A client catching up with early taps sends each step's whole verified span (k + 1 = 8 rows)
    ingest-only, the next span from inside the last one (over its rejected drafts' rows). They join
    one run, each cut where the next begins: 30 spans drain in ceil(30 x 8 / 64) steps, not one step
    per span (early_taps_gpu over shm, 16 sessions on the H200: 382 catch-up steps, 5.2 s, against 61
    for the single message), a span's rejected rows are ingested only at the end of a step, and the
    drafts are those of the committed rows."""
    d = Counting()
    eng = _engine(d)
    c = Client(eng, b"c", 9)
    rng = np.random.default_rng(9)
    pos = 0
    for _ in range(30):
        c.entry("s", pos, 8)
        pos += int(rng.integers(1, 9))  # the anchor and the drafts it accepted
    w = c.entry("s", pos, 2, k=4)
    _drain(eng)
    assert len(d.steps) <= math.ceil(30 * 8 / BATCH_ROWS) + 1, f"{len(d.steps)} drafter.step calls for 30 spans"
    ingested = sum(sum(rows.values()) for rows, _ in d.steps)
    assert ingested <= pos + 2 + 7 * (len(d.steps) - 1)  # a step's last span whole, the rest cut
    r = w.call.results[0]
    assert r is not None and r.status == Status.OK and (r.start, r.end) == (0, pos + 2)
    assert list(r.drafts) == c.expected("s", 4)
    assert eng.admission.queued_rows == 0


def test_an_overwrite_refused_inside_a_run_leaves_the_entry_before_it_whole() -> None:
    """A commit that would overwrite the span before it from inside (its rows from 5 over the span's
    0-7) but names the wrong call is answered MISSING_ROWS: nothing of it applies, and the span
    keeps all 8 rows it was acknowledged for (the cut is made only once the overwrite is placed), so
    the next entry appends at 8 to the whole context instead of restarting the session there."""
    d = Counting()
    eng = _engine(d)
    c = Client(eng, b"c", 4)
    c.entry("s", 0, 8)
    held = dict(c.rows["s"])  # what the server must hold: the refused commit changes nothing
    bad = c.entry("s", 5, 3, k=4, phase=Phase.COMMIT)
    bad.after = 12345  # relies on a call whose taps the session never had
    c.rows["s"] = held
    _drain(eng)
    assert len(d.steps) == 1  # the span and the commit were one run
    r = bad.call.results[0]
    assert r is not None and r.status == Status.MISSING_ROWS
    w = c.entry("s", 8, 2, k=4)
    _drain(eng)
    r = w.call.results[0]
    assert r is not None and r.status == Status.OK and (r.start, r.end) == (0, 10)
    assert list(r.drafts) == c.expected("s", 4)


def test_early_taps_join_a_run_only_where_they_would_go_alone() -> None:
    """Early taps behind a session's ingest-only entry wait for a batch without drafting, as they
    would at the head of the queue; behind them a draft of their own session takes them along."""
    d = Counting()
    eng = _engine(d)
    c, o = Client(eng, b"c", 7), Client(eng, b"o", 8)
    c.entry("x", 0, 3)
    c.entry("x", 3, 3, phase=Phase.TAPS)
    o.entry("y", 0, 2, k=3)
    _drain(eng)
    x, y = eng.sessions.get((b"c", "x")), eng.sessions.get((b"o", "y"))
    assert x is not None and y is not None
    assert [(rows, set(drafted)) for rows, drafted in d.steps] == [
        ({x.handle: 3, y.handle: 2}, {y.handle}),
        ({x.handle: 3}, set()),
    ]
    d.steps.clear()
    c.entry("x", 6, 3)
    c.entry("x", 9, 3, phase=Phase.TAPS)
    w = c.entry("x", 12, 1, k=2)
    o.entry("y", 2, 2, k=3)
    _drain(eng)
    assert [(rows, set(drafted)) for rows, drafted in d.steps] == [({x.handle: 7, y.handle: 2}, {x.handle, y.handle})]
    r = w.call.results[0]
    assert r is not None and list(r.drafts) == c.expected("x", 2)


def test_queue_wait_is_observed_once_per_step_served() -> None:
    """``draft_server_queue_wait_seconds``: one sample per Step a batch served (its reply's
    ``Timing.queue_ms``), not one per entry: a 64-session Step was 64 histogram updates."""
    d = Counting()
    eng = _engine(d)
    width = d.contract.tap_width
    call = Call(b"c", 1, 0.0, 1e9, [None] * 3, remaining=3)
    assert eng.admission.try_admit_rows(b"c", 6)
    works = [
        Work(call, i, f"s{i}", 0, np.zeros((2, width), np.uint16), 7, 4, GREEDY, 2) for i in range(3)
    ]  # fmt: skip
    eng.submit(works)
    _drain(eng)
    m = eng.metrics
    m.later.flush()
    count = m.registry.get_sample_value("draft_server_queue_wait_seconds_count")
    assert all(r is not None and r.status == Status.OK and len(r.drafts) == 4 for r in call.results)
    assert count == 1 and call.queue_s > 0
