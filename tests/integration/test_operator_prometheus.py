"""A real Prometheus (Debian's package) scrapes a live draft server and a live draft client's
metrics endpoint, loads deploy/prometheus/rules.yml, and answers every rule expression and every
dashboard query without an error; the series they are about are there. Then the watchdog path of
compose/Kubernetes/systemd (--watchdog-exit, a supervisor restarting the process) really fires
DraftServerWatchdogFired, DraftServerUnhealthy and DraftServerRestarted.

Scrape and rule evaluation run every second (the rule groups' intervals are shortened in a copy
of rules.yml); the whole module takes about 20 s.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server

from draft_tools.common import free_port
from protocol import StepEntry
from target_client import ClientConfig, DraftClient, StepRequest
from tests.conftest import ROOT, RawPeer, ServerProc, random_taps, wait_for
from tests.unit.test_operator_tools import require_tool

DEPLOY = Path(ROOT) / "deploy"
RULES = DEPLOY / "prometheus" / "rules.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "draft-service.json"
# dashboard variables as Grafana substitutes them
VARIABLES = {"$server_job": "draft-server", "$engine_job": "vllm", "$__rate_interval": "1m"}
# series a CPU checksum server and a client without vLLM cannot have
NO_DATA_HERE = re.compile(r"vllm:|draft_server_gpu_memory_|draft_service:")

pytestmark = pytest.mark.timeout(180)


class Prometheus:
    def __init__(self, tmp: Path, server_ports: list[int], client_port: int) -> None:
        binary = require_tool("prometheus", "apt-get install prometheus")
        rules = yaml.safe_load(RULES.read_text())
        for g in rules["groups"]:
            g["interval"] = "1s"
        (tmp / "rules.yml").write_text(yaml.safe_dump(rules))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(tmp / "rules.yml")],
            "scrape_configs": [
                {"job_name": "draft-server", "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in server_ports]}]},
                {"job_name": "vllm", "static_configs": [{"targets": [f"127.0.0.1:{client_port}"]}]},
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.log = open(tmp / "prometheus.log", "w")  # closed in stop()
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        assert wait_for(self._ready, timeout=30), (tmp / "prometheus.log").read_text()[-3000:]

    def _ready(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1).status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        except urllib.error.HTTPError as e:  # a bad query answers 400 with the error in the body
            body = json.loads(e.read())
        return body

    def query(self, expr: str) -> list[dict]:
        body = self.api("query", query=expr)
        assert body["status"] == "success", f"{expr}: {body.get('errorType')}: {body.get('error')}"
        assert not body.get("warnings"), f"{expr}: {body['warnings']}"
        return body["data"]["result"]

    def firing(self) -> set[str]:
        return {a["labels"]["alertname"] for a in self.api("alerts")["data"]["alerts"] if a["state"] == "firing"}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, ServerProc, ServerProc, DraftClient]]:
    """Prometheus scraping two draft servers (one serving a client, one whose engine the second
    test hangs: every draft batch takes 3 s, over its 0.5 s watchdog) and the client."""
    tmp = tmp_path_factory.mktemp("prometheus")
    srv = ServerProc()
    hang = ServerProc("--checksum-delay-ms", "3000", "--watchdog-s", "0.5", "--watchdog-exit")
    client_port = free_port()
    # first: without a prometheus binary this skips, and nothing has been started that would outlive the test
    prom = Prometheus(tmp, [srv.metrics_port, hang.metrics_port], client_port)
    registry = CollectorRegistry()
    http, _ = start_http_server(client_port, addr="127.0.0.1", registry=registry)
    client = None
    try:
        srv.start()
        hang.start()
        client = DraftClient(ClientConfig(endpoint=srv.endpoint, budget_ms=200.0, registry=registry))
        client.connect(wait=True)
        yield prom, srv, hang, client
    finally:
        prom.stop()
        if client is not None:
            client.close()
        http.shutdown()
        srv.kill()
        hang.kill()


def drive(client: DraftClient, steps: int) -> None:
    rng = np.random.default_rng(0)
    width = client.contract.tap_width
    for i in range(steps):
        taps = rng.integers(0, 1 << 16, size=(2, width), dtype=np.uint16)
        client.step([StepRequest("s0", pos=2 * i, rows=2, anchor=5, k=3)], taps)
        time.sleep(0.05)


def exprs() -> list[tuple[str, str]]:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    out = [(f"rule {r.get('record') or r.get('alert')}", r["expr"]) for r in rules]
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        for t in p.get("targets", []):
            e = t["expr"]
            for var, value in VARIABLES.items():
                e = e.replace(var, value)
            assert "$" not in e, (p["title"], e)
            out.append((f"panel {p['title']!r}", e))
    return out


def test_every_rule_and_dashboard_query_evaluates_on_live_series(stack) -> None:
    prom, srv, _, client = stack
    drive(client, 60)  # ~3 s of traffic, scraped every second
    assert wait_for(lambda: len(prom.query("up == 1")) == 3, timeout=20), prom.query("up")
    time.sleep(2.5)  # a few scrapes and rule evaluations after the traffic
    empty = []
    for where, e in exprs():
        result = prom.query(e)
        if not result and not NO_DATA_HERE.search(e) and not where.startswith("rule Draft") and "absent(" not in e:
            empty.append((where, e))
    assert not empty, f"queries with no series although the server and client export them: {empty}"
    # every rule loaded and evaluated without error; recording rules produce their series
    groups = prom.api("rules")["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == len([r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]])
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
    for name in (
        "draft_server:entries:rate5m",
        "draft_server:sessions:ratio",
        "draft_client:steps_fallback:ratio_rate5m",
    ):
        assert prom.query(name), name
    (sessions,) = prom.query(f'draft_server:sessions:ratio{{instance="127.0.0.1:{srv.metrics_port}"}}')
    assert 0 < float(sessions["value"][1]) < 1  # the live session over the exported max_sessions
    assert prom.firing() == set(), "a healthy server and client fire nothing"


def test_watchdog_exit_fires_the_alerts_it_used_to_hide(stack) -> None:
    """--watchdog-exit as compose/Kubernetes/systemd run it: the server exits 3 after one scrape,
    the supervisor (here the test) restarts it, and the alerts on the watchdog, health and
    restarts fire for that server."""
    prom, _, hang, _ = stack
    peer = RawPeer(hang.endpoint)
    try:
        peer.step([StepEntry("w", 0, 1, 1, 1)], random_taps(np.random.default_rng(1), 1), timeout_ms=1)
        assert hang.proc is not None and hang.proc.wait(15) == 3
    finally:
        peer.close()
    hang.start()  # what Restart=always / restart: always / the kubelet do
    want = {"DraftServerWatchdogFired", "DraftServerUnhealthy", "DraftServerRestarted"}
    instance = f"127.0.0.1:{hang.metrics_port}"

    def fired() -> set[str]:
        alerts = prom.api("alerts")["data"]["alerts"]
        return {
            a["labels"]["alertname"]
            for a in alerts
            if a["state"] == "firing" and a["labels"].get("instance") == instance
        }

    assert wait_for(lambda: want <= fired(), timeout=20), fired()
