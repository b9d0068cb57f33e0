"""A session catching up (a burst larger than the budget, ``target_client.client.resend``) with early
taps, when one of its calls in flight is lost: the client's half (``merge_rows`` and the I/O loop's
``_ack``) and the server's (the engine) glued by hand, so which call is lost is chosen exactly.

While it catches up the client sends each span as an ingest-only WHOLE entry carrying only its new
rows: the rows below it are on their way in the call before, in order. When that call is lost (the
``drop`` chaos, a reconnect, a queue-full refusal), the server still holds below the next span the
rejected rows of an older span whose commit was lost. Before, the next span was appended over them
by position, its prompt acknowledgement ended catching up, and the trial step's commit drafted
from a context holding those rows. Now such an entry names the call carrying its rows below
(``after``), and unless that call reached the session last the server answers MISSING_ROWS (nothing
applied); the client resends from its buffer and the commit drafts from exactly the right rows.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from draft_server.drafters.checksum import expected_drafts
from draft_server.engine.types import Call, Work
from protocol import GREEDY, EntryResult, Phase, Status, StepEntry
from target_client.client.calls import Pending, StepCall
from target_client.client.io_loop import IoLoop
from target_client.client.resend import SessionRows
from target_client.client.step_builder import merge_rows
from tests.unit.test_engine_batching import Counting, _drain, _engine

OWNER = b"client"
LIMIT = 8  # the client's resend_rows_limit: a 20-row prompt is a burst
K = 4


class Glue:
    """One client session and one engine; every call goes through ``merge_rows`` and, unless lost,
    through the engine, and its reply back through the I/O loop's ``_ack``."""

    def __init__(self) -> None:
        self.d = Counting()
        self.eng = _engine(self.d)
        self.rng = np.random.default_rng(17)
        self.sessions: dict[str, SessionRows] = {}
        self.ack = SimpleNamespace(sessions=self.sessions)  # what IoLoop._ack reads of its loop
        self.in_taps: set[int] = set()  # early Taps calls awaiting their reply
        self.truth: dict[int, bytes] = {}  # the committed rows by position
        self.sent: dict[int, StepEntry] = {}  # the entry each call carried
        self.held: dict[int, tuple[Pending, EntryResult]] = {}  # replies not read yet
        self.cid = 0

    @property
    def s(self) -> SessionRows:
        return self.sessions["s"]

    def rows(self, n: int) -> np.ndarray:
        return self.rng.integers(0, 1 << 16, (n, self.d.contract.tap_width), dtype=np.uint16)

    def send(self, e: StepEntry, new: np.ndarray | None, lost: bool = False, hold: bool = False) -> EntryResult | None:
        """One call of the entry ``e``; its result (None: nothing went, or it was lost). ``hold``: the
        reply reaches the client only at ``reply``."""
        self.cid += 1
        cid = self.cid
        call = StepCall((e,), new, 1e9, True, phase=e.phase)
        m = merge_rows(call, self.sessions, 0.0, cid, None, 64, LIMIT, self.in_taps.__contains__)
        if not m.entries:
            return None
        if e.phase == Phase.TAPS or len(m.local) == 1:
            self.in_taps.add(cid)  # pending as "taps": nobody waits for its reply
        (w,) = m.entries
        self.sent[cid] = w
        if lost:
            return None
        taps = np.concatenate(m.parts) if m.parts else None
        if taps is not None:
            assert self.eng.admission.try_admit_rows(OWNER, len(taps))
        c = Call(OWNER, cid, 0.0, 1e9, [None], remaining=1)
        self.eng.submit(
            [Work(c, 0, "s", w.pos, taps, w.anchor, w.k, GREEDY, w.pos + w.rows, phase=w.phase, after=w.after,
                  restart=w.restart)]
        )  # fmt: skip
        _drain(self.eng)
        r = c.results[0]
        assert r is not None
        self.held[cid] = (Pending("step", cid, 1e9, 0.0, None, tuple(m.sessions), tuple(m.index), tuple(m.ks)), r)
        if not hold:
            self.reply(cid)
        return r

    def reply(self, cid: int, late: bool = False) -> None:
        """Call ``cid``'s reply reaches the client (within its budget, or ``late``)."""
        p, r = self.held.pop(cid)
        self.in_taps.discard(cid)
        IoLoop._ack(self.ack, p, (r,), 2e9 if late else 1.0)  # type: ignore[arg-type]

    def taps(self, pos: int, n: int, lost: bool = False, hold: bool = False) -> tuple[np.ndarray, EntryResult | None]:
        arr = self.rows(n)
        return arr, self.send(StepEntry("s", pos, n, 0, 0, phase=Phase.TAPS), arr, lost, hold)

    def commit(
        self, span_pos: int, span: np.ndarray, accepted: int, lost: bool = False, hold: bool = False
    ) -> EntryResult | None:
        for p in [p for p in self.truth if p >= span_pos]:
            del self.truth[p]
        self.truth |= {span_pos + i: span[i].tobytes() for i in range(accepted)}
        self.anchor = int(self.rng.integers(0, self.d.contract.vocab_size))
        return self.send(StepEntry("s", span_pos + accepted, 0, self.anchor, K, phase=Phase.COMMIT), None, lost, hold)

    def want(self, r: EntryResult) -> list[int]:
        held = {p: b for p, b in self.truth.items() if r.start <= p < r.end}
        return expected_drafts(held, r.start, r.end, self.anchor, K, self.d.contract.vocab_size)


