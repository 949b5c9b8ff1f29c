"""An InferencePool and its pods (the API's JSON mappings) -> the desired state of each endpoint.

Pure: no I/O, no client library. The pool source (picker/sources/kube_pool.py) keeps a
`PoolSpecStore` (the one InferencePool it is pointed at) and a `PodStore` (the pods its selector
picks) in step with the API server, like `slices.py` does for EndpointSlices.

InferencePool (`inference.networking.k8s.io/v1`): `spec.selector.matchLabels` picks the model-server
pods, `spec.targetPorts[].number` (1 to 8 ports: data-parallel ranks) says where to send work, one
endpoint per pod IP and port. A pod's state:
- no `status.podIP` yet, or phase Succeeded/Failed (it will never serve again) -> not listed;
- `metadata.deletionTimestamp` set -> DRAINING (the earliest signal Kubernetes gives of a pod going
  away: the EndpointSlice controller reports it only after seeing the same update);
- phase other than Running, or the Ready condition not "True" -> NOT_READY;
- otherwise READY. A pod that is gone from the API is gone from the view.
Malformed pods are reported as problems (strings for the log) and contribute nothing; never raise.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from picker.config.model import format_address
from picker.pool.deletion_cost import ANNOTATION, PodRef, read_value
from picker.pool.endpoint import EndpointState

MAX_TARGET_PORTS = 8
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_TERMINAL_PHASES = ("Succeeded", "Failed")


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def object_key(obj: Mapping[str, Any]) -> str | None:
    """ "namespace/name" of an object, or None when it has no usable name."""
    meta = _mapping(obj.get("metadata"))
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    namespace = meta.get("namespace")
    return f"{namespace if isinstance(namespace, str) else ''}/{name}"


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What the picker uses of an InferencePool: which pods, which ports."""

    selector: tuple[tuple[str, str], ...]  # matchLabels, sorted
    ports: tuple[int, ...]
    picker_ref: str | None = None  # spec.endpointPickerRef.name, for `picker check`

    @property
    def label_selector(self) -> str:
        """The selector as the API's labelSelector parameter: "k=v,k2=v2"."""
        return ",".join(f"{key}={value}" for key, value in self.selector)


def read_pool(obj: Mapping[str, Any]) -> PoolSpec | str:
    """An InferencePool's spec, or the problem that makes it unusable (a string naming the field)."""
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        return "has no spec"
    selector = spec.get("selector")
    if not isinstance(selector, Mapping):
        return "spec.selector is missing"
    if selector.get("matchExpressions"):
        return "spec.selector.matchExpressions is not supported (use matchLabels)"
    labels = selector.get("matchLabels")
    if not isinstance(labels, Mapping) or not labels:
        return "spec.selector.matchLabels is missing or empty (it would select every pod)"
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY.match(key):
            return f"spec.selector.matchLabels key {key!r} is not a label key"
        if not isinstance(value, str) or not _LABEL_VALUE.match(value):
            return f"spec.selector.matchLabels value {value!r} is not a label value"
    listed = spec.get("targetPorts")
    if not isinstance(listed, list) or not 1 <= len(listed) <= MAX_TARGET_PORTS:
        return f"spec.targetPorts must list 1 to {MAX_TARGET_PORTS} ports"
    ports: list[int] = []
    for index, entry in enumerate(listed):
        number = _mapping(entry).get("number")
        if not isinstance(number, int) or isinstance(number, bool) or not 0 < number < 65536:
            return f"spec.targetPorts[{index}].number {number!r} is not a port number"
        if number in ports:
            return f"spec.targetPorts lists port {number} twice"
        ports.append(number)
    ref = _mapping(spec.get("endpointPickerRef")).get("name")
    return PoolSpec(
        tuple(sorted(labels.items())), tuple(ports), ref if isinstance(ref, str) and ref else None
    )


class PoolSpecStore:
    """The one InferencePool the picker is pointed at: its spec, or why there is none to use."""

    def __init__(self, namespace: str, name: str) -> None:
        self.key = f"{namespace}/{name}"
        self._obj: Mapping[str, Any] | None = None

    def __len__(self) -> int:
        return 0 if self._obj is None else 1

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> list[str]:
        self._obj = next((o for o in objects if object_key(_mapping(o)) == self.key), None)
        return []

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> list[str]:
        if object_key(_mapping(obj)) != self.key:
            return []
        self._obj = None if event_type == "DELETED" else obj
        return []

    def current(self) -> PoolSpec | str:
        """The spec, or a problem naming the pool: missing, or which field is invalid."""
        if self._obj is None:
            return f"InferencePool {self.key} not found"
        spec = read_pool(self._obj)
        return spec if isinstance(spec, PoolSpec) else f"InferencePool {self.key} is invalid: {spec}"


