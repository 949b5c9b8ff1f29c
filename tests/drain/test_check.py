"""`picker check`: the shipped config passes; each broken variant of it is reported by the right rule.

Variants are made by editing the parsed YAML of config/k8s and of the rendered Envoy config, then
written to a temporary directory and checked like a user's files.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from picker.cli.envoyconf import EnvoyParams, render
from picker.cli.main import main as cli_main
from picker.drain.check import check_paths
from picker.drain.rules import RULES, Budget, Report, Severity
from tests.drain.autoscale_variants import AUTOSCALE_VARIANTS
from tests.drain.pool_variants import POOL_VARIANTS

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "config" / "k8s"
ENVOY_TEMPLATE = ROOT / "config" / "envoy.yaml"


def rendered_envoy() -> str:
    params = EnvoyParams(listen_port=8080, admin_port=9901, picker_port=9002, endpoints=["10.0.0.7:8000"])
    return render(params)


class Manifests:
    """The shipped manifests and rendered Envoy config, parsed, for a test to break."""

    def __init__(self) -> None:
        self.files = {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted(K8S.glob("*.yaml"))}
        self.envoy: dict[str, Any] = yaml.safe_load(rendered_envoy())
        self.extra: dict[str, str] = {}

    def obj(self, kind: str, name: str | None = None) -> dict[str, Any]:
        for docs in self.files.values():
            for doc in docs:
                if doc and doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name):
                    return doc
        raise KeyError(kind)

    def remove(self, kind: str, name: str) -> None:
        for docs in self.files.values():
            docs[:] = [d for d in docs if not (d and d["kind"] == kind and d["metadata"]["name"] == name)]

    @property
    def model_server(self) -> dict[str, Any]:
        return self.obj("Deployment", "vllm-llama")

    @property
    def vllm(self) -> dict[str, Any]:
        return self.model_server["spec"]["template"]["spec"]["containers"][0]

    @property
    def picker_deployment(self) -> dict[str, Any]:
        return self.obj("Deployment", "vllm-llama-picker")

    @property
    def picker(self) -> dict[str, Any]:
        return self.picker_deployment["spec"]["template"]["spec"]["containers"][0]

    @property
    def hcm(self) -> dict[str, Any]:
        return self.envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
            "typed_config"
        ]

    @property
    def route(self) -> dict[str, Any]:
        return self.hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]

    @property
    def routing_filter(self) -> dict[str, Any]:
        return self.hcm["http_filters"][0]["typed_config"]

    @property
    def pool_cluster(self) -> dict[str, Any]:
        return next(c for c in self.envoy["static_resources"]["clusters"] if c["name"] == "pool")

    @property
    def picker_cluster(self) -> dict[str, Any]:
        return next(c for c in self.envoy["static_resources"]["clusters"] if c["name"] == "picker")

    def set_arg(self, container: dict[str, Any], flag: str, value: str | None) -> None:
        args = [a for a in container["args"] if not a.startswith(flag + "=")]
        container["args"] = args if value is None else [*args, f"{flag}={value}"]

    def set_prestop_arg(self, flag: str, value: str) -> None:
        command = self.vllm["lifecycle"]["preStop"]["exec"]["command"]
        command[:] = [*(a for a in command if not a.startswith(flag + "=")), f"{flag}={value}"]

    def write(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        for name, docs in self.files.items():
            (directory / name).write_text(yaml.safe_dump_all(docs, sort_keys=False))
        (directory / "envoy.yaml").write_text(yaml.safe_dump(self.envoy, sort_keys=False))
        for name, text in self.extra.items():
            (directory / name).write_text(text)
        return directory


def check(directory: Path) -> Report:
    report, _ = check_paths([directory], Budget())
    return report


def ids(report: Report, severity: Severity | None = None) -> set[str]:
    return {f.rule.id for f in report.findings if severity is None or f.rule.severity is severity}


def test_shipped_manifests_and_envoy_template_pass() -> None:
    report, documents = check_paths([K8S, ENVOY_TEMPLATE], Budget())
    assert documents >= 14
    assert ids(report, Severity.ERROR) == set(), report.findings
    assert ids(report, Severity.WARNING) == set(), report.findings
    # the template's placeholders are unknown values: rules that need them are skipped, and say so
    assert any(s.rule_id == "ENVOY-002" and "${STREAM_IDLE_TIMEOUT}" in s.reason for s in report.skipped)


def test_unbroken_copy_passes(tmp_path: Path) -> None:
    report = check(Manifests().write(tmp_path))
    assert ids(report) == set(), report.findings
    assert not report.skipped


Mutation = Callable[[Manifests], None]


def _set(node: dict[str, Any], key: str, value: Any) -> None:
    node[key] = value


def _drop(node: dict[str, Any], key: str) -> None:
    node.pop(key)


def _original_dst_pool(m: Manifests) -> None:
    """The pool cluster Envoy AI Gateway makes for a FailClose InferencePool (and kgateway for any)."""
    cluster = m.pool_cluster
    for key in ("load_assignment", "load_balancing_policy", "eds_cluster_config", "common_lb_config"):
        cluster.pop(key, None)
    cluster.update(
        type="ORIGINAL_DST",
        lb_policy="CLUSTER_PROVIDED",
        original_dst_lb_config={
            "use_http_header": True,
            "http_header_name": "x-gateway-destination-endpoint",
        },
    )


def _without_observer(m: Manifests) -> None:
    """No observer filter and no gRPC access log to the picker: nothing tells it how a response ended."""
    m.hcm["http_filters"] = [f for f in m.hcm["http_filters"] if "observer" not in f["name"]]
    m.hcm["access_log"] = [a for a in m.hcm.get("access_log", []) if "http_grpc" not in a["name"]]


def _canary_without_observer(m: Manifests) -> None:
    """A canary behind a config where no filter sees a response body (the access log stays)."""
    m.set_arg(m.picker, "--rollout-candidate", "v2")
    m.hcm["http_filters"] = [f for f in m.hcm["http_filters"] if "observer" not in f["name"]]


def _peers_without_credential(m: Manifests) -> None:
    m.picker["env"] = [e for e in m.picker["env"] if e["name"] != "PICKER_PEERS__SECRET"]


def _prefill_without_pulls_url(m: Manifests) -> None:
    m.model_server["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"] = "prefill"


def _admin_without_token(m: Manifests) -> None:
    m.picker["env"] = [e for e in m.picker["env"] if e["name"] != "PICKER_ADMIN__TOKEN"]


def _eds_with_health_checks(m: Manifests) -> None:
    cluster = m.pool_cluster
    cluster["type"] = "EDS"
    cluster["eds_cluster_config"] = {"eds_config": {"ads": {}}}
    cluster.pop("load_assignment", None)  # the shipped config is EDS already (without health checks)
    cluster.pop("ignore_health_on_host_removal", None)
    cluster["health_checks"] = [
        {"timeout": "1s", "interval": "1s", "unhealthy_threshold": 1, "healthy_threshold": 1,
         "http_health_check": {"path": "/health"}}
    ]  # fmt: skip


VARIANTS: list[tuple[str, str, Mutation]] = [
    ("INPUT-001", "a file that is not YAML", lambda m: m.extra.update({"broken.yaml": "a: [b\n"})),
    ("GRACE-001", "grace below the budget",
     lambda m: _set(m.model_server["spec"]["template"]["spec"], "terminationGracePeriodSeconds", 120)),
    ("GRACE-002", "picker grace below the model servers'",
     lambda m: _set(m.picker_deployment["spec"]["template"]["spec"], "terminationGracePeriodSeconds", 300)),
    ("GRACE-003", "picker drain shorter than the engines'",
     lambda m: m.set_arg(m.picker, "--drain-timeout", "100")),
    ("GRACE-004", "picker grace below its own drain",
     lambda m: _set(m.picker_deployment["spec"]["template"]["spec"], "terminationGracePeriodSeconds", 385)),
    ("VLLM-001", "no --shutdown-timeout", lambda m: m.set_arg(m.vllm, "--shutdown-timeout", None)),
    ("VLLM-002", "short --shutdown-timeout", lambda m: m.set_arg(m.vllm, "--shutdown-timeout", "60")),
    ("PRESTOP-001", "no preStop", lambda m: _drop(m.vllm, "lifecycle")),
    ("PRESTOP-002", "drain-wait flag typo", lambda m: m.set_prestop_arg("--deadline", "soon")),
    ("PRESTOP-003", "allowance past the deadline",
     lambda m: m.set_prestop_arg("--propagation-allowance", "90")),
    ("PRESTOP-004", "metrics on another port",
     lambda m: m.set_prestop_arg("--metrics-url", "http://127.0.0.1:8080/metrics")),
    ("PRESTOP-005", "a prefill replica without --pulls-url", _prefill_without_pulls_url),
    ("ADMIN-001", "admin port without a token", _admin_without_token),
    ("ADMIN-002", "metrics auth without the review grants",
     lambda m: m.picker["args"].append("--metrics-endpoint-auth=true")),
    ("PICKER-001", "one picker", lambda m: _set(m.picker_deployment["spec"], "replicas", 1)),
    ("PICKER-002", "readiness on the overall service",
     lambda m: _set(m.picker["readinessProbe"]["grpc"], "service", "")),
    ("PICKER-003", "liveness on readiness",
     lambda m: _set(m.picker["livenessProbe"]["grpc"], "service", "readiness")),
    ("ROLLOUT-001", "half the replicas at once",
     lambda m: _set(m.model_server["spec"]["strategy"]["rollingUpdate"], "maxUnavailable", 2)),
    ("ROLLOUT-002", "a rollout that cannot move",
     lambda m: _set(m.model_server["spec"]["strategy"], "rollingUpdate",
                    {"maxSurge": 0, "maxUnavailable": 0})),
    ("ROLLOUT-003", "Recreate", lambda m: _set(m.model_server["spec"], "strategy", {"type": "Recreate"})),
    ("PDB-001", "no model-server PDB", lambda m: m.remove("PodDisruptionBudget", "vllm-llama")),
    ("PDB-002", "no picker PDB", lambda m: m.remove("PodDisruptionBudget", "vllm-llama-picker")),
    ("PDB-003", "a PDB that blocks drains",
     lambda m: _set(m.obj("PodDisruptionBudget", "vllm-llama")["spec"], "maxUnavailable", 0)),
    ("PROBE-001", "liveness without a startupProbe", lambda m: _drop(m.vllm, "startupProbe")),
    ("PROBE-002", "a short startupProbe", lambda m: _set(m.vllm["startupProbe"], "failureThreshold", 3)),
    ("PROBE-003", "no readinessProbe", lambda m: _drop(m.vllm, "readinessProbe")),
    ("POOL-001", "v1alpha2 pool fields",
     lambda m: _set(m.obj("InferencePool")["spec"], "extensionRef", {"name": "vllm-llama-picker"})),
    ("POOL-002", "pool selects nothing",
     lambda m: _set(m.obj("InferencePool")["spec"], "selector", {"matchLabels": {"app": "other"}})),
    ("POOL-003", "picker Service missing",
     lambda m: _set(m.obj("InferencePool")["spec"]["endpointPickerRef"], "name", "missing")),
    ("POOL-004", "pool targets another port",
     lambda m: _set(m.obj("InferencePool")["spec"], "targetPorts", [{"number": 8001}])),
    ("ROUTE-001", "route timeout 30s",
     lambda m: _set(m.obj("HTTPRoute")["spec"]["rules"][0], "timeouts", {"request": "30s"})),
    ("ROUTE-002", "route timeout left out",
     lambda m: _drop(m.obj("HTTPRoute")["spec"]["rules"][0], "timeouts")),
    ("ENVOY-001", "Envoy's default route timeout", lambda m: _drop(m.route, "timeout")),
    ("ENVOY-002", "short stream_idle_timeout", lambda m: _set(m.hcm, "stream_idle_timeout", "30s")),
    ("ENVOY-003", "default circuit breakers", lambda m: _drop(m.pool_cluster, "circuit_breakers")),
    ("ENVOY-004", "retries on 5xx",
     lambda m: _set(m.route["retry_policy"], "retry_on", "5xx,connect-failure")),
    ("ENVOY-005", "no receiving namespace",
     lambda m: _drop(m.routing_filter["metadata_options"], "receiving_namespaces")),
    ("ENVOY-006", "forged header kept", lambda m: _drop(m.hcm, "early_header_mutation_extensions")),
    ("ENVOY-007", "FULL_DUPLEX_STREAMED",
     lambda m: _set(m.routing_filter["processing_mode"], "response_body_mode", "FULL_DUPLEX_STREAMED")),
    ("ENVOY-008", "STREAMED",
     lambda m: _set(m.routing_filter["processing_mode"], "response_body_mode", "STREAMED")),
    ("ENVOY-009", "EDS with health checks", _eds_with_health_checks),
    ("ENVOY-010", "pool fails open, Envoy closed",
     lambda m: _set(m.obj("InferencePool")["spec"]["endpointPickerRef"], "failureMode", "FailOpen")),
    ("ENVOY-011", "body not buffered",
     lambda m: _set(m.routing_filter["processing_mode"], "request_body_mode", "STREAMED")),
    ("ENVOY-012", "ORIGINAL_DST pool on the header", _original_dst_pool),
    ("ENVOY-013", "FULL_DUPLEX without trailers",
     lambda m: m.routing_filter["processing_mode"].update(
         request_body_mode="FULL_DUPLEX_STREAMED", request_trailer_mode="SKIP")),
    ("ENVOY-014", "no observer, no gRPC access log, response body NONE",
     _without_observer),
    ("ROLLOUT-004", "canary, no filter sees response bodies", _canary_without_observer),
    ("PICKER-004", "peers without their credential", _peers_without_credential),
    ("ENVOY-015", "failClose without the contract reply",
     lambda m: m.hcm.pop("local_reply_config")),
    ("ENVOY-016", "default picker-cluster circuit breakers",
     lambda m: _drop(m.picker_cluster, "circuit_breakers")),
    *POOL_VARIANTS,  # the picker's own source vs its pool: tests/drain/test_pool_wiring.py
    *AUTOSCALE_VARIANTS,  # config/k8s/autoscaling: tests/drain/test_autoscaling.py
]  # fmt: skip


# Breaking one thing sometimes breaks a second rule too, by design (nothing else may fire).
ALSO_REPORTED = {"GRACE-002": {"GRACE-004"}, "PICKER-001": {"PDB-003"}, "ENVOY-007": {"ENVOY-013"}}


def test_every_rule_has_a_broken_variant() -> None:
    assert {rule_id for rule_id, _, _ in VARIANTS} == set(RULES)


@pytest.mark.parametrize(
    ("rule_id", "mutate"), [(v[0], v[2]) for v in VARIANTS], ids=[v[1] for v in VARIANTS]
)
def test_broken_variant_is_reported(tmp_path: Path, rule_id: str, mutate: Mutation) -> None:
    manifests = Manifests()
    mutate(manifests)
    report = check(manifests.write(tmp_path))
    found = [f for f in report.findings if f.rule.id == rule_id]
    assert found, f"{rule_id} not reported; got {sorted(ids(report))}"
    assert ids(report) - {rule_id} <= ALSO_REPORTED.get(rule_id, set()), sorted(ids(report))
    finding = found[0]
    assert finding.rule.severity is RULES[rule_id].severity
    assert finding.file.startswith(str(tmp_path))
    assert finding.message and finding.rule.why


def test_finding_names_file_line_and_field(tmp_path: Path) -> None:
    manifests = Manifests()
    manifests.model_server["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 100
    report = check(manifests.write(tmp_path))
    (finding,) = [f for f in report.findings if f.rule.id == "GRACE-001"]
    assert finding.obj == "Deployment/vllm-llama"
    assert finding.field == "spec.template.spec.terminationGracePeriodSeconds"
    assert finding.line is not None
    line = Path(finding.file).read_text().splitlines()[finding.line - 1]
    assert "terminationGracePeriodSeconds: 100" in line
    assert "100 < preStop 60 + engine drain 300 + margin 10 = 370" in finding.message


def test_budget_flags_change_the_verdict(tmp_path: Path) -> None:
    directory = Manifests().write(tmp_path)
    report, _ = check_paths([directory], Budget(longest_stream_s=900, expected_concurrent_streams=200_000))
    assert {"VLLM-002", "ENVOY-003"} <= ids(report)


def _picker_max_requests(m: Manifests, value: int | str) -> None:
    m.picker_cluster["circuit_breakers"] = {"thresholds": [{"max_requests": value}]}


def test_picker_cluster_needs_one_request_per_ext_proc_filter(tmp_path: Path) -> None:
    """Routing filter + observer: two gRPC streams per request, so 6000 < 4096 x 2 is reported."""
    manifests = Manifests()
    _picker_max_requests(manifests, 6000)
    report = check(manifests.write(tmp_path / "two"))
    (finding,) = [f for f in report.findings if f.rule.id == "ENVOY-016"]
    assert "max_requests 6000 < --expected-concurrent-streams 4096 x 2" in finding.message
    assert finding.field.endswith("circuit_breakers")
    line = Path(finding.file).read_text().splitlines()[finding.line - 1]
    assert "circuit_breakers" in line
    report, _ = check_paths([manifests.write(tmp_path / "fewer")], Budget(expected_concurrent_streams=3000))
    assert "ENVOY-016" not in ids(report)


def test_picker_cluster_placeholder_is_skipped(tmp_path: Path) -> None:
    manifests = Manifests()
    _picker_max_requests(manifests, "${PICKER_MAX_REQUESTS}")
    report = check(manifests.write(tmp_path))
    assert "ENVOY-016" not in ids(report)
    assert any(s.rule_id == "ENVOY-016" and "${PICKER_MAX_REQUESTS}" in s.reason for s in report.skipped)


def test_cli_text_json_and_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as passed:
        cli_main(["check", str(K8S), str(ENVOY_TEMPLATE)])
    assert passed.value.code == 0
    assert "0 errors" in capsys.readouterr().out

    manifests = Manifests()
    manifests.set_arg(manifests.vllm, "--shutdown-timeout", None)
    directory = manifests.write(tmp_path)
    with pytest.raises(SystemExit) as failed:
        cli_main(["check", "--json", str(directory)])
    assert failed.value.code == 1
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["errors"] >= 1
    vllm = next(f for f in report["findings"] if f["rule"] == "VLLM-001")
    assert vllm["severity"] == "error" and vllm["field"].endswith("containers[0].args") and vllm["why"]


def test_fail_on_warning(tmp_path: Path) -> None:
    manifests = Manifests()
    manifests.picker_deployment["spec"]["replicas"] = 1  # a warning only
    directory = manifests.write(tmp_path)
    for fail_on, code in (("error", 0), ("warning", 1)):
        with pytest.raises(SystemExit) as exited:
            cli_main(["check", "--fail-on", fail_on, str(directory)])
        assert exited.value.code == code


def test_missing_path_is_an_input_error(tmp_path: Path) -> None:
    report, _ = check_paths([tmp_path / "nope"], Budget())
    assert ids(report) == {"INPUT-001"}


def test_a_model_server_without_prestop_fails_the_check(tmp_path: Path) -> None:
    """A vLLM pod with no drain hook is the failure this project exists for: an error, exit 1."""
    manifests = Manifests()
    _drop(manifests.vllm, "lifecycle")
    directory = manifests.write(tmp_path)
    report, _ = check_paths([directory], Budget())
    (finding,) = [f for f in report.findings if f.rule.id == "PRESTOP-001"]
    assert finding.rule.severity is Severity.ERROR
    for fail_on in ("error", "warning"):
        with pytest.raises(SystemExit) as exited:
            cli_main(["check", "--fail-on", fail_on, str(directory)])
        assert exited.value.code == 1
