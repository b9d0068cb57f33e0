"""draft_tools.bench.restart_steps's analysis of a soak's raw records (hand-made, no soak run): per
READY after a kill and per engine, the first calls that start after it (wait, the caller's own CPU,
drafts) and the steps until drafts came back; a kill with no READY and a pause are not restarts."""

from __future__ import annotations

import json

from draft_tools.bench.restart_steps import after_restarts
from draft_tools.soak.engine import CALL_COLUMNS


def _call(t0: float, wait_ms: float, cpu_ms: float, drafted: int) -> list[float]:
    rec = dict.fromkeys(CALL_COLUMNS, 0.0)
    rec.update(t0=t0, wait_ms=wait_ms, cpu_ms=cpu_ms, drafted=drafted, want=8)
    return [rec[c] for c in CALL_COLUMNS]


def test_the_calls_after_each_ready_and_the_steps_to_drafts(tmp_path) -> None:
    events = [
        {"kind": "kill", "t0": 105.0, "t1": 105.6, "detail": {"ready": 105.5}},
        {"kind": "pause", "t0": 106.0, "t1": 106.5, "detail": {}},
        {"kind": "kill", "t0": 107.0, "t1": 107.1, "detail": {}},  # never READY: not counted
    ]
    (tmp_path / "result-1.json").write_text(json.dumps({"t_start": 100.0, "events": events}))
    calls = [
        _call(105.4, 3.0, 1.0, 8),  # before READY
        _call(105.51, 0.1, 0.5, 0),  # gate still closed: answered at once
        _call(105.54, 21.0, 17.5, 0),  # the caller busy for 17.5 ms: missed
        _call(105.58, 0.2, 0.4, 0),  # catching up
        _call(105.61, 2.5, 1.5, 8),
    ]
    engine = {"spec": {"index": 1}, "call_columns": list(CALL_COLUMNS), "calls": [x for c in calls for x in c]}
    (tmp_path / "engine-1-1.json").write_text(json.dumps(engine))
    (rec,) = after_restarts(str(tmp_path), first=3)
    assert rec["t_ready_s"] == 5.5 and rec["engine"] == 1 and rec["steps_to_drafts"] == 3
    assert [c["wait_ms"] for c in rec["first_calls"]] == [0.1, 21.0, 0.2]
    assert [c["caller_cpu_ms"] for c in rec["first_calls"]] == [0.5, 17.5, 0.4]
    assert [c["drafted"] for c in rec["first_calls"]] == [0, 0, 0]
