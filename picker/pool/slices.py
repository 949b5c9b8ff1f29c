"""EndpointSlices (discovery.k8s.io/v1, as the API's JSON mappings) -> the desired state of each endpoint.

Pure: no I/O, no client library. `SliceStore` holds the slices of one Service (or label selector) by
namespace/name, follows watch events and relists, and merges every slice into one desired view.

Conditions, as the v1 API documents a missing value: `ready` nil = true, `serving` nil = true,
`terminating` nil = false. States:
- terminating -> DRAINING (even with ready=true, which a Service with publishNotReadyAddresses
  reports for terminating pods: a terminating pod must get no new work);
- ready -> READY;
- not ready but serving -> DRAINING;
- neither ready, serving nor terminating (starting up, failing probes) -> NOT_READY.
An address listed in several slices (the controller moving it between slices) takes the most
cautious state: DRAINING, then NOT_READY, then READY.
Malformed slices are reported as problems (strings for the log) and contribute nothing; they never
raise.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from picker.config.model import format_address
from picker.pool.deletion_cost import PodRef
from picker.pool.endpoint import EndpointState

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_CAUTION = {EndpointState.READY: 0, EndpointState.NOT_READY: 1, EndpointState.DRAINING: 2}
_ADDRESS_VERSIONS = {"IPv4": 4, "IPv6": 6}


@dataclass(frozen=True, slots=True)
class TargetPort:
    """Which of a slice's ports is the model server's: by name, by number, or (neither) its only port."""

    name: str | None = None
    number: int | None = None

    @classmethod
    def parse(cls, value: str | int | None) -> TargetPort:
        """ "8000" or 8000 -> by number; "http" -> by name; None or "" -> the slice's only port."""
        if value is None or value == "":
            return cls()
        text = str(value).strip()
        if text.isdigit():
            number = int(text)
            if not 0 < number < 65536:
                raise ValueError(f"port {number} is outside 1-65535")
            return cls(number=number)
        if not _DNS_LABEL.match(text):
            raise ValueError(f"{text!r} is neither a port number nor a port name (a DNS label)")
        return cls(name=text)

    def describe(self) -> str:
        if self.name is not None:
            return f"port named {self.name!r}"
        if self.number is not None:
            return f"port {self.number}"
        return "its only port"


@dataclass(frozen=True, slots=True)
class SliceView:
    """What one slice says: desired state by "ip:port", and what was wrong with it."""

    key: str
    endpoints: dict[str, EndpointState]
    problems: tuple[str, ...] = ()
    # the pod behind each endpoint (its targetRef), for kube.deletion_cost: (address, namespace, name)
    owners: tuple[tuple[str, str, str], ...] = ()


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def slice_key(obj: Mapping[str, Any]) -> str | None:
    """ "namespace/name" of a slice, or None when it has no usable name."""
    meta = _mapping(obj.get("metadata"))
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    namespace = meta.get("namespace")
    return f"{namespace if isinstance(namespace, str) else ''}/{name}"


def state_of(conditions: Any) -> EndpointState:
    """The desired state from an endpoint's `conditions` (missing values as the API documents)."""
    found = _mapping(conditions)

    def flag(name: str, default: bool) -> bool:
        value = found.get(name)
        return default if value is None else value is True

    if flag("terminating", False):
        return EndpointState.DRAINING
    if flag("ready", True):
        return EndpointState.READY
    if flag("serving", True):
        return EndpointState.DRAINING
    return EndpointState.NOT_READY


def _choose_port(ports: Any, target: TargetPort) -> tuple[int | None, str | None]:
    """(port, None) or (None, problem)."""
    listed = [p for p in ports if isinstance(p, Mapping)] if isinstance(ports, list) else []
    if ports is not None and not isinstance(ports, list):
        return None, "ports is not a list"
    tcp = [p for p in listed if p.get("protocol") in (None, "TCP")]

    def number_of(port: Mapping[str, Any]) -> int | None:
        value = port.get("port")
        return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536 else None

    if target.name is not None:
        named = [p for p in tcp if p.get("name", "") == target.name]
        if not named:
            return None, f"no TCP port named {target.name!r} (ports: {_describe_ports(listed)})"
        number = number_of(named[0])
        return (number, None) if number is not None else (None, f"port {target.name!r} has no valid number")
    if target.number is not None:
        if not listed or any(number_of(p) == target.number for p in tcp):
            return target.number, None
        return None, f"no TCP port {target.number} (ports: {_describe_ports(listed)})"
    numbers = [n for n in (number_of(p) for p in tcp) if n is not None]
    if len(numbers) == 1:
        return numbers[0], None
    if not numbers:
        return None, "no port listed; set kube.target_port"
    return None, f"several ports ({_describe_ports(listed)}); set kube.target_port to a name or number"


def _describe_ports(ports: list[Mapping[str, Any]]) -> str:
    return ", ".join(f"{p.get('name') or '(unnamed)'}={p.get('port')}" for p in ports) or "none"


