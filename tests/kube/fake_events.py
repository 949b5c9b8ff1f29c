"""The fake API server's events.k8s.io/v1 Events, as kube-apiserver takes them (a mixin of FakeApiServer).

- POST /apis/events.k8s.io/v1/namespaces/{ns}/events: 201 and the Event at a resourceVersion, or what
  the real one refuses: 409 AlreadyExists for a name in use; 422 Invalid without `eventTime`,
  `reportingController`, `reportingInstance`, `action` or `reason` (each at most 128 characters), with a
  `type` other than Normal or Warning, or a `note` over 1 kB; 403 once `rbac()` was called and no grant
  allows `create events` (group events.k8s.io) to the client.
- GET of the same collection: the list (no watch: nothing here reads events that way).
`events` holds every Event created, oldest first.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from aiohttp import web

from tests.kube.kube_objects import status_response

EVENTS_PATH = "/apis/events.k8s.io/v1/namespaces/{namespace}/events"


class EventsMixin:
    """events.k8s.io/v1 Events for FakeApiServer."""

    resource_version: int
    requests: list[dict[str, Any]]

    def _authorized(self, request: web.Request) -> bool: ...
    def _bearer(self, request: web.Request) -> str: ...
    def _may(self, token: str, verb: str, group: str, resource: str, namespace: str) -> bool: ...
    def _next_version(self) -> int: ...

    def _init_events(self) -> None:
        self.events: list[dict[str, Any]] = []

    def _add_event_routes(self, app: web.Application) -> None:
        app.router.add_post(EVENTS_PATH, self._create_event)
        app.router.add_get(EVENTS_PATH, self._list_events)

    def event_reasons(self) -> list[str]:
        return [e["reason"] for e in self.events]

    async def _list_events(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return status_response(401, "Unauthorized", "Unauthorized")
        namespace = request.match_info["namespace"]
        items = [e for e in self.events if e["metadata"]["namespace"] == namespace]
        body = {"kind": "EventList", "apiVersion": "events.k8s.io/v1", "items": items}
        body["metadata"] = {"resourceVersion": str(self.resource_version)}
        return web.json_response(body)

    async def _create_event(self, request: web.Request) -> web.Response:
        namespace = request.match_info["namespace"]
        self.requests.append({"method": "POST", "path": request.path, "query": dict(request.query)})
        if not self._authorized(request):
            return status_response(401, "Unauthorized", "Unauthorized")
        if not self._may(self._bearer(request), "create", "events.k8s.io", "events", namespace):
            return status_response(
                403,
                "Forbidden",
                f'events.events.k8s.io is forbidden: cannot create resource "events" in API group '
                f'"events.k8s.io" in the namespace "{namespace}"',
            )
        try:
            body: Any = json.loads(await request.read())
        except ValueError:
            return status_response(400, "BadRequest", "the body is not JSON")
        if not isinstance(body, dict):
            return status_response(400, "BadRequest", "the body is not an object")
        meta = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        name = meta.get("name")
        invalid = _invalid(body, name)
        if invalid is not None:
            return status_response(422, "Invalid", f'Event.events.k8s.io "{name}" is invalid: {invalid}')
        if meta.get("namespace", namespace) != namespace:
            return status_response(400, "BadRequest", "the namespace of the object does not match the URL's")
        if any(
            e["metadata"]["name"] == name and e["metadata"]["namespace"] == namespace for e in self.events
        ):
            return status_response(409, "AlreadyExists", f'events.events.k8s.io "{name}" already exists')
        stored = copy.deepcopy(body)
        stored["metadata"] = {
            **meta,
            "namespace": namespace,
            "uid": f"uid-event-{len(self.events)}",
            "resourceVersion": str(self._next_version()),
        }
        stored.update(kind="Event", apiVersion="events.k8s.io/v1")
        self.events.append(stored)
        return web.json_response(stored, status=201)


def _invalid(body: dict[str, Any], name: Any) -> str | None:
    if not isinstance(name, str) or not name:
        return "metadata.name: Required value: name or generateName is required"
    for key in ("eventTime", "reportingController", "reportingInstance", "action", "reason"):
        value = body.get(key)
        if not isinstance(value, str) or not value:
            return f"{key}: Required value"
        if key != "eventTime" and len(value) > 128:
            return f"{key}: Too long: may not be more than 128 bytes"
    if body.get("type") not in ("Normal", "Warning"):
        return f'type: Unsupported value: "{body.get("type")}": supported values: "Normal", "Warning"'
    note = body.get("note")
    if note is not None and (not isinstance(note, str) or len(note.encode()) > 1024):
        return "note: Too long: may not be more than 1024 bytes"
    return None
