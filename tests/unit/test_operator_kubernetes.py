"""The Kubernetes deployment as `kubectl apply -k deploy` sends it: rendered by kubectl's own
kustomize, every built-in object validated against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: unknown fields are errors), the prometheus-operator objects checked
against what they must hold (their CRD schemas are not packaged anywhere installable here).

`python -m tests.unit.test_operator_kubernetes` rewrites deploy/kubernetes/prometheusrule.yaml
from deploy/prometheus/rules.yml after a change of the rules.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.unit.test_operator_tools import require_tool, run_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "rules.yml"
PROMETHEUS_RULE = DEPLOY / "kubernetes" / "prometheusrule.yaml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "draft-service.json"
NAMESPACE = "draft-service"
# oldest and newest Kubernetes minor versions the manifests are validated against
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
BUILTIN = {"Namespace", "ConfigMap", "StatefulSet", "Service", "NetworkPolicy", "PodDisruptionBudget"}
CRDS = {"ServiceMonitor", "PrometheusRule"}


def render_prometheus_rule() -> str:
    """rules.yml's groups under a PrometheusRule's spec, comments and block scalars kept."""
    text = RULES.read_text()
    groups = text[text.index("\ngroups:") + 1 :]
    spec = "".join(("  " + line if line.strip() else line) for line in groups.splitlines(keepends=True))
    return (
        "# GENERATED from deploy/prometheus/rules.yml by `python -m tests.unit.test_operator_kubernetes`;\n"
        "# edit rules.yml and regenerate. For prometheus-operator (kube-prometheus-stack): add the label\n"
        "# your Prometheus selects rules by (ruleSelector, often `release: <helm release>`).\n"
        "apiVersion: monitoring.coreos.com/v1\n"
        "kind: PrometheusRule\n"
        "metadata:\n"
        "  name: draft-service\n"
        "  labels:\n"
        "    app.kubernetes.io/name: draft-server\n"
        "    app.kubernetes.io/part-of: draft-service\n"
        "spec:\n" + spec
    )


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    kubectl = require_tool("kubectl", "the Google Cloud CLI's kubectl, or kubectl from your distribution")
    out = run_tool([kubectl, "kustomize", str(DEPLOY)])
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert docs
    return docs


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def test_prometheus_rule_is_rules_yml() -> None:
    assert PROMETHEUS_RULE.read_text() == render_prometheus_rule(), (
        "deploy/kubernetes/prometheusrule.yaml is stale: python -m tests.unit.test_operator_kubernetes"
    )
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_everything_is_rendered_into_the_namespace(rendered: list[dict]) -> None:
    kinds = by_kind(rendered)
    assert set(kinds) == BUILTIN | CRDS, sorted(kinds)
    (ns,) = kinds["Namespace"]
    assert ns["metadata"]["name"] == NAMESPACE
    for d in rendered:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == NAMESPACE, (d["kind"], d["metadata"])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_objects_validate_against_the_kubernetes_schemas(rendered: list[dict], version: str) -> None:
    checked = set()
    for d in rendered:
        if d["kind"] in BUILTIN:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(
                    f"{d['kind']}/{d['metadata']['name']} against Kubernetes {version}: {e.message} at {e.path}"
                )
            checked.add(d["kind"])
    assert checked == BUILTIN


def test_prometheus_operator_objects(rendered: list[dict]) -> None:
    kinds = by_kind(rendered)
    (svc,) = kinds["Service"]
    (sm,) = kinds["ServiceMonitor"]
    (rule,) = kinds["PrometheusRule"]
    for obj in (sm, rule):
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
    # ServiceMonitor: selects the Service, scrapes a named port of it
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    ports = {p["name"] for p in svc["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in ports and ep["path"] == "/metrics"
        assert re.fullmatch(r"\d+s", ep["interval"]) and re.fullmatch(r"\d+s", ep["scrapeTimeout"])
    # the job label prometheus-operator gives the scrape is the Service name, which the rules expect
    assert svc["metadata"]["name"] == "draft-server"
    # PrometheusRule: spec.groups as prometheus-operator's CRD requires (promtool checks the PromQL)
    assert set(rule["spec"]) == {"groups"}
    for g in rule["spec"]["groups"]:
        assert set(g) <= {"name", "interval", "rules"} and g["name"] and g["rules"]
        for r in g["rules"]:
            assert isinstance(r["expr"], str) and (("record" in r) != ("alert" in r))
            assert set(r) <= {"record", "alert", "expr", "for", "labels", "annotations"}


def test_dashboard_configmap_and_image(rendered: list[dict]) -> None:
    maps = {m["metadata"]["name"]: m for m in by_kind(rendered)["ConfigMap"]}
    dash = maps["draft-service-dashboard"]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["draft-service.json"]) == json.loads(DASHBOARD.read_text())
    (dep,) = by_kind(rendered)["StatefulSet"]
    (ctr,) = dep["spec"]["template"]["spec"]["containers"]
    registry = ctr["image"].split("/", 1)[0]
    assert "." in registry or ":" in registry, f"{ctr['image']}: no registry host"
    assert not ctr["image"].endswith(":latest") and ":" in ctr["image"].rsplit("/", 1)[1]


if __name__ == "__main__":
    PROMETHEUS_RULE.write_text(render_prometheus_rule())
    print(f"wrote {PROMETHEUS_RULE.relative_to(ROOT)}", file=sys.stderr)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_three_servers_render_and_validate(tmp_path: Path, version: str) -> None:
    """Issue 15: N = 3 draft servers (a kustomize overlay on deploy/), every built-in object valid,
    one GPU each, readiness on /healthz, a headless Service that lists exactly those pods."""
    kubectl = require_tool("kubectl", "the Google Cloud CLI's kubectl, or kubectl from your distribution")
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {os.path.relpath(DEPLOY, tmp_path)}\n"
        "replicas:\n  - name: draft-server\n    count: 3\n"
    )
    docs = [d for d in yaml.safe_load_all(run_tool([kubectl, "kustomize", str(tmp_path)])) if d]
    for d in docs:
        if d["kind"] in BUILTIN:
            kubernetes_validate.validate(d, version, strict=True)
    kinds = by_kind(docs)
    (sts,) = kinds["StatefulSet"]
    (svc,) = kinds["Service"]
    (pdb,) = kinds["PodDisruptionBudget"]
    spec = sts["spec"]
    assert spec["replicas"] == 3 and spec["podManagementPolicy"] == "Parallel"
    assert spec["updateStrategy"] == {"type": "RollingUpdate"}
    pod_labels = spec["template"]["metadata"]["labels"]
    # the headless Service the engines resolve (dns+tcp://draft-server.draft-service.svc:5557)
    assert spec["serviceName"] == svc["metadata"]["name"] == "draft-server"
    assert svc["spec"]["clusterIP"] == "None" and not svc["spec"].get("publishNotReadyAddresses", False)
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}["rpc"] == 5557
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (ctr,) = spec["template"]["spec"]["containers"]
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert ctr["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
