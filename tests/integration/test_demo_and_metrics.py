"""`make demo`'s job and the metrics endpoint, as an operator would see them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from protocol import StepEntry
from tests.conftest import ROOT, RawPeer, random_taps, wait_for


def test_demo_runs_and_reports(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "draft_tools.demo", "--part", "load", "--duration-s", "3", "--total-sessions", "20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert re.search(r"^all\s+\d+\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+", text, re.M), text
    assert "invalid drafts 0" in text
    assert "live sessions now 0" in text
    assert "demo OK" in text
    assert re.search(r"statuses \{'ok': \d+", text), text


def test_metrics_endpoint_parses_and_counts(server):
    peer = RawPeer(server.endpoint)
    rng = np.random.default_rng(0)
    for i in range(3):
        peer.step([StepEntry("m", i * 2, 2, 1, 3)], random_taps(rng, 2))
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(body)}
    for name in [
        "draft_server_step_duration_seconds",
        "draft_server_sessions",
        "draft_server_entries",
        "draft_server_rows_ingested",
        "draft_server_process_resident_memory_bytes",
    ]:
        assert name in fams, sorted(fams)
    hist = fams["draft_server_step_duration_seconds"]
    assert hist.type == "histogram"
    buckets = [s for s in hist.samples if s.name.endswith("_bucket")]
    assert float(buckets[0].labels["le"]) < 0.001  # sub-millisecond resolution
    count = next(s.value for s in hist.samples if s.name.endswith("_count"))
    assert count == 3
    ok = next(
        s.value
        for s in fams["draft_server_entries"].samples
        if s.name.endswith("_total") and s.labels == {"status": "ok"}
    )
    assert ok == 3
    assert next(s.value for s in fams["draft_server_rows_ingested"].samples if s.name.endswith("_total")) == 6
    for f in fams.values():  # no per-request label anywhere
        for s in f.samples:
            assert not {"session", "request", "call_id", "client"} & set(s.labels)
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/healthz").read())
    assert health["healthy"] is True and health["epoch"] == server.epoch and health["sessions"] == 1
    peer.close()


def test_healthz_turns_red_when_the_engine_overruns(server_factory):
    srv = server_factory("--checksum-delay-ms", "1500", "--watchdog-s", "0.3")
    peer = RawPeer(srv.endpoint)
    peer.step([StepEntry("w", 0, 1, 1, 1)], random_taps(np.random.default_rng(1), 1), timeout_ms=1)

    def is_(code: int, healthy: bool) -> bool:
        got = srv.healthz()
        return got[0] == code and got[1]["healthy"] is healthy

    assert wait_for(lambda: is_(503, False), 10)  # red once the batch runs past the watchdog's 0.3 s (of 1.5)
    assert srv.metrics()["draft_server_watchdog_fired_total"] == 1
    assert wait_for(lambda: is_(200, True), 10)  # the slow batch ends: green again
    peer.close()
