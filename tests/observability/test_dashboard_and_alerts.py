"""The Grafana dashboard and the Prometheus alert rules under config/observability/ name only metrics,
and label values, that the picker really exports; the committed dashboard JSON is what its generator
builds; promtool accepts the rules and their unit tests pass (skipped, with the reason, without it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest import http_client
from loadtest.procs import Proc, free_port
from loadtest.stack import serve_argv
from picker.contract import Outcome
from picker.pool import DrainEnd, DrainExit, EndpointState
from picker.streams import EndReason

CONFIG = Path(__file__).resolve().parents[2] / "config" / "observability"
DASHBOARD = CONFIG / "picker-dashboard.json"
RULES = CONFIG / "picker-alerts.yaml"
RULE_TESTS = CONFIG / "picker-alerts.test.yaml"
# Series Prometheus itself makes: not the picker's to export.
PROMETHEUS_OWN = {"up"}
# Label values the queries match on, and the closed sets they come from.
LABEL_VALUES: dict[str, type[Enum]] = {
    "outcome": Outcome,
    "end": DrainEnd,
    "exit": DrainExit,
    "state": EndpointState,
    "reason": EndReason,
}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def dashboard_exprs() -> list[str]:
    def walk(node: object) -> Iterator[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    yield value
                else:
                    yield from walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)

    return list(walk(json.loads(DASHBOARD.read_text())))


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [str(rule["expr"]) for group in groups for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    """Identifiers that are metric names: picker_* ones and Prometheus' own (`up`) before a selector."""
    names = set(re.findall(r"\bpicker_[a-z0-9_]+", expr))
    names |= {n for n in re.findall(r"\b([a-z_]+)\s*\{", expr) if n in PROMETHEUS_OWN}
    return names


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every series name on a real picker's /metrics page (one endpoint, nothing listening there)."""
    metrics_port = free_port()
    argv = serve_argv(free_port(), free_port(), metrics_port, "--endpoints", f"127.0.0.1:{free_port()}")
    with tempfile.TemporaryDirectory() as tmp:
        picker = Proc("picker", argv, Path(tmp) / "picker.log")
        try:
            picker.wait_ready(lambda: "picker ready" in picker.log_text())
            text = http_client.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        finally:
            picker.stop()
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


@pytest.mark.parametrize("where", ["dashboard", "rules"])
def test_every_metric_named_is_exported_by_the_picker(exported: set[str], where: str) -> None:
    exprs = dashboard_exprs() if where == "dashboard" else rule_exprs()
    used = set().union(*(metric_names(e) for e in exprs))
    assert len(exprs) >= 7 and len(used) >= 6
    missing = sorted(n for n in used - PROMETHEUS_OWN if n not in exported)
    assert missing == [], f"{where} uses metrics the picker does not export: {missing}"


@pytest.mark.parametrize("where", ["dashboard", "rules"])
def test_every_label_value_matched_is_one_the_picker_uses(where: str) -> None:
    exprs = dashboard_exprs() if where == "dashboard" else rule_exprs()
    checked = 0
    for expr in exprs:
        for label, op, value in re.findall(r'\b([a-z_]+)\s*(=~|!~|!=|=)\s*"([^"]*)"', expr):
            if label not in LABEL_VALUES:
                continue
            known = {member.value for member in LABEL_VALUES[label]}
            wanted = value.split("|") if op in ("=~", "!~") else [value]
            assert set(wanted) <= known, f"{expr}: {label} values {set(wanted) - known} are not in {known}"
            checked += 1
    assert checked >= 2


def test_the_committed_dashboard_is_what_the_generator_builds() -> None:
    script = CONFIG / "build_dashboard.py"
    done = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    board = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in board["panels"]}
    ids = [p["id"] for p in board["panels"]]
    assert len(set(ids)) == len(ids) and all(ids)
    for row in ("Endpoints", "Drains", "Streams", "Admission queue", "Latency", "Model server scrapes"):
        assert row in titles


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return path


def test_promtool_accepts_the_rules() -> None:
    done = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_alerts_fire_on_their_unit_test_series() -> None:
    done = subprocess.run(
        [_promtool(), "test", "rules", RULE_TESTS.name],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=CONFIG,
    )
    assert done.returncode == 0, done.stdout + done.stderr
