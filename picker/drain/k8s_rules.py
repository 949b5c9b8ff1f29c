"""Rules over Kubernetes manifests: the termination budget, vLLM flags, the picker, rollouts, PDBs,
probes and the InferencePool / HTTPRoute wiring."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field

from picker.drain.manifests import Document, Unknown, get
from picker.drain.rules import Budget, Report
from picker.drain.workloads import (
    Container,
    PreStop,
    Workload,
    prestop_of,
    probe_budget,
    seconds,
    selector_matches,
    workloads,
)
from picker.pool.roles import Role, role_of

SHUTDOWN_TIMEOUT = ("--shutdown-timeout", "--shutdown_timeout")
# "inference-extension": the name the reference charts probe (for liveness too: flagged below).
DRAINING_HEALTH_SERVICES = (
    "",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
    "inference-extension",
)
READINESS_HEALTH_SERVICES = ("readiness", "inference-extension")
DEFAULT_PICKER_DRAIN_S = 30.0  # picker/config/model.py ShutdownConfig.drain_timeout_s
DEFAULT_HEALTH_PORT = 9003


@dataclass
class Inputs:
    """The Kubernetes objects of one check, sorted by role."""

    documents: list[Document]
    model_servers: list[Workload] = field(default_factory=list)
    pickers: list[Workload] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[Document]:
        return [d for d in self.documents if d.is_kubernetes and d.kind == kind]

    def service(self, name: str, namespace: str) -> Document | None:
        return next((d for d in self.of_kind("Service") if d.name == name and d.namespace == namespace), None)


def classify(documents: list[Document]) -> Inputs:
    """Model servers run vLLM or are selected by an InferencePool; pickers run `picker serve` or back
    the Service an InferencePool names as its endpoint picker."""
    inputs = Inputs(documents)
    pools = inputs.of_kind("InferencePool")
    for workload in workloads(documents):
        labels, namespace = workload.pod_labels, workload.doc.namespace
        in_pool = any(
            p.namespace == namespace and selector_matches(get(p.data, ("spec", "selector")), labels)
            for p in pools
        )
        picker_services = [
            inputs.service(str(get(p.data, ("spec", "endpointPickerRef", "name"), "")), p.namespace)
            for p in pools
        ]
        behind_picker_service = any(
            s is not None
            and s.namespace == namespace
            and selector_matches(get(s.data, ("spec", "selector")), labels, True)
            for s in picker_services
        )
        if workload.picker_containers() or behind_picker_service:
            inputs.pickers.append(workload)
        elif workload.vllm_containers() or in_pool:
            inputs.model_servers.append(workload)
    return inputs


@dataclass(frozen=True)
class EngineBudget:
    """One model server's termination budget, when the manifests fix it."""

    workload: Workload
    prestop_s: float | None
    shutdown_s: float | None

    @property
    def drain_s(self) -> float | None:
        if self.prestop_s is None or self.shutdown_s is None:
            return None
        return self.prestop_s + self.shutdown_s


def _shutdown_timeout(container: Container, report: Report, budget: Budget) -> float | None:
    """--shutdown-timeout in seconds (0 when absent: abort mode); None when unknown. Fires VLLM-00x."""
    doc = container.doc
    value = container.flag(*SHUTDOWN_TIMEOUT)
    if isinstance(value, Unknown):
        report.skip("VLLM-001", doc, f"--shutdown-timeout: {value.why}")
        return None
    if value is None:
        if container.has_flag("--config"):
            report.skip("VLLM-001", doc, "--shutdown-timeout may be set in the --config file")
            return None
        report.add(
            "VLLM-001",
            doc,
            container.args_path,
            f"container {container.name!r} runs vLLM without --shutdown-timeout",
        )
        return 0.0
    number = seconds(value)
    if number is None or number <= 0:
        report.add(
            "VLLM-001",
            doc,
            container.args_path,
            f"--shutdown-timeout {value!r} is abort mode or not a number",
        )
        return 0.0
    if number < budget.longest_stream_s:
        report.add(
            "VLLM-002",
            doc,
            container.args_path,
            f"--shutdown-timeout {number:g} s < --longest-stream-s {budget.longest_stream_s:g}",
        )
    return number