def test_a_lost_call_while_catching_up_never_lets_a_commit_draft_from_stale_rows() -> None:
    g = Glue()
    prompt = g.rows(20)
    r = g.send(StepEntry("s", 0, 20, 0, 0), prompt)  # a long prompt, ingest only: a burst (> LIMIT rows)
    assert r is not None and r.status == Status.OK and g.s.big_call == 1
    g.truth |= {p: prompt[p].tobytes() for p in range(20)}
    span, r = g.taps(20, K + 1)  # [20, 25), acknowledged
    assert r is not None and r.status == Status.OK
    assert g.commit(20, span, 1, lost=True) is None  # lost: the server keeps rows 21..24, rejected drafts
    assert g.s.fell_behind(1.0) and g.s.catching_up(1.0)  # the commit missed with the burst unproven
    span, _ = g.taps(21, K + 1, lost=True)  # the span at 21, sent ingest-only: never arrives
    assert g.commit(21, span, 2) is None  # catching up: rows 21, 22 stay on their way in that call
    span, r = g.taps(23, K + 1)  # its rows below 23 were in the lost call
    assert g.sent[g.cid].after == g.cid - 2  # the lost call
    assert r is not None and r.status == Status.MISSING_ROWS and r.end == 25, r  # not over the stale 21, 22
    assert not g.s.catching_up(1.0)  # nothing of the burst to wait for: the next steps wait as usual
    r = g.commit(23, span, 1)  # resends rows 21..23 with the commit
    assert r is not None and r.status == Status.OK and (r.start, r.end) == (0, 24), r
    assert list(r.drafts) == g.want(r)
    for _ in range(3):  # and the session goes on, exact
        pos = max(g.truth) + 1
        span, _ = g.taps(pos, K + 1)
        r = g.commit(pos, span, 2)
        assert r is not None and r.status == Status.OK and list(r.drafts) == g.want(r), r
    assert g.eng.admission.queued_rows == 0


def test_catching_up_in_order_still_takes_each_span_without_resending() -> None:
    """Nothing lost (the usual way to fall behind: a commit that drafts too late): each ingest-only
    span names the call before it that carried rows of the session, which reached it last (a
    rowless commit in between does not count), so it applies by position as before, its rows below
    on their way not sent twice, and the trial's commit drafts exactly."""
    g = Glue()
    prompt = g.rows(20)
    assert g.send(StepEntry("s", 0, 20, 0, 0), prompt) is not None
    g.truth |= {p: prompt[p].tobytes() for p in range(20)}
    span, _ = g.taps(20, K + 1, hold=True)  # call 2; its reply on its way
    r = g.commit(20, span, 1, hold=True)  # call 3 (after 2): drafted, its reply late
    assert r is not None and r.status == Status.OK and g.sent[3].after == 2
    assert g.s.fell_behind(1.0)
    span, r = g.taps(21, K + 1, hold=True)  # call 4: row 20 is on its way in call 2
    assert r is not None and r.status == Status.OK and (r.start, r.end) == (0, 26), r
    assert (g.sent[4].pos, g.sent[4].rows, g.sent[4].phase, g.sent[4].after) == (21, K + 1, Phase.WHOLE, 2)
    assert g.commit(21, span, 2) is None  # call 5: catching up, nothing to send
    span, r = g.taps(23, K + 1)  # call 6
    assert (g.sent[6].pos, g.sent[6].rows, g.sent[6].k, g.sent[6].after) == (23, K + 1, 0, 4)
    assert r is not None and r.status == Status.OK and (r.start, r.end) == (0, 28), r
    assert not g.s.catching_up(1.0)  # a prompt acknowledgement holding the burst: the next step is a trial
    for cid in (2, 3, 4):
        g.reply(cid, late=True)
    r = g.commit(23, span, 1)
    assert r is not None and r.status == Status.OK and (r.start, r.end) == (0, 24) and list(r.drafts) == g.want(r)
    assert g.sent[g.cid].rows == 0  # nothing resent
