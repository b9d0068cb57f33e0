"""Bench plots render from their committed JSON reports (matplotlib, no GPU)."""

from __future__ import annotations

from pathlib import Path

from draft_tools.bench import cuda_ipc

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_cuda_ipc_report_plots(tmp_path: Path) -> None:
    out = tmp_path / "hop.png"
    assert cuda_ipc.main(["--plot", str(RESULTS / "cuda_ipc_h200.json"), "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