def _check_prestop(container: Container, hook: PreStop, report: Report) -> None:
    doc = container.doc
    if hook.kind == "none":
        report.add(
            "PRESTOP-001", doc, (*container.path, "name"), f"container {container.name!r} has no preStop hook"
        )
        return
    if hook.wait_error is not None:
        report.add("PRESTOP-002", doc, hook.path, f"drain-wait: {hook.wait_error}")
    settings = hook.wait_settings
    if settings is None:
        return
    if settings.propagation_allowance_s >= settings.deadline_s:
        report.add(
            "PRESTOP-003",
            doc,
            hook.path,
            f"--propagation-allowance {settings.propagation_allowance_s:g} "
            f">= --deadline {settings.deadline_s:g}",
        )
    url = urllib.parse.urlsplit(settings.metrics_url)
    vllm_port = container.flag("--port")
    if isinstance(vllm_port, Unknown):
        return
    serving = int(vllm_port) if vllm_port is not None and vllm_port.isdigit() else 8000
    reading = url.port or (443 if url.scheme == "https" else 80)
    if url.hostname in ("127.0.0.1", "localhost", "::1") and reading != serving:
        report.add(
            "PRESTOP-004",
            doc,
            hook.path,
            f"drain-wait reads {settings.metrics_url}, vLLM serves port {serving}",
        )


def _check_probes(container: Container, report: Report, budget: Budget) -> None:
    doc, data = container.doc, container.data
    liveness, startup = data.get("livenessProbe"), data.get("startupProbe")
    if isinstance(liveness, dict) and not isinstance(startup, dict):
        allowed = probe_budget(liveness)
        if allowed < budget.model_load_s:
            report.add(
                "PROBE-001",
                doc,
                (*container.path, "livenessProbe"),
                f"no startupProbe; liveness fails a loading engine after {allowed:g} s "
                f"< model load {budget.model_load_s:g} s (--model-load-s)",
            )
    if isinstance(startup, dict) and probe_budget(startup) < budget.model_load_s:
        report.add(
            "PROBE-002",
            doc,
            (*container.path, "startupProbe"),
            f"startupProbe allows {probe_budget(startup):g} s < --model-load-s {budget.model_load_s:g}",
        )
    if not isinstance(data.get("readinessProbe"), dict):
        report.add(
            "PROBE-003", doc, (*container.path, "name"), f"container {container.name!r} has no readinessProbe"
        )


def check_model_servers(inputs: Inputs, report: Report, budget: Budget) -> list[EngineBudget]:
    budgets: list[EngineBudget] = []
    for workload in inputs.model_servers:
        doc = workload.doc
        engines = workload.vllm_containers()
        if not engines:
            report.skip("GRACE-001", doc, "no container recognisably runs vLLM")
            continue
        for container in engines:
            shutdown_s = _shutdown_timeout(container, report, budget)
            hook = prestop_of(container)
            _check_prestop(container, hook, report)
            settings = hook.wait_settings
            prefill = role_of(workload.pod_labels) is Role.PREFILL
            if prefill and settings is not None and not settings.pulls_url:
                report.add("PRESTOP-005", doc, hook.path, "a prefill replica's drain-wait has no --pulls-url")
            _check_probes(container, report, budget)
            budgets.append(EngineBudget(workload, hook.seconds, shutdown_s))
            if hook.seconds is None:
                report.skip("GRACE-001", doc, f"preStop duration unknown ({hook.detail or hook.kind})")
                continue
            if shutdown_s is None:
                report.skip("GRACE-001", doc, "--shutdown-timeout unknown")
                continue
            needed = hook.seconds + shutdown_s + budget.cleanup_margin_s
            if workload.grace_s < needed:
                report.add(
                    "GRACE-001",
                    doc,
                    workload.grace_path,
                    f"terminationGracePeriodSeconds {workload.grace_s:g} < preStop {hook.seconds:g} "
                    f"+ engine drain {shutdown_s:g} + margin {budget.cleanup_margin_s:g} = {needed:g} s",
                )
    return budgets


def _picker_drain_s(container: Container) -> float | Unknown:
    value = container.flag("--drain-timeout")
    if value is None:
        value = container.env("PICKER_SHUTDOWN__DRAIN_TIMEOUT_S")
    if value is None:
        if container.has_flag("--config"):
            return Unknown("the drain timeout may be set in the --config file")
        return DEFAULT_PICKER_DRAIN_S
    if isinstance(value, Unknown):
        return value
    number = seconds(value)
    return Unknown(f"--drain-timeout {value!r} is not a number") if number is None else number


