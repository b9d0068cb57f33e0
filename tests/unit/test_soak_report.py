"""draft-soak's reference invariant: which sessions count as untouched by chaos.

An untouched session must keep its whole context; one the chaos touched may be restarted by the
server. A session whose unwaited ingest-only early Taps lost its request, or its reply, to the
proxy was touched (a lost reply leaves its rows unacknowledged: the client may give them up and
restart the session); the same session with the proxy's fault on another engine, or long after,
was not, and its restart fails the invariant.
"""

from __future__ import annotations

import argparse

from draft_tools.soak.engine import SESSION_COLUMNS
from draft_tools.soak.report import _reference
from draft_tools.soak.run import RunResult

T0 = 100.0  # the session's unwaited Taps step


def _session(number: int, restarted: int) -> list[object]:
    row = dict.fromkeys(SESSION_COLUMNS, 0)
    row.update(
        number=number, steps=10, all_ok=True, checked=10, mismatched=0, first_t0=T0 - 1.0, last_t1=T0 + 1.0,
        epochs=1, finished=True, restarted=restarted, tokens=[], unwaited_t0=[T0],
    )  # fmt: skip
    return [row[c] for c in SESSION_COLUMNS]


def _run(proxy_events: list[list[object]]) -> RunResult:
    engine = {"spec": {"index": 0}, "session_columns": list(SESSION_COLUMNS), "sessions": [_session(7, 1)]}
    return RunResult(
        engines=[engine], events=[], chaos_errors=[], samples=[], incarnations=[], slow_events=[],
        proxy={"events": proxy_events}, fuzz=None, last_metrics={}, end_sessions={}, unexpected_exits=0,
        t_start=0.0, t_end=200.0, server_tail=[], host_stalls=[],
    )  # fmt: skip


ARGS = argparse.Namespace(budget_ms=50.0, drafter="checksum", reference_min_agreement=1.0)


def test_a_restarted_session_whose_unwaited_taps_lost_its_request_or_reply_was_touched() -> None:
    for kind, t in (("drop_request", T0 + 0.005), ("drop_reply", T0 + 0.06)):
        ref = _reference(ARGS, _run([[t, kind, "soak-e0"]]), None)
        assert ref["sessions_touched"] == 1 and ref["sessions_touched_by_a_lost_unwaited_taps"] == 1, kind
        assert ref["of_them_restarted_by_the_server"] == 1 and ref["untouched_sessions_mismatched"] == 0


def test_a_restarted_session_the_proxy_never_touched_fails_the_invariant() -> None:
    for events in (
        [],
        [[T0 + 0.06, "drop_request", "soak-e0"]],  # a request's drop is seen within 20 ms of the step
        [[T0 + 0.2, "drop_reply", "soak-e0"]],  # past the Taps call's budget: another call's reply
        [[T0 + 0.01, "drop_reply", "soak-e1"]],  # another engine's
    ):
        ref = _reference(ARGS, _run(events), None)
        assert ref["sessions_untouched"] == 1 and ref["untouched_sessions_mismatched"] == 1, events
        (example,) = ref["examples"]  # it says what to look at: this engine's nearest proxy fault
        assert example.startswith("engine 0 session 7: 0/10 differ, 1 restarted; 1 unwaited Taps steps")
        mine = [e for e in events if e[2] == "soak-e0"]
        assert (f"{mine[0][1]} at +" in example) if mine else ("no proxy fault near one" in example), example
