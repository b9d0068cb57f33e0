"""The client's steady-state shortcuts (``step_builder.FAST_PATHS``: ``merge_rows``, the reply's ``_ack``
and ``_replies``) give exactly what the general path gives: two clients' worth of state, one with the
shortcuts and one without, fed the same random steps (appends mostly, rollbacks, gaps, steps not sent,
rowless entries) and the same random replies (OK, EXPIRED, OVERLOADED with a retry, MISSING_ROWS,
INTERNAL, lost), must agree on every wire entry, every row sent, every local and returned reply and
every session's resend state after every step. Pure logic, no sockets."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from protocol import DType, EntryResult, Phase, Status, StepEntry
from target_client.api import DraftReply
from target_client.client import step_builder
from target_client.client.calls import Pending, StepCall
from target_client.client.io_loop import IoLoop
from target_client.client.resend import SessionRows
from target_client.client.step_builder import merge_rows

LAYOUT = (DType.BF16, 4)
LIMIT = 8  # resend_rows_limit: small, so bursts and trims happen too


def rows_at(pos: int, n: int) -> np.ndarray:
    a = np.zeros((n, 4), dtype=np.uint16)
    a[:, 0] = np.arange(pos, pos + n)
    return a


def session_state(s: SessionRows) -> dict[str, Any]:
    d = {k: getattr(s, k) for k in SessionRows.__slots__ if k != "chunks"}
    d["chunks"] = [(p, a[:, 0].tolist()) for p, a in s.chunks]
    return d


def merged_state(m: step_builder.MergedStep) -> dict[str, Any]:
    return {
        "entries": m.entries,
        "parts": [p[:, 0].tolist() for p in m.parts],
        "index": m.index,
        "sessions": m.sessions,
        "ks": m.ks,
        "local": m.local,
        "zero_copy": m.zero_copy,
        "resent": m.resent,
        "dropped": m.dropped,
        "skipped": m.skipped,
        "behind": m.behind,
    }


class World:
    """One client's sessions and the I/O loop's reply handling over them (``fast``: with the shortcuts)."""

    def __init__(self, fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fast, self.mp = fast, monkeypatch
        self.sessions: dict[str, SessionRows] = {}
        self.calls = {"take": 0, "ack": 0, "reply": 0}
        loop = SimpleNamespace(sessions=self.sessions, handshake=SimpleNamespace(pinned=None))
        loop._c = SimpleNamespace(bad_reply=lambda: None)

        def reply(*a: Any) -> DraftReply:
            self.calls["reply"] += 1
            return IoLoop._reply(loop, *a)  # type: ignore[arg-type]

        loop._reply = reply
        self.loop = loop

    def _counting(self) -> None:
        calls = self.calls
        take, ack = SessionRows.take, SessionRows.ack

        def counted_take(s: SessionRows, *a: Any) -> Any:
            calls["take"] += 1
            return take(s, *a)

        def counted_ack(s: SessionRows, *a: Any) -> Any:
            calls["ack"] += 1
            return ack(s, *a)

        self.mp.setattr(SessionRows, "take", counted_take)
        self.mp.setattr(SessionRows, "ack", counted_ack)
        self.mp.setattr(step_builder, "FAST_PATHS", self.fast)

    def _restore(self) -> None:
        self.mp.undo()

    def merge(self, call: StepCall, now: float, cid: int | None) -> step_builder.MergedStep:
        self._counting()
        try:
            return merge_rows(call, self.sessions, now, cid, LAYOUT, room=12, limit=LIMIT)
        finally:
            self._restore()

    def answer(self, p: Pending, results: list[EntryResult], now: float) -> list[DraftReply]:
        self._counting()
        try:
            IoLoop._ack(self.loop, p, results, now)  # type: ignore[arg-type]
            return IoLoop._replies(self.loop, p, results, ())  # type: ignore[arg-type]
        finally:
            self._restore()


def random_results(entries: list[StepEntry], rng: random.Random) -> list[EntryResult]:
    out = []
    for e in entries:
        x = rng.random()
        end = e.pos + e.rows
        if x < 0.75:
            drafts = tuple(rng.randrange(100) for _ in range(e.k))
            out.append(EntryResult(Status.OK, drafts, end, start=rng.choice([0, 0, 0, e.pos])))
        elif x < 0.83:
            out.append(EntryResult(Status.EXPIRED, end=end, start=0))
        elif x < 0.91:
            out.append(EntryResult(Status.OVERLOADED, retry_after_ms=rng.choice([0.0, 2.0]), message="queue full"))
        elif x < 0.96:
            out.append(EntryResult(Status.MISSING_ROWS, end=-1, start=-1))
        else:
            out.append(EntryResult(Status.INTERNAL, message="drafter error"))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_fast_paths_equal_the_general_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    fast, slow = World(True, monkeypatch), World(False, monkeypatch)
    names = ["a", "b", "c", "d"]
    ends = dict.fromkeys(names, 0)  # each session's context end, as the target sees it
    now, cid = 100.0, 0
    for _ in range(400):
        now += rng.choice([0.0005, 0.001, 0.003])
        chosen = rng.sample(names, rng.randint(1, len(names)))
        reqs = []
        for name in chosen:
            x = rng.random()
            pos = ends[name]
            if x < 0.08 and pos:  # rollback: the rows from pos on are rewritten
                pos = max(0, pos - rng.randint(1, 3))
            elif x < 0.12:  # a gap (rows never sent)
                pos += rng.randint(1, 3)
            n = rng.choice([0, 1, 2, 3, 3, 3, 3, 9])  # 9 > LIMIT: a burst
            ends[name] = pos + n
            reqs.append((name, pos, n, rng.choice([0, 3, 3, 3])))
        entries = tuple(StepEntry(name, pos, n, 1, k, phase=Phase.WHOLE) for name, pos, n, k in reqs)
        taps = np.concatenate([rows_at(pos, n) for _, pos, n, _ in reqs]) if any(r[2] for r in reqs) else None
        send = rng.random() > 0.1
        cid += 1
        merged = []
        for w in (fast, slow):
            call = StepCall(entries, taps, now + 0.05, send)
            merged.append(w.merge(call, now, cid if send else None))
        assert merged_state(merged[0]) == merged_state(merged[1])
        assert {k: session_state(s) for k, s in fast.sessions.items()} == {
            k: session_state(s) for k, s in slow.sessions.items()
        }
        m = merged[0]
        if not send or not m.entries or rng.random() < 0.1:  # not sent, nothing went, or the reply was lost
            continue
        results = random_results(m.entries, rng)
        afters = tuple(0 for _ in m.entries)
        replies = []
        for w in (fast, slow):
            p = Pending("step", cid, now + 0.05, now, None, tuple(m.sessions), tuple(m.index), tuple(m.ks),
                        dict(m.local), len(entries), afters)  # fmt: skip
            replies.append(w.answer(p, results, now + 0.0002))
        assert replies[0] == replies[1]
        assert {k: session_state(s) for k, s in fast.sessions.items()} == {
            k: session_state(s) for k, s in slow.sessions.items()
        }
    # the shortcuts were taken (else this test would pass without them): many entries skipped the general calls
    assert fast.calls["take"] < 0.8 * slow.calls["take"], (fast.calls, slow.calls)
    assert fast.calls["ack"] < 0.8 * slow.calls["ack"], (fast.calls, slow.calls)
    assert fast.calls["reply"] < 0.5 * slow.calls["reply"], (fast.calls, slow.calls)