def _check_picker_probes(container: Container, report: Report) -> None:
    doc = container.doc
    health_port = container.flag("--health-port")
    port = int(health_port) if isinstance(health_port, str) and health_port.isdigit() else DEFAULT_HEALTH_PORT
    readiness = get(container.data, ("readinessProbe", "grpc"))
    if (
        not isinstance(readiness, dict)
        or readiness.get("service") not in READINESS_HEALTH_SERVICES
        or readiness.get("port") != port
    ):
        report.add(
            "PICKER-002",
            doc,
            (*container.path, "readinessProbe"),
            f"expected readinessProbe.grpc {{port: {port}, service: readiness}}",
        )
    liveness = get(container.data, ("livenessProbe", "grpc"))
    if isinstance(liveness, dict) and str(liveness.get("service", "")) in DRAINING_HEALTH_SERVICES:
        report.add(
            "PICKER-003",
            doc,
            (*container.path, "livenessProbe", "grpc", "service"),
            f"liveness probes service {liveness.get('service', '')!r}; use 'liveness'",
        )


def _check_peer_credential(container: Container, report: Report) -> None:
    """PICKER-004: peers on, and no credential for them (or the loopback-only relaxation)."""
    words = container.argv
    if not any(
        w.startswith(("--peers=", "--peers-service=")) or w in ("--peers", "--peers-service") for w in words
    ):
        return
    env = {str(e.get("name")) for e in container.data.get("env") or [] if isinstance(e, dict)}
    has_file = any(w.startswith("--peer-secret-file") for w in words)
    relaxed = any(w.startswith("--peers-allow-unauthenticated") for w in words)
    if relaxed or not (has_file or "PICKER_PEERS__SECRET" in env):
        why = "--peers-allow-unauthenticated" if relaxed else "no PICKER_PEERS__SECRET, no --peer-secret-file"
        report.add("PICKER-004", container.doc, container.args_path, why)


def check_pickers(inputs: Inputs, engines: list[EngineBudget], report: Report, budget: Budget) -> None:
    engine_grace = max((e.workload.grace_s for e in engines), default=None)
    drains = [e for e in engines if e.drain_s is not None]
    longest_drain = max(drains, key=lambda e: e.drain_s or 0.0, default=None)
    for workload in inputs.pickers:
        doc = workload.doc
        if workload.replicas < 2:
            report.add("PICKER-001", doc, ("spec", "replicas"), f"replicas: {workload.replicas}")
        if engine_grace is not None and workload.grace_s < engine_grace:
            report.add(
                "GRACE-002",
                doc,
                workload.grace_path,
                f"picker grace {workload.grace_s:g} s < model-server grace {engine_grace:g} s",
            )
        for container in workload.picker_containers():
            _check_picker_probes(container, report)
            _check_peer_credential(container, report)
            drain_s = _picker_drain_s(container)
            if isinstance(drain_s, Unknown):
                report.skip("GRACE-003", doc, drain_s.why)
                continue
            if longest_drain is not None and drain_s < (longest_drain.drain_s or 0.0):
                report.add(
                    "GRACE-003",
                    doc,
                    container.args_path,
                    f"picker --drain-timeout {drain_s:g} s < {longest_drain.workload.doc.label} preStop + "
                    f"--shutdown-timeout = {longest_drain.drain_s:g} s",
                )
            needed = drain_s + budget.cleanup_margin_s
            if workload.grace_s < needed:
                report.add(
                    "GRACE-004",
                    doc,
                    workload.grace_path,
                    f"terminationGracePeriodSeconds {workload.grace_s:g} < --drain-timeout {drain_s:g} + "
                    f"margin {budget.cleanup_margin_s:g} = {needed:g} s",
                )


def check(documents: list[Document], report: Report, budget: Budget) -> Inputs:
    """Every Kubernetes rule; returns the classified inputs (the Envoy rules compare with the pools)."""
    inputs = classify(documents)
    engines = check_model_servers(inputs, report, budget)
    check_pickers(inputs, engines, report, budget)
    return inputs
