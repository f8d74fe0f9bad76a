"""The deploy/ files as data, for the deploy tests and the live Prometheus test (no tests here)."""

from __future__ import annotations

import json

import yaml

from tests.jobfiles import REPO

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "fusionnet-dashboard.json"


def alert_rules() -> list[dict]:
    doc = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
