"""The shipped Kubernetes manifests are valid, and `picker check` reads what they (and others) say.

Core kinds are validated with kubernetes-validate (it ships the Kubernetes JSON schemas: no network).
No package ships the InferencePool / Gateway / HTTPRoute CRD schemas, so those go through
picker.drain.crds, a structural check of required fields and types (tested here both ways).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate.utils as kubernetes_validate
import pytest
import yaml

from picker.drain.crds import CHECKED_KINDS, gateway_duration, structural_problems
from picker.drain.manifests import Document, format_path, is_placeholder, parse_documents
from picker.drain.workloads import Container, prestop_of

K8S = Path(__file__).resolve().parents[2] / "config" / "k8s"
KUBERNETES_VERSION = "1.33"
CORE_KINDS = {"Deployment", "Service", "PodDisruptionBudget", "ServiceAccount", "Role", "RoleBinding"}


def shipped() -> list[dict[str, Any]]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_every_object_is_either_schema_validated_or_structurally_checked() -> None:
    kinds = {doc["kind"] for doc in shipped()}
    # the ScaledObject is the autoscaling overlay's (tests/drain/test_autoscaling.py)
    assert kinds - {"Kustomization"} == CORE_KINDS | (CHECKED_KINDS - {"ScaledObject"})


@pytest.mark.parametrize("doc", [d for d in shipped() if d["kind"] in CORE_KINDS], ids=lambda d: d["kind"])
def test_core_kinds_match_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_schema_validation_can_fail() -> None:
    deployment = next(d for d in shipped() if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 30  # typo: unknown field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("doc", [d for d in shipped() if d["kind"] in CHECKED_KINDS], ids=lambda d: d["kind"])
def test_gateway_api_objects_are_structurally_sound(doc: dict[str, Any]) -> None:
    assert structural_problems(doc) == []


def _pool() -> dict[str, Any]:
    return next(d for d in shipped() if d["kind"] == "InferencePool")


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        (lambda s: s.pop("targetPorts"), "spec.targetPorts", "required"),
        (lambda s: s.update(targetPorts=[]), "spec.targetPorts", "1 to 8"),
        (lambda s: s.update(targetPorts=[{"number": "8000"}]), "spec.targetPorts[0].number", "integer"),
        (lambda s: s.update(targetPorts=[{"number": 70000}]), "spec.targetPorts[0].number", "not a port"),
        (lambda s: s["selector"].update(matchLabels={}), "spec.selector.matchLabels", "every pod"),
        (lambda s: s["endpointPickerRef"].pop("port"), "spec.endpointPickerRef.port", "required"),
        (
            lambda s: s["endpointPickerRef"].update(failureMode="Open"),
            "spec.endpointPickerRef.failureMode",
            "one of",
        ),
        (lambda s: s.update(extensionRef={"name": "x"}), "spec", "v1alpha2"),
    ],
)
def test_inference_pool_problems(edit: Any, field: str, words: str) -> None:
    pool = _pool()
    edit(pool["spec"])
    problems = {format_path(path): message for path, message in structural_problems(pool)}
    assert field in problems, problems
    assert words in problems[field]


def test_route_and_gateway_problems() -> None:
    route = next(d for d in shipped() if d["kind"] == "HTTPRoute")
    rule = route["spec"]["rules"][0]
    rule["backendRefs"][0].pop("group")
    rule["timeouts"] = {"request": "ten minutes"}
    fields = {format_path(p) for p, _ in structural_problems(route)}
    assert fields == {"spec.rules[0].backendRefs[0].group", "spec.rules[0].timeouts.request"}
    gateway = next(d for d in shipped() if d["kind"] == "Gateway")
    gateway["spec"]["listeners"].append(dict(gateway["spec"]["listeners"][0]))
    gateway["spec"].pop("gatewayClassName")
    fields = {format_path(p) for p, _ in structural_problems(gateway)}
    assert fields == {"spec.gatewayClassName", "spec.listeners[1].name"}


def test_gateway_durations() -> None:
    assert gateway_duration("0s") == 0
    assert gateway_duration("1h30m") == 5400
    assert gateway_duration("500ms") == 0.5
    assert gateway_duration("10") is None


def test_template_placeholders_parse_as_unknown_values() -> None:
    text = "a: {b: ${ADDR}, c: ${PORT}}\nlist:\n- x:\n${LINES}\nd: '${QUOTED}'\n"
    (doc,) = parse_documents(text, Path("t.yaml"))
    assert is_placeholder(doc.data["a"]["b"]) and is_placeholder(doc.data["a"]["c"])
    assert doc.data["list"] == [{"x": None}]
    assert is_placeholder(doc.data["d"])
    assert doc.line_of(("d",)) == 5
    assert doc.line_of(("a", "c", "deeper")) == 1


def test_kind_list_is_expanded() -> None:
    text = "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Service\n  metadata: {name: s}\n"
    (doc,) = parse_documents(text, Path("list.yaml"))
    assert doc.label == "Service/s"
    assert doc.line_of(("metadata", "name")) == 6


def _container(lifecycle: dict[str, Any], args: list[str] | None = None) -> Container:
    data = {"name": "vllm", "lifecycle": lifecycle, "args": args or []}
    return Container(Document(Path("x.yaml"), 0, {}), ("spec", "containers", 0), data)


@pytest.mark.parametrize(
    ("hook", "kind", "seconds"),
    [
        ({"preStop": {"exec": {"command": ["picker", "drain-wait", "--deadline", "45"]}}}, "drain-wait", 45),
        ({"preStop": {"exec": {"command": ["python3", "/d/wait.py", "--deadline=30"]}}}, "drain-wait", 30),
        ({"preStop": {"exec": {"command": ["python3", "/d/wait.py"]}}}, "drain-wait", 60),  # its default
        (
            {"preStop": {"exec": {"command": ["sh", "-c", "sleep 5 && picker drain-wait --deadline 20"]}}},
            "drain-wait",
            25,
        ),
        ({"preStop": {"exec": {"command": ["/bin/sh", "-c", "sleep 1m; echo done"]}}}, "sleep", 60),
        ({"preStop": {"sleep": {"seconds": 15}}}, "sleep", 15),
        ({"preStop": {"httpGet": {"path": "/drain", "port": 8000}}}, "http", None),
        ({"preStop": {"exec": {"command": ["/drain.sh"]}}}, "other", None),
        ({}, "none", 0),
    ],
)
def test_prestop_allowance(hook: dict[str, Any], kind: str, seconds: float | None) -> None:
    prestop = prestop_of(_container(hook))
    assert (prestop.kind, prestop.seconds) == (kind, seconds)


def test_prestop_with_bad_drain_wait_flags() -> None:
    prestop = prestop_of(
        _container({"preStop": {"exec": {"command": ["picker", "drain-wait", "--deadlin", "9"]}}})
    )
    assert prestop.kind == "drain-wait" and prestop.seconds is None
    assert prestop.wait_error is not None and "--deadlin" in prestop.wait_error


def test_flags_in_shell_scripts_and_env_references() -> None:
    container = Container(
        Document(Path("x.yaml"), 0, {}),
        ("spec",),
        {
            "command": ["/bin/sh", "-c"],
            "args": ["exec vllm serve m --port $(PORT) --shutdown-timeout=$(DRAIN) --max-num-seqs 8"],
            "env": [{"name": "PORT", "value": "8100"}, {"name": "DRAIN", "valueFrom": {"fieldRef": {}}}],
        },
    )
    assert container.runs_vllm
    assert container.flag("--port") == "8100"
    assert container.flag("--max-num-seqs") == "8"
    assert container.flag("--missing") is None
    assert type(container.flag("--shutdown-timeout")).__name__ == "Unknown"
