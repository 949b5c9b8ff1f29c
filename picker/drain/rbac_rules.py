"""The picker's RBAC against what its endpoint source reads: a missing grant is a picker that gets
403 on every list and never learns of an endpoint (or of a drain).

What each source reads (list and watch, in its namespace): --pool-name: pods, inferencepools and,
unless --no-objectives, inferenceobjectives; --kube-service / --kube-label-selector: endpointslices.
--drains-configmap NAME (admin drains shared between replicas) reads and writes that one ConfigMap:
get/list/watch/update (a rule's resourceNames, if any, must include NAME) and create (which
resourceNames cannot grant: Kubernetes authorizes a create before the object has a name).
The grants are followed from the pod's service account through RoleBindings and ClusterRoleBindings
in the inputs to their Roles and ClusterRoles; with no binding for that account in the inputs at all
(RBAC kept elsewhere) nothing is reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from picker.drain.k8s_rules import Inputs
from picker.drain.manifests import Document, get
from picker.drain.rules import Report
from picker.drain.workloads import Container, Workload

POOL_READS = (("", "pods"), ("inference.networking.k8s.io", "inferencepools"))
OBJECTIVE_READS = (("inference.networking.x-k8s.io", "inferenceobjectives"),)
SLICE_READS = (("discovery.k8s.io", "endpointslices"),)
VERBS = ("list", "watch")
DRAIN_RECORD_VERBS = ("get", "list", "watch", "create", "update")


@dataclass(frozen=True)
class _Need:
    group: str
    resource: str
    verbs: tuple[str, ...]
    name: str | None = None  # one object: rules limited by resourceNames must name it
    why: str = "reads"


def _needs(container: Container) -> list[_Need]:
    reads: tuple[tuple[str, str], ...] = ()
    if container.has_flag("--pool-name"):
        reads = POOL_READS + (() if container.has_flag("--no-objectives") else OBJECTIVE_READS)
    elif container.has_flag("--kube-service", "--kube-label-selector"):
        reads = SLICE_READS
    needs = [_Need(group, resource, VERBS) for group, resource in reads]
    drains = container.flag("--drains-configmap")
    if drains is not None:
        name = drains if isinstance(drains, str) and drains else None  # unknown: any name will do
        needs.append(_Need("", "configmaps", DRAIN_RECORD_VERBS, name, "shares admin drains through"))
    return needs


def _bound_roles(inputs: Inputs, account: str, namespace: str) -> list[Document] | None:
    """The Roles / ClusterRoles bound to the service account; None when no binding names it."""
    roles: list[Document] = []
    bound = False
    for binding in [*inputs.of_kind("RoleBinding"), *inputs.of_kind("ClusterRoleBinding")]:
        subjects = get(binding.data, ("subjects",), []) or []
        if not any(
            isinstance(s, dict)
            and s.get("kind") == "ServiceAccount"
            and s.get("name") == account
            and (s.get("namespace") or binding.namespace) == namespace
            for s in subjects
        ):
            continue
        bound = True
        ref = get(binding.data, ("roleRef",), {}) or {}
        kind, name = ref.get("kind"), ref.get("name")
        roles += [
            r
            for r in inputs.of_kind(str(kind))
            if r.name == name and (kind == "ClusterRole" or r.namespace == binding.namespace)
        ]
    return roles if bound else None


def _grants(role: Document, need: _Need, verb: str) -> bool:
    def has(values: Any, wanted: str) -> bool:
        return isinstance(values, list) and ("*" in values or wanted in values)

    def names_ok(rule: dict[str, Any]) -> bool:
        names = rule.get("resourceNames")
        if not names:
            return True
        return verb != "create" and (need.name is None or need.name in names)

    return any(
        isinstance(rule, dict)
        and has(rule.get("apiGroups"), need.group)
        and has(rule.get("resources"), need.resource)
        and has(rule.get("verbs"), verb)
        and names_ok(rule)
        for rule in get(role.data, ("rules",), []) or []
    )


def _check_picker(inputs: Inputs, picker: Workload, report: Report) -> None:
    account = str(picker.pod_spec.get("serviceAccountName") or "default")
    roles = _bound_roles(inputs, account, picker.doc.namespace)
    if roles is None:
        return
    for container in picker.picker_containers():
        for need in _needs(container):
            missing = [v for v in need.verbs if not any(_grants(r, need, v) for r in roles)]
            if missing:
                where = ", ".join(r.label for r in roles) or "no Role found"
                what = f"{need.resource} ({need.group or 'core'})"
                if need.name is not None:
                    what = f"{need.resource} {need.name} ({need.group or 'core'})"
                report.add(
                    "POOL-008",
                    picker.doc,
                    (*container.path, "args"),
                    f"service account {account} ({where}) may not {'/'.join(missing)} "
                    f"{what}, which {container.name or 'the picker'} {need.why}",
                )


def check(inputs: Inputs, report: Report) -> None:
    for picker in inputs.pickers:
        _check_picker(inputs, picker, report)