def pod_state(obj: Mapping[str, Any]) -> EndpointState | None:
    """The desired state of a pod's endpoints; None when it has none (no IP yet, or finished)."""
    status = _mapping(obj.get("status"))
    phase = status.get("phase")
    if phase in _TERMINAL_PHASES:
        return None
    if _mapping(obj.get("metadata")).get("deletionTimestamp"):
        return EndpointState.DRAINING
    if phase != "Running":
        return EndpointState.NOT_READY
    conditions = status.get("conditions")
    for condition in conditions if isinstance(conditions, list) else ():
        if _mapping(condition).get("type") == "Ready":
            return (
                EndpointState.READY
                if _mapping(condition).get("status") == "True"
                else EndpointState.NOT_READY
            )
    return EndpointState.NOT_READY


def read_pod(obj: Mapping[str, Any], ports: tuple[int, ...]) -> tuple[dict[str, EndpointState], str | None]:
    """A pod's endpoints (its IP x each port) with their state, and a problem when it is malformed."""
    state = pod_state(obj)
    if state is None:
        return {}, None
    ip_text = _mapping(obj.get("status")).get("podIP")
    if not ip_text:
        return {}, None  # not scheduled / no sandbox yet: nothing to send work to
    if not isinstance(ip_text, str):
        return {}, f"pod {object_key(obj)}: status.podIP is not a string"
    try:
        ip = ipaddress.ip_address(ip_text)
    except ValueError:
        return {}, f"pod {object_key(obj)}: status.podIP {ip_text!r} is not an IP"
    return {format_address(ip.compressed, port): state for port in ports}, None


class PodStore:
    """The pods an InferencePool selects, kept in step with list results and watch events."""

    def __init__(self, ports: tuple[int, ...]) -> None:
        self.ports = ports
        self._pods: dict[str, Mapping[str, Any]] = {}

    def __len__(self) -> int:
        return len(self._pods)

    def keys(self) -> list[str]:
        return sorted(self._pods)

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> list[str]:
        """A full list: exactly these pods exist now. Problems, for the log."""
        problems: list[str] = []
        fresh: dict[str, Mapping[str, Any]] = {}
        for obj in objects:
            key = object_key(_mapping(obj))
            if key is None:
                problems.append("a listed pod has no metadata.name; ignored")
                continue
            fresh[key] = obj
        self._pods = fresh
        return problems + self._problems(fresh.values())

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> list[str]:
        """One watch event (ADDED / MODIFIED / DELETED). Problems, for the log."""
        key = object_key(_mapping(obj))
        if key is None:
            return [f"{event_type} event for a pod without metadata.name; ignored"]
        if event_type == "DELETED":
            self._pods.pop(key, None)
            return []
        self._pods[key] = obj
        return self._problems([obj])

    def set_ports(self, ports: tuple[int, ...]) -> None:
        """The pool's targetPorts changed: the same pods, other endpoints."""
        self.ports = ports

    def desired(self) -> dict[str, EndpointState]:
        view: dict[str, EndpointState] = {}
        for obj in self._pods.values():
            endpoints, _ = read_pod(obj, self.ports)
            view.update(endpoints)
        return view

    def labels(self) -> dict[str, dict[str, str]]:
        """Each endpoint's pod labels (canary groups read them)."""
        out: dict[str, dict[str, str]] = {}
        for obj in self._pods.values():
            tags = _mapping(_mapping(obj.get("metadata")).get("labels"))
            if not tags:
                continue
            clean = {str(k): str(v) for k, v in tags.items()}
            for address in read_pod(obj, self.ports)[0]:
                out[address] = clean
        return out

    def instances(self) -> dict[str, str]:
        """Each endpoint's pod, by uid (namespace/name when the API gave none): a rollback's drain
        is that pod's, and ends with it."""
        out: dict[str, str] = {}
        for key, obj in self._pods.items():
            uid = _mapping(obj.get("metadata")).get("uid")
            for address in read_pod(obj, self.ports)[0]:
                out[address] = uid if isinstance(uid, str) and uid else key
        return out

    def pod_refs(self) -> list[PodRef]:
        """The pods with endpoints (an IP, not finished), their pod-deletion-cost annotation and
        whether they are being deleted (kube.deletion_cost ranks them)."""
        refs: list[PodRef] = []
        for key, obj in sorted(self._pods.items()):
            addresses = tuple(sorted(read_pod(obj, self.ports)[0]))
            if not addresses:
                continue
            meta = _mapping(obj.get("metadata"))
            namespace, _, name = key.partition("/")
            uid = meta.get("uid")
            refs.append(
                PodRef(
                    namespace,
                    name,
                    addresses,
                    uid if isinstance(uid, str) and uid else None,
                    read_value(_mapping(meta.get("annotations")).get(ANNOTATION)),
                    bool(meta.get("deletionTimestamp")),
                )
            )
        return refs

    def _problems(self, objects: Iterable[Mapping[str, Any]]) -> list[str]:
        return [problem for obj in objects if (problem := read_pod(obj, self.ports)[1]) is not None]
