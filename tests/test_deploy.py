"""deploy/: Prometheus config and alert rules (promtool), the Grafana dashboard, systemd units, compose.

promtool checks skip only when promtool is missing and FUSIONNET_REQUIRE_PROMETHEUS is unset; CI sets it
(scripts/test.sh), so a machine without Prometheus fails there instead of passing silently. Install with
scripts/install-prometheus.sh.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from fusionnet.metrics import BrokerMetrics, CompnodeMetrics, exposed_names, referenced_metrics
from tests.deploy_support import DASHBOARD, DEPLOY, alert_rules, dashboard_exprs
from tests.jobfiles import REPO

SAMPLE_PEER = "/ip4/10.0.0.1/tcp/31337/p2p/12D3KooWAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("FUSIONNET_REQUIRE_PROMETHEUS"):
            pytest.fail(
                f"{name} not found but FUSIONNET_REQUIRE_PROMETHEUS is set: run scripts/install-prometheus.sh"
            )
        pytest.skip(f"{name} not installed (scripts/install-prometheus.sh)")
    return path


def run_tool(*args: str, stdin: str | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=60, cwd=cwd)


def populated_registries() -> list[tuple[str, object]]:
    """Both metric sets with a value in every family, the way a busy swarm exposes them."""
    b = BrokerMetrics()
    b.set_peer("12D3KooWAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", started_at=1.0)
    b.set_swarm([("supernode", "online"), ("antnode", "unreachable")], backup_pool=1)
    b.set_jobs({"running": 1, "succeeded": 2})
    b.jobs_submitted.inc(3)
    b.observe_step("job-1", step=7, seconds=0.8, samples=16, loss=0.5, predicted_seconds=0.6, compnodes=2)
    b.observe_heartbeat(0.003)
    b.observe_heartbeat(None)
    b.failovers.inc()
    b.observe_subtask_prediction(0.012, 0.01)
    for phase, seconds in (("detection", 1.5), ("redistribution", 0.2), ("replay", 3.0)):
        b.observe_recovery(phase, seconds)
    c = CompnodeMetrics()
    c.set_peer("12D3KooWBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", started_at=2.0)
    c.set_state("online")
    c.set_load(0.5, 1)
    c.set_hardware(speed_factor=0.3, peak_flops=1e11)
    for phase in ("forward", "backward", "update"):
        c.observe_compute(phase, 0.01)
    c.count_data("tcp", "sent", 4096)
    c.count_data("p2p", "received", 512)
    c.count_refusal("unknown_job")
    c.count_subtask("succeeded")
    return [("broker", b.registry), ("compnode", c.registry)]


def all_exposed() -> set[str]:
    return exposed_names(BrokerMetrics(process=False).registry) | exposed_names(
        CompnodeMetrics(process=False).registry
    )


# ---- promtool ------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_prometheus_config_is_valid() -> None:
    out = run_tool(require_tool("promtool"), "check", "config", str(DEPLOY / "prometheus.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(60)
def test_alert_rules_are_valid_and_pass_their_unit_tests() -> None:
    promtool = require_tool("promtool")
    out = run_tool(promtool, "check", "rules", str(DEPLOY / "alerts.yml"))
    assert out.returncode == 0, out.stdout + out.stderr
    out = run_tool(promtool, "test", "rules", str(DEPLOY / "alerts_test.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_unit_tests() -> None:
    tests = yaml.safe_load((DEPLOY / "alerts_test.yml").read_text())["tests"]
    cases = [case for t in tests for case in t.get("alert_rule_test", [])]
    for rule in alert_rules():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']}: no test case where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']}: no test case where it stays quiet"


@pytest.mark.timeout(60)
def test_alert_unit_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    """The rule tests bite: raising the stalled-job threshold makes them fail."""
    promtool = require_tool("promtool")
    rules = (DEPLOY / "alerts.yml").read_text()
    assert "> 600" in rules
    (tmp_path / "alerts.yml").write_text(rules.replace("> 600", "> 6000"))
    shutil.copy(DEPLOY / "alerts_test.yml", tmp_path / "alerts_test.yml")
    out = run_tool(promtool, "test", "rules", str(tmp_path / "alerts_test.yml"))
    assert out.returncode != 0 and "FusionNetJobStalled" in out.stdout + out.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["broker", "compnode"])
def test_exposition_passes_promtool_check_metrics(which: str) -> None:
    promtool = require_tool("promtool")
    registry = dict(populated_registries())[which]
    text = generate_latest(registry).decode()
    assert "fusionnet_" in text
    out = run_tool(promtool, "check", "metrics", stdin=text)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr
    # ... and the linter does complain about a badly named metric, so silence above means something.
    bad = "# HELP x_seconds_total a gauge\n# TYPE x_seconds_total gauge\nx_seconds_total 1\n"
    assert run_tool(promtool, "check", "metrics", stdin=bad).returncode != 0


@pytest.mark.timeout(60)
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Every dashboard query, as a recording rule, passes promtool's PromQL parser."""
    promtool = require_tool("promtool")
    rules = [
        {"record": f"dashboard:query_{i}", "expr": expr.replace("$__rate_interval", "1m")}
        for i, expr in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = run_tool(promtool, "check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "a:b", "expr": "sum(("}]}]})
    )
    assert run_tool(promtool, "check", "rules", str(path)).returncode != 0


# ---- metric names referenced by the deploy files exist ---------------------------------------------------
def test_rules_and_dashboard_reference_only_exported_metrics() -> None:
    exported = all_exposed()
    for where, exprs in (
        ("alerts.yml", [r["expr"] for r in alert_rules()]),
        ("dashboard", dashboard_exprs()),
    ):
        used = referenced_metrics(exprs)
        assert used, where
        missing = sorted(used - exported)
        assert not missing, f"{where} queries metrics that no daemon exports: {missing}"
    # Histograms are queried through their series, never by their bare family name.
    assert "fusionnet_step_duration_seconds" not in referenced_metrics(dashboard_exprs())


def test_dashboard_layout() -> None:
    doc = json.loads(DASHBOARD.read_text())
    panels = doc["panels"]
    assert [p["title"] for p in panels if p["type"] == "row"] == ["Swarm", "Jobs", "Performance", "Recovery"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    occupied: set[tuple[int, int]] = set()
    for p in panels:  # no two panels overlap on the grid
        g = p["gridPos"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"panel {p['title']!r} overlaps another"
        occupied |= cells
    assert doc["templating"]["list"][0]["query"] == "prometheus"


def metric_label_names(registry: object) -> set[str]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry).decode()
    return {k for f in text_string_to_metric_families(text) for s in f.samples for k in s.labels}


def test_target_labels_do_not_clash_with_metric_labels() -> None:
    """A scraped label named like a target label is renamed exported_<name> by Prometheus, which breaks
    every query on it: the SD labels of compnodes and the broker's static labels must stay clear."""
    broker, compnode = (registry for _, registry in populated_registries())
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {c["job_name"]: c for c in config["scrape_configs"]}
    broker_target_labels = {"job", "instance"} | {
        k for static in jobs["fusionnet-broker"]["static_configs"] for k in static.get("labels", {})
    }
    assert not metric_label_names(broker) & broker_target_labels
    sd_labels = {"job", "instance", "role", "backup", "peer"}  # fusionnet.metrics.sd
    assert not metric_label_names(compnode) & sd_labels


def test_scrape_jobs_match_rules_and_dashboard() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {c["job_name"] for c in config["scrape_configs"]}
    used = set()
    for text in [r["expr"] for r in alert_rules()] + dashboard_exprs():
        used.update(re.findall(r'job="([^"]+)"', text))
    assert used and used <= jobs, (
        f"rules/dashboard use scrape jobs {sorted(used - jobs)} not in prometheus.yml"
    )
    assert config["rule_files"] == ["alerts.yml"]


# ---- daemon command lines in systemd units and compose use real flags ------------------------------------
def parse_fusionnet(argv: list[str], where: str) -> None:
    import argparse

    from fusionnet.cli.main import COMMANDS, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if argv[0] not in sub.choices:
        # A contract command (interface.md) that this build does not have yet: its flags cannot be checked.
        assert argv[0] in COMMANDS, f"{where}: `fusionnet {argv[0]}` is not a fusionnet command"
        return
    try:
        parser.parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"{where}: `fusionnet {shlex.join(argv)}` is refused by the CLI") from e


def systemd_exec(unit: Path) -> tuple[list[str], dict[str, str]]:
    text = unit.read_text().replace("\\\n", " ")
    env = {}
    for line in text.splitlines():
        if line.startswith("Environment="):
            key, _, val = shlex.split(line.split("=", 1)[1])[0].partition("=")
            env[key] = val
    exec_line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    return shlex.split(exec_line.split("=", 1)[1]), env


@pytest.mark.parametrize("unit", ["fusionnet-broker.service", "fusionnet-compnode.service"])
def test_systemd_units_start_the_cli_with_valid_flags(unit: str, tmp_path: Path) -> None:
    argv, env = systemd_exec(DEPLOY / unit)
    assert argv[0] == "/opt/fusionnet/venv/bin/fusionnet"
    env.setdefault("FUSIONNET_INITIAL_PEERS", SAMPLE_PEER)
    expanded: list[str] = []
    for arg in argv[1:]:
        if arg.startswith("$"):
            expanded += shlex.split(env[arg[1:]])  # systemd splits an unbraced $VAR on whitespace
        else:
            expanded.append(arg)
    parse_fusionnet(expanded, unit)
    verifier = shutil.which("systemd-analyze")
    if verifier is None:
        return
    # systemd-analyze verify checks keys and values; it needs the ExecStart binary to exist.
    copy = tmp_path / unit
    copy.write_text((DEPLOY / unit).read_text().replace("/opt/fusionnet/venv/bin/fusionnet", "/bin/true"))
    out = run_tool(verifier, "verify", "--man=no", str(copy), cwd=tmp_path)
    problems = [line for line in (out.stdout + out.stderr).splitlines() if unit in line]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr


def test_compose_daemons_use_valid_flags_and_existing_files() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    checked = 0
    for name, svc in services.items():
        if svc.get("image", "").startswith("fusionnet"):
            command = svc["command"]
            if svc.get("entrypoint") == ["/bin/sh", "-c"]:
                script = command[0].replace("$$(cat /swarm/broker.addr)", SAMPLE_PEER)
                assert "exec fusionnet " in script, name
                argv = shlex.split(script.split("exec fusionnet ", 1)[1])
            else:
                argv = list(command)
            parse_fusionnet(argv, f"docker-compose service {name}")
            checked += 1
    assert checked >= 4  # broker, three compnodes, submit
    # Bind mounts of the monitoring services point at files in deploy/.
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
    # Prometheus scrapes the broker where compose runs its metrics endpoint.
    broker_cmd = services["broker"]["command"]
    port = broker_cmd[broker_cmd.index("--metrics-port") + 1]
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    broker_job = next(c for c in config["scrape_configs"] if c["job_name"] == "fusionnet-broker")
    assert broker_job["static_configs"][0]["targets"] == [f"broker:{port}"]
    # Grafana loads the dashboard from where provisioning looks for it.
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/fusionnet.yml").read_text())
    folder = provider["providers"][0]["options"]["path"]
    assert any(v.endswith(f"{folder}/fusionnet-dashboard.json:ro") for v in services["grafana"]["volumes"])


def test_dockerfile_copies_existing_paths() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert "download.pytorch.org/whl/cpu" in text  # never a CUDA torch build
    for line in text.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), f"Dockerfile copies missing {source}"


@pytest.mark.timeout(60)
def test_install_script_is_idempotent() -> None:
    script = REPO / "scripts" / "install-prometheus.sh"
    assert os.access(script, os.X_OK)
    assert run_tool("bash", "-n", str(script)).returncode == 0
    require_tool("prometheus")
    require_tool("promtool")
    out = run_tool(str(script))  # both installed: must not touch apt
    assert out.returncode == 0 and "already installed" in out.stdout, out.stdout + out.stderr
