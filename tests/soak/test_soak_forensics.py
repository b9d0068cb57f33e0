"""draft-soak's forensics for calls over budget: stack dumps at the bound, likely causes."""

from __future__ import annotations

import threading
import time

import numpy as np

from draft_tools.soak import report, run
from draft_tools.soak.engine import CALL_COLUMNS, LateStacks


def _hog_the_gil(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():  # pure Python: holds the GIL between switch intervals
        x += 1


def test_stack_dump_at_the_bound_names_what_the_other_thread_was_doing(tmp_path) -> None:
    path = tmp_path / "engine-0-1.json.stacks"
    stop = threading.Event()
    hog = threading.Thread(target=_hog_the_gil, args=(stop,), name="hog")
    with open(path, "wb", buffering=0) as f:
        watch = LateStacks(f, 0.05)  # the way the soak engine arms it
        hog.start()
        try:
            watch.arm()
            time.sleep(0.2)
            watch.disarm()
            watch.close()
        finally:
            stop.set()
            hog.join()
        f.write(b"@@ call t0=12.5 wait_ms=200.000\n")
        watch = LateStacks(f, 10.0)
        watch.arm()  # a call that came back in time: no dump
        watch.disarm()
        watch.close()
    stacks = run._late_stacks(str(path))
    assert [t for t, _ in stacks] == [12.5]
    text = stacks[0][1]
    assert "_hog_the_gil" in text and "test_stack_dump_at_the_bound" in text
    assert "threading.py" not in text  # threading's own frames are left out


def _engine(rows: list[dict[str, float]], stacks: list[tuple[float, str]]) -> dict:
    calls = [[r.get(c, 0.0) for c in CALL_COLUMNS] for r in rows]
    return {"spec": {"index": 0}, "call_columns": list(CALL_COLUMNS), "calls": calls, "late_stacks": stacks}


def test_forensics_give_each_unexplained_call_its_likely_cause() -> None:
    base = {"budget_ms": 20.0, "none": 8.0}
    rows = [
        {**base, "t0": 100.0, "wait_ms": 12.0},  # on time: not listed
        {**base, "t0": 101.0, "wait_ms": 60.0, "gc_ms": 41.0, "cpu_ms": 43.0, "proc_cpu_ms": 44.0},
        {**base, "t0": 102.0, "wait_ms": 50.0, "cpu_ms": 1.0, "proc_cpu_ms": 31.0},
        {**base, "t0": 103.0, "wait_ms": 45.0, "steal_ms": 40.0},
        {**base, "t0": 104.0, "wait_ms": 45.0},
        {**base, "t0": 105.0, "wait_ms": 45.0, "run_delay_ms": 30.0},  # explained by the run queue
    ]
    eng = _engine(rows, [(102.0, "Thread 0x1:\n  busy.py, line 3 in spin")])
    res = run.RunResult(
        engines=[eng], events=[], chaos_errors=[], samples=[], incarnations=[], slow_events=[], proxy=None,
        fuzz=None, last_metrics={}, end_sessions={}, unexpected_exits=0, t_start=100.0, t_end=110.0,
        server_tail=[], host_stalls=[(104.005, 0.030)],
    )  # fmt: skip
    calls = report._calls(eng)
    delays = calls[:, CALL_COLUMNS.index("run_delay_ms")]
    f = report._overrun_forensics(res, [(eng, calls)], delays)
    by_t = {r["t_s"]: r for r in f["calls"]}
    assert sorted(by_t) == [1.0, 2.0, 3.0, 4.0]
    assert by_t[1.0]["likely_cause"] == "gc"
    assert by_t[2.0]["likely_cause"] == "another engine thread held the GIL"
    assert by_t[2.0]["stacks_at_budget_plus_5ms"].endswith("in spin")
    assert by_t[3.0]["likely_cause"] == "steal"
    assert by_t[4.0]["likely_cause"] == "host stall (canary)" and by_t[4.0]["canary_stall_ms"] == 30.0
    assert f["by_cause"] == {"gc": 1, "another engine thread held the GIL": 1, "steal": 1, "host stall (canary)": 1}
    assert np.isclose(by_t[1.0]["unexplained_ms"], 40.0)
