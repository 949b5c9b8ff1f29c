"""Rules over how the Kubernetes objects fit together: rollouts, disruption budgets, and the
InferencePool / HTTPRoute / Gateway wiring (structure and references), including which pods the
picker itself reads: the pool its --pool-name names, or the Service its --kube-service names."""

from __future__ import annotations

from picker.drain import crds, rbac_rules
from picker.drain.k8s_rules import Inputs
from picker.drain.manifests import Document, Unknown, get
from picker.drain.rules import Budget, Report
from picker.drain.workloads import Container, Workload, int_or_percent, selector_matches, workloads


def check_rollouts(inputs: Inputs, report: Report) -> None:
    for workload in [*inputs.model_servers, *inputs.pickers]:
        doc, replicas = workload.doc, workload.replicas
        if doc.kind == "Deployment":
            strategy = get(doc.data, ("spec", "strategy"), {}) or {}
            if strategy.get("type") == "Recreate":
                report.add("ROLLOUT-003", doc, ("spec", "strategy", "type"), "strategy Recreate")
                continue
            rolling = strategy.get("rollingUpdate") or {}
            surge = int_or_percent(rolling.get("maxSurge", "25%"), replicas, round_up=True)
            unavailable = int_or_percent(rolling.get("maxUnavailable", "25%"), replicas, round_up=False)
            path = ("spec", "strategy", "rollingUpdate", "maxUnavailable")
        elif doc.kind == "StatefulSet":
            strategy = get(doc.data, ("spec", "updateStrategy"), {}) or {}
            if strategy.get("type") == "OnDelete":
                continue
            surge = 0  # a StatefulSet replaces pods in place
            unavailable = int_or_percent(
                get(strategy, ("rollingUpdate", "maxUnavailable"), 1), replicas, False
            )
            path = ("spec", "updateStrategy", "rollingUpdate", "maxUnavailable")
        else:
            continue
        if surge is None or unavailable is None:
            report.skip("ROLLOUT-001", doc, "maxSurge / maxUnavailable not understood")
            continue
        if surge == 0 and unavailable == 0 and doc.kind == "Deployment":
            report.add("ROLLOUT-002", doc, path, "maxSurge 0 and maxUnavailable 0")
        elif unavailable > 0 and unavailable / max(replicas, 1) > 0.25:
            share = min(unavailable, replicas) / max(replicas, 1)
            report.add(
                "ROLLOUT-001",
                doc,
                path,
                f"maxUnavailable takes {min(unavailable, replicas)} of {replicas} replicas "
                f"({share:.0%}) out at once",
            )


def _blocks_all(pdb: Document, replicas: int) -> bool:
    spec = get(pdb.data, ("spec",), {}) or {}
    if "maxUnavailable" in spec:
        return int_or_percent(spec["maxUnavailable"], replicas, round_up=True) == 0
    if "minAvailable" in spec:
        minimum = int_or_percent(spec["minAvailable"], replicas, round_up=True)
        return minimum is not None and minimum >= replicas
    return False


def check_disruption_budgets(inputs: Inputs, report: Report) -> None:
    pdbs = inputs.of_kind("PodDisruptionBudget")
    for role, rule_id, group in (
        ("model-server", "PDB-001", inputs.model_servers),
        ("picker", "PDB-002", inputs.pickers),
    ):
        for workload in group:
            covering = [
                p
                for p in pdbs
                if p.namespace == workload.doc.namespace
                and selector_matches(get(p.data, ("spec", "selector")), workload.pod_labels)
            ]
            if not covering:
                report.add(
                    rule_id,
                    workload.doc,
                    ("metadata", "name"),
                    f"no PodDisruptionBudget selects these {role} pods",
                )
            for pdb in covering:
                if _blocks_all(pdb, workload.replicas):
                    report.add("PDB-003", pdb, ("spec",), f"allows no eviction of {workload.doc.label}")


