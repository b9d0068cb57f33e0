"""draft_tools.bench.step_timeline's trace analysis on a hand-made chrome trace (no GPU): per
``step`` annotation its wall time, the GPU's busy time (the union of kernels and copies), the time
before its first work and after its last, the gaps between named by the innermost host phase running
when each began, and each phase's host time."""

from __future__ import annotations

from draft_tools.bench.step_timeline import analyse


def _x(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_a_step_splits_into_gpu_busy_head_gaps_and_tail() -> None:
    trace = {
        "traceEvents": [
            _x("user_annotation", "step", 0, 100),
            _x("user_annotation", "fast.ingest", 2, 20),
            _x("user_annotation", "fast.stage", 30, 25),
            _x("user_annotation", "graph.replay", 40, 4),  # inside stage: the innermost phase
            _x("cuda_runtime", "cudaGraphLaunch", 41, 3),
            _x("kernel", "ingest", 10, 12),
            _x("gpu_memcpy", "Memcpy HtoD", 20, 5),  # overlaps the kernel: counted once
            _x("kernel", "a", 42, 20),
            _x("kernel", "b", 63, 27),  # 1 us after a: under the 2 us threshold, no gap
            _x("user_annotation", "step", 200, 50),  # a second step with no GPU work
            _x("kernel", "outside", 150, 10),  # between the steps: nobody's
        ]
    }
    first, second = analyse(trace)
    assert first["wall_us"] == 100 and first["gpu_busy_us"] == 15 + 20 + 27
    assert first["head_us"] == 10 and first["tail_us"] == 10
    assert first["gap_us"] == 17 and first["largest_gaps"] == [{"at_us": 25.0, "us": 17.0, "phase": "step"}]
    assert first["gpu_activities"] == 4
    assert first["host_phase_us"] == {"fast.ingest": 20, "fast.stage": 25, "graph.replay": 4, "cudaGraphLaunch": 3}
    assert second["gpu_busy_us"] == 0 and second["head_us"] == 50 and second["gap_us"] == 0
