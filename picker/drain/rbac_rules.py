"""The picker's RBAC against what its endpoint source reads: a missing grant is a picker that gets
403 on every list and never learns of an endpoint (or of a drain).

What each source reads (list and watch, in its namespace): --pool-name: pods, inferencepools and,
unless --no-objectives, inferenceobjectives; --kube-service / --kube-label-selector: endpointslices.
--drains-configmap NAME (admin drains shared between replicas) reads and writes that one ConfigMap:
get/list/watch/update (a rule's resourceNames, if any, must include NAME) and create (which
resourceNames cannot grant: Kubernetes authorizes a create before the object has a name).
--metrics-endpoint-auth (or PICKER_ADMIN__METRICS_AUTH) reviews every reader's token: create on
tokenreviews (authentication.k8s.io) and subjectaccessreviews (authorization.k8s.io), which are
cluster-scoped, so only a ClusterRole bound by a ClusterRoleBinding grants them (ADMIN-002).
--pod-deletion-cost (or PICKER_KUBE__DELETION_COST) writes an annotation on the pool's pods: patch
on pods (POOL-010).
The grants are followed from the pod's service account through RoleBindings and ClusterRoleBindings
in the inputs to their Roles and ClusterRoles; with no binding for that account in the inputs at all
(RBAC kept elsewhere) nothing is reported.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from picker.config.reference_flags import go_bool
from picker.drain.k8s_rules import Inputs
from picker.drain.manifests import Document, get
from picker.drain.rules import Report
from picker.drain.workloads import Container, Workload

POOL_READS = (("", "pods"), ("inference.networking.k8s.io", "inferencepools"))
OBJECTIVE_READS = (("inference.networking.x-k8s.io", "inferenceobjectives"),)
SLICE_READS = (("discovery.k8s.io", "endpointslices"),)
VERBS = ("list", "watch")
DRAIN_RECORD_VERBS = ("get", "list", "watch", "create", "update")
READER_REVIEWS = (("authentication.k8s.io", "tokenreviews"), ("authorization.k8s.io", "subjectaccessreviews"))


@dataclass(frozen=True)
class _Need:
    group: str
    resource: str
    verbs: tuple[str, ...]
    name: str | None = None  # one object: rules limited by resourceNames must name it
    why: str = "reads"
    cluster: bool = False  # cluster-scoped: only a ClusterRoleBinding grants it
    rule: str = "POOL-008"


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
    if container.has_flag("--pod-deletion-cost") or _true(
        container.env("PICKER_KUBE__DELETION_COST") or "false"
    ):
        why = "writes the pod-deletion-cost annotation of (--pod-deletion-cost)"
        needs.append(_Need("", "pods", ("patch",), None, why, rule="POOL-010"))
    if _reviews_readers(container):
        why = "needs for --metrics-endpoint-auth"
        needs += [
            _Need(g, r, ("create",), None, why, cluster=True, rule="ADMIN-002") for g, r in READER_REVIEWS
        ]
    return needs


def _reviews_readers(container: Container) -> bool:
    """--metrics-endpoint-auth (alone, or =true), or PICKER_ADMIN__METRICS_AUTH=true."""
    for word in container.argv:
        if word == "--metrics-endpoint-auth":
            return True
        if word.startswith("--metrics-endpoint-auth="):
            return _true(word.partition("=")[2])
    return _true(container.env("PICKER_ADMIN__METRICS_AUTH") or "false")


def _true(text: str) -> bool:
    try:
        return go_bool(text)
    except argparse.ArgumentTypeError:
        return False  # the picker refuses to start on it: another finding's business


def _bound_roles(inputs: Inputs, account: str, namespace: str) -> list[tuple[Document, bool]] | None:
    """The Roles / ClusterRoles bound to the service account, each with whether it is bound
    cluster-wide (a ClusterRoleBinding); None when no binding names it."""
    roles: list[tuple[Document, bool]] = []
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
        wide = binding.kind == "ClusterRoleBinding"
        roles += [
            (r, wide)
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
            granting = [r for r, wide in roles if wide or not need.cluster]
            missing = [v for v in need.verbs if not any(_grants(r, need, v) for r in granting)]
            if missing:
                where = ", ".join(r.label for r, _ in roles) or "no Role found"
                what = f"{need.resource} ({need.group or 'core'})"
                if need.name is not None:
                    what = f"{need.resource} {need.name} ({need.group or 'core'})"
                scope = (
                    " (cluster-scoped: a ClusterRole bound by a ClusterRoleBinding)" if need.cluster else ""
                )
                report.add(
                    need.rule,
                    picker.doc,
                    (*container.path, "args"),
                    f"service account {account} ({where}) may not {'/'.join(missing)} "
                    f"{what}, which {container.name or 'the picker'} {need.why}{scope}",
                )


def check(inputs: Inputs, report: Report) -> None:
    for picker in inputs.pickers:
        _check_picker(inputs, picker, report)