def read_slice(obj: Mapping[str, Any], target: TargetPort) -> SliceView | None:
    """One slice's endpoints with their desired state; None when the slice has no name at all."""
    key = slice_key(obj)
    if key is None:
        return None
    problems: list[str] = []
    endpoints: dict[str, EndpointState] = {}
    address_type = obj.get("addressType")
    version = _ADDRESS_VERSIONS.get(address_type) if isinstance(address_type, str) else None
    if version is None:
        return SliceView(key, {}, (f"slice {key}: addressType {address_type!r} is not IPv4 or IPv6",))
    port, problem = _choose_port(obj.get("ports"), target)
    if port is None:
        return SliceView(key, {}, (f"slice {key}: {problem}",))
    listed = obj.get("endpoints")
    if listed is not None and not isinstance(listed, list):
        return SliceView(key, {}, (f"slice {key}: endpoints is not a list",))
    owners: list[tuple[str, str, str]] = []
    for index, entry in enumerate(listed or ()):
        addresses = _mapping(entry).get("addresses")
        if not isinstance(addresses, list) or not addresses or not isinstance(addresses[0], str):
            problems.append(f"slice {key}: endpoint #{index} has no address")
            continue
        # The API defines no meaning for addresses beyond the first (kube-proxy ignores them too).
        try:
            ip = ipaddress.ip_address(addresses[0])
        except ValueError:
            problems.append(f"slice {key}: endpoint #{index} address {addresses[0]!r} is not an IP")
            continue
        if ip.version != version:
            problems.append(f"slice {key}: endpoint #{index} address {addresses[0]!r} is not {address_type}")
            continue
        address = format_address(ip.compressed, port)
        state = state_of(_mapping(entry).get("conditions"))
        endpoints[address] = _cautious(endpoints.get(address), state)
        owner = _pod_of(_mapping(entry).get("targetRef"), key.split("/", 1)[0])
        if owner is not None:
            owners.append((address, *owner))
    return SliceView(key, endpoints, tuple(problems), tuple(owners))


def _pod_of(ref: Any, namespace: str) -> tuple[str, str] | None:
    """(namespace, name) of the pod an endpoint's targetRef names; None for anything else."""
    found = _mapping(ref)
    name, where = found.get("name"), found.get("namespace")
    if found.get("kind") != "Pod" or not isinstance(name, str) or not name:
        return None
    return (where if isinstance(where, str) and where else namespace), name


def _cautious(current: EndpointState | None, new: EndpointState) -> EndpointState:
    if current is None:
        return new
    return new if _CAUTION[new] > _CAUTION[current] else current


def merge(views: Iterable[SliceView]) -> dict[str, EndpointState]:
    """All slices' endpoints in one view; an address in several slices takes the most cautious state."""
    merged: dict[str, EndpointState] = {}
    for view in views:
        for address, state in view.endpoints.items():
            merged[address] = _cautious(merged.get(address), state)
    return merged


class SliceStore:
    """The current slices of one Service, kept in step with list results and watch events."""

    def __init__(self, target: TargetPort) -> None:
        self._target = target
        self._slices: dict[str, SliceView] = {}

    def __len__(self) -> int:
        return len(self._slices)

    def keys(self) -> list[str]:
        return sorted(self._slices)

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> list[str]:
        """A full list: exactly these slices exist now (any slice not listed is dropped). Problems."""
        problems: list[str] = []
        fresh: dict[str, SliceView] = {}
        for obj in objects:
            view = read_slice(_mapping(obj), self._target)
            if view is None:
                problems.append("a listed slice has no metadata.name; ignored")
                continue
            fresh[view.key] = view
            problems.extend(view.problems)
        self._slices = fresh
        return problems

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> list[str]:
        """One watch event (ADDED / MODIFIED / DELETED). Problems, for the log."""
        key = slice_key(_mapping(obj))
        if key is None:
            return [f"{event_type} event for a slice without metadata.name; ignored"]
        if event_type == "DELETED":
            self._slices.pop(key, None)
            return []
        if event_type not in ("ADDED", "MODIFIED"):
            return [f"unexpected event type {event_type!r} for slice {key}; ignored"]
        view = read_slice(_mapping(obj), self._target)
        assert view is not None  # it has a key
        self._slices[key] = view
        return list(view.problems)

    def desired(self) -> dict[str, EndpointState]:
        return merge(self._slices.values())

    def pod_refs(self) -> list[PodRef]:
        """The pods behind the endpoints (targetRef), with their endpoints; a terminating endpoint's
        pod is being deleted. Slices carry no annotations: `value` is unknown (None)."""
        desired = self.desired()
        pods: dict[tuple[str, str], list[str]] = {}
        for view in self._slices.values():
            for address, namespace, name in view.owners:
                pods.setdefault((namespace, name), []).append(address)
        return [
            PodRef(
                namespace,
                name,
                tuple(sorted(set(addresses))),
                deleting=any(desired.get(a) is EndpointState.DRAINING for a in addresses),
            )
            for (namespace, name), addresses in sorted(pods.items())
        ]