def check_pool_wiring(inputs: Inputs, report: Report, budget: Budget) -> None:
    for doc in inputs.documents:
        if doc.is_kubernetes and doc.kind in crds.CHECKED_KINDS and doc.kind != "ScaledObject":
            for path, problem in crds.structural_problems(doc.data):
                report.add("POOL-001", doc, path, problem)
    for pool in inputs.of_kind("InferencePool"):
        selector = get(pool.data, ("spec", "selector"))
        members = [
            w
            for w in workloads(inputs.documents)
            if w.doc.namespace == pool.namespace and selector_matches(selector, w.pod_labels)
        ]
        if not members:
            report.add(
                "POOL-002", pool, ("spec", "selector"), "no Deployment/StatefulSet pod template matches"
            )
        target = get(pool.data, ("spec", "targetPorts", 0, "number"))
        mismatched = False
        for container in (c for w in members for c in w.vllm_containers()):
            port = container.flag("--port")
            serving = (
                8000 if port is None else (int(port) if isinstance(port, str) and port.isdigit() else None)
            )
            if isinstance(target, int) and serving is not None and target != serving:
                mismatched = True
                report.add(
                    "POOL-004",
                    pool,
                    ("spec", "targetPorts", 0, "number"),
                    f"targetPorts {target}, but {container.doc.label} runs vLLM on port {serving}",
                )
        _check_target_ports(pool, members, report, skip_first=mismatched)
        ref_name = get(pool.data, ("spec", "endpointPickerRef", "name"))
        ref_port = get(pool.data, ("spec", "endpointPickerRef", "port", "number"))
        if get(pool.data, ("spec", "endpointPickerRef", "kind"), "Service") == "Service" and isinstance(
            ref_name, str
        ):
            service = inputs.service(ref_name, pool.namespace)
            ports = (
                [p.get("port") for p in get(service.data, ("spec", "ports"), []) or [] if isinstance(p, dict)]
                if service
                else []
            )
            if service is None or (isinstance(ref_port, int) and ref_port not in ports):
                report.add(
                    "POOL-003",
                    pool,
                    ("spec", "endpointPickerRef"),
                    f"no Service {ref_name!r} with port {ref_port} in namespace {pool.namespace}",
                )
    _check_routes(inputs, report, budget)
    _check_picker_sources(inputs, report)


def _declared_ports(workload: Workload) -> set[int]:
    return {
        port["containerPort"]
        for container in workload.containers
        for port in container.data.get("ports") or []
        if isinstance(port, dict) and isinstance(port.get("containerPort"), int)
    }


def _check_target_ports(pool: Document, members: list[Workload], report: Report, skip_first: bool) -> None:
    """Every targetPorts number is a port the pool's pods declare (when their templates declare any)."""
    listed = get(pool.data, ("spec", "targetPorts"), []) or []
    for workload in members:
        declared = _declared_ports(workload)
        if not declared:
            continue
        for index, entry in enumerate(listed):
            number = entry.get("number") if isinstance(entry, dict) else None
            if not isinstance(number, int) or number in declared or (index == 0 and skip_first):
                continue
            report.add(
                "POOL-007",
                pool,
                ("spec", "targetPorts", index, "number"),
                f"targetPorts {number}, but {workload.doc.label} declares only "
                f"{', '.join(map(str, sorted(declared)))}",
            )


def _literal(value: str | Unknown | None) -> str | None:
    return value if isinstance(value, str) and value else None


def _routing_pools(inputs: Inputs, picker: Workload) -> list[Document]:
    """The InferencePools whose endpointPickerRef Service selects this picker's pods."""
    found = []
    for pool in inputs.of_kind("InferencePool"):
        service = inputs.service(
            str(get(pool.data, ("spec", "endpointPickerRef", "name"), "")), pool.namespace
        )
        if (
            service is not None
            and service.namespace == picker.doc.namespace
            and selector_matches(get(service.data, ("spec", "selector")), picker.pod_labels, True)
        ):
            found.append(pool)
    return found


def _check_picker_replicas(inputs: Inputs, report: Report) -> None:
    """More than one picker replica: they share their books (peers) or only one is active."""
    for picker in inputs.pickers:
        if picker.replicas < 2:
            continue
        for container in picker.picker_containers():
            if not container.has_flag("--peers", "--peers-service", "--ha-enable-leader-election"):
                report.add(
                    "POOL-009",
                    picker.doc,
                    ("spec", "replicas"),
                    f"{picker.replicas} replicas without --peers-service, --peers or "
                    "--ha-enable-leader-election: each keeps its own books",
                )


def _check_admin_token(inputs: Inputs, report: Report) -> None:
    """A picker whose admin port takes changes from loopback callers without a token."""
    for picker in inputs.pickers:
        for container in picker.picker_containers():
            env = {item.get("name") for item in container.data.get("env") or [] if isinstance(item, dict)}
            sourced = any(isinstance(source, dict) for source in container.data.get("envFrom") or [])
            if not container.has_flag("--admin-token") and "PICKER_ADMIN__TOKEN" not in env and not sourced:
                report.add(
                    "ADMIN-001",
                    picker.doc,
                    container.path,
                    f"container {container.name}: no --admin-token or PICKER_ADMIN__TOKEN",
                )


