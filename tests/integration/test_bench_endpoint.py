"""`draft-bench --endpoint` measures a running server (its own contract) beside the bare-ZeroMQ floor."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, ServerProc


def test_draft_bench_targets_a_running_server(tmp_path) -> None:
    srv = ServerProc().start()
    try:
        out = tmp_path / "rpc.json"
        cmd = [sys.executable, "-m", "draft_tools.bench.rpc", "--iters", "5", "--endpoint", srv.endpoint]
        r = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        rep = json.loads(out.read_text())
        assert rep["transport"] == f"running server at {srv.endpoint}"
        rows = {(x["payload"], x["sessions"]): x for x in rep["results"]}
        assert rows[("k3", 4)]["mb_per_step"] == round(4 * 3 * 128 * 2 / 1e6, 3)  # the server's own tap width
        assert srv.metrics()['draft_server_messages_total{kind="step"}'] >= 8 * 25  # it really went there
    finally:
        srv.stop()