def _check_picker_sources(inputs: Inputs, report: Report) -> None:
    """The pods a picker reads (its --pool-name, or its --kube-service) are the pods of the pool that
    routes to it."""
    for picker in inputs.pickers:
        routing = _routing_pools(inputs, picker)
        for container in picker.picker_containers():
            # $(POD_NAMESPACE) and other fieldRef values: the picker's own namespace
            namespace = (
                _literal(container.flag("--pool-namespace", "--kube-namespace")) or picker.doc.namespace
            )
            pool_name = _literal(container.flag("--pool-name"))
            service_name = _literal(container.flag("--kube-service"))
            if pool_name is not None:
                _check_pool_name(inputs, report, container, pool_name, namespace, routing)
            elif service_name is not None:
                _check_kube_service(inputs, report, container, service_name, namespace, routing)


def _check_pool_name(
    inputs: Inputs,
    report: Report,
    container: Container,
    name: str,
    namespace: str,
    routing: list[Document],
) -> None:
    named = [p for p in inputs.of_kind("InferencePool") if (p.name, p.namespace) == (name, namespace)]
    if not named:
        report.add(
            "POOL-003",
            container.doc,
            container.args_path,
            f"--pool-name {name}: no InferencePool {name!r} in namespace {namespace}",
        )
        return
    for pool in routing:
        if (pool.name, pool.namespace) != (name, namespace):
            report.add(
                "POOL-005",
                pool,
                ("spec", "endpointPickerRef", "name"),
                f"{pool.label} routes through the picker {container.doc.label}, which serves "
                f"--pool-name {name} (namespace {namespace})",
            )


def _check_kube_service(
    inputs: Inputs,
    report: Report,
    container: Container,
    name: str,
    namespace: str,
    routing: list[Document],
) -> None:
    service = inputs.service(name, namespace)
    if service is None:
        report.add(
            "POOL-003",
            container.doc,
            container.args_path,
            f"--kube-service {name}: no Service {name!r} in namespace {namespace}",
        )
        return
    service_selector = get(service.data, ("spec", "selector"), {}) or {}
    for pool in routing:
        pool_selector = get(pool.data, ("spec", "selector", "matchLabels"), {}) or {}
        if service_selector != pool_selector:
            report.add(
                "POOL-006",
                service,
                ("spec", "selector"),
                f"the picker {container.doc.label} reads Service {name} (selector {service_selector}), "
                f"but {pool.label} selects {pool_selector}",
            )


def _check_routes(inputs: Inputs, report: Report, budget: Budget) -> None:
    pools = {(p.namespace, p.name) for p in inputs.of_kind("InferencePool")}
    gateways = {(g.namespace, g.name) for g in inputs.of_kind("Gateway")}
    for route in inputs.of_kind("HTTPRoute"):
        for i, parent in enumerate(get(route.data, ("spec", "parentRefs"), []) or []):
            if isinstance(parent, dict) and parent.get("kind", "Gateway") == "Gateway":
                key = (str(parent.get("namespace") or route.namespace), str(parent.get("name")))
                if key not in gateways:
                    report.add(
                        "POOL-003", route, ("spec", "parentRefs", i), f"no Gateway {key[1]!r} in {key[0]}"
                    )
        for i, rule in enumerate(get(route.data, ("spec", "rules"), []) or []):
            if not isinstance(rule, dict):
                continue
            to_pool = False
            for j, ref in enumerate(rule.get("backendRefs") or []):
                if isinstance(ref, dict) and ref.get("kind") == "InferencePool":
                    to_pool = True
                    key = (str(ref.get("namespace") or route.namespace), str(ref.get("name")))
                    if key not in pools:
                        report.add(
                            "POOL-003",
                            route,
                            ("spec", "rules", i, "backendRefs", j),
                            f"no InferencePool {key[1]!r} in {key[0]}",
                        )
            timeouts = rule.get("timeouts") if isinstance(rule.get("timeouts"), dict) else {}
            if to_pool and not timeouts.get("request"):
                report.add(
                    "ROUTE-002",
                    route,
                    ("spec", "rules", i),
                    "no timeouts.request on a rule to an InferencePool",
                )
            for key in ("request", "backendRequest"):
                value = crds.gateway_duration(timeouts.get(key, ""))
                if value is not None and 0 < value < budget.longest_stream_s:
                    report.add(
                        "ROUTE-001",
                        route,
                        ("spec", "rules", i, "timeouts", key),
                        f"timeouts.{key} {timeouts[key]} < longest stream {budget.longest_stream_s:g} s",
                    )


def check(inputs: Inputs, report: Report, budget: Budget) -> None:
    """Every wiring rule over the classified inputs."""
    check_rollouts(inputs, report)
    check_disruption_budgets(inputs, report)
    check_pool_wiring(inputs, report, budget)
    _check_picker_replicas(inputs, report)
    _check_admin_token(inputs, report)
    rbac_rules.check(inputs, report)
