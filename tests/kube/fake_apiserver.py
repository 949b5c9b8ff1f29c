"""A fake Kubernetes API server for EndpointSlices, pods, InferencePools and InferenceObjectives.

What it speaks, as kube-apiserver does, for each collection in `RESOURCES` (one resourceVersion
counter across all of them, as etcd has):
- GET {collection path}/namespaces/{ns}/{plural}[?labelSelector=&fieldSelector=&limit=&continue=]
  -> a list: items (without kind/apiVersion, like a real list), metadata.resourceVersion,
  and metadata.continue when paged (an expired continue token: HTTP 410 Expired);
- the same path with watch=1|true[&resourceVersion=X][&allowWatchBookmarks=true][&timeoutSeconds=N]
  -> HTTP 200, chunked, one JSON event per line: ADDED / MODIFIED / DELETED with the object at its new
  resourceVersion, BOOKMARK (only when asked for), ERROR (a Status). Events after X are replayed first;
  without X (or X = "0") every current object comes first as a synthetic ADDED. A label change that
  moves an object in or out of the selector is an ADDED or a DELETED for that watch. The stream ends
  cleanly after timeoutSeconds;
- a resourceVersion older than the kept history is 410 Gone: HTTP 200 and an ERROR event whose Status
  has code 410 (the watch cache's way, `gone_as="event"`) or an HTTP 410 Status (`gone_as="http"`);
- bearer-token auth (401 Status otherwise); other errors as Status objects;
- TokenReviews and SubjectAccessReviews (tests/kube/fake_auth.py: `grant`, `deny`, `hold_reviews`);
- PATCH (JSON merge patch) of any object, the status subresource of InferencePools, and
  SelfSubjectAccessReviews (tests/kube/fake_patch.py: `rbac`, `grant_resource`, `patches`);
- events.k8s.io/v1 Events created by POST (tests/kube/fake_events.py: `events`).

Field selectors: `metadata.name=` and `metadata.namespace=` (what a client asks of a single object).
Single objects (the drain-record ConfigMap's writers): GET, POST (409 when it exists) and PUT (409
unless metadata.resourceVersion is the current one), each recorded like a `put` (watches see it).
Test controls (call them from the test, on the same event loop): put/delete slices, pods, pools and
objectives (`put_slice`, `put_pod`, `put_pool`, `put_objective`, `delete(kind, name)`), `compact()` (drop
the history: older versions get 410), `drop_watches()` (abort every watch connection mid-stream),
`stall_watches()` (keep them open, send nothing: a silently dead connection), `partition(token)` /
`heal(token)` (one client's requests hang, its watches go silent; `add_token` makes clients),
`inject(raw)` (any line, e.g. garbage JSON), `send_bookmarks()`, `fail_next(n, status)`; `requests`
logs what was asked. The faults apply to every collection's watches alike.
In-process only: `await FakeApiServer().start()` binds 127.0.0.1 on a free port.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.kube.fake_auth import ReviewsMixin
from tests.kube.fake_events import EventsMixin
from tests.kube.fake_patch import STATUS_SUBRESOURCE, PatchMixin
from tests.kube.kube_objects import (
    GROUP_PATH,
    RESOURCES,
    SERVICE_LABEL,
    Requirement,
    endpoint,
    field_name,
    inference_objective,
    inference_pool,
    kubeconfig,
    matches,
    parse_selector,
    pod,
    status,
    status_response,
    terminating,
)

__all__ = [
    "GROUP_PATH",
    "SERVICE_LABEL",
    "FakeApiServer",
    "endpoint",
    "parse_selector",
    "status",
    "terminating",
]

JSON = "application/json"  # exactly, as the API server sends it (lightkube compares it verbatim)
_DEFAULT_WATCH_TIMEOUT_S = 1800.0


@dataclass(eq=False)
class _Watch:
    resource: str
    namespace: str
    selector: list[Requirement]
    name: str | None  # fieldSelector metadata.name=
    bookmarks: bool
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    stalled: asyncio.Event | None = None  # set: the connection is silently dead (released on stop)
    token: str = ""  # the client's


_DROP = object()


class FakeApiServer(ReviewsMixin, PatchMixin, EventsMixin):
    """Holds EndpointSlices, serves list/watch for them, and lets a test script every change."""

    def __init__(self, token: str = "fake-apiserver-token-0123456789", gone_as: str = "event") -> None:
        self.token = token
        self.tokens = {token}  # add_token: one per client, so a partition can cut one client off
        self._cut: dict[str, asyncio.Event] = {}  # partitioned tokens -> set when healed
        self.gone_as = gone_as
        self._rv = itertools.count(1000)
        self.resource_version = next(self._rv)
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (plural, namespace, name)
        self._history: list[tuple[int, str, dict[str, Any], dict[str, Any] | None]] = []
        self._compacted_at = self.resource_version
        self._watches: set[_Watch] = set()
        self._pages: dict[str, list[dict[str, Any]]] = {}
        self._page_ids = itertools.count(1)
        self._failures: list[tuple[int, str | None]] = []  # (status, only for this plural)
        self._released = asyncio.Event()
        self.requests: list[dict[str, Any]] = []
        self._init_reviews()
        self._init_patch()
        self._init_events()
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> FakeApiServer:
        app = web.Application(middlewares=[self._partition])
        for plural, (path, _, _) in RESOURCES.items():
            app.router.add_get(f"{path}/namespaces/{{namespace}}/{plural}", self._collection)
        self._add_write_routes(app)
        self._add_review_routes(app)
        self._add_patch_routes(app)
        self._add_event_routes(app)
        # handler_cancellation: a watch whose client hung up ends at once, as on a real API server.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        self._released.set()
        for watch in list(self._watches):
            watch.queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- clients and partitions ------------------------------------------------------------------

    def add_token(self, token: str) -> str:
        """Another client's bearer token (write its kubeconfig with `write_kubeconfig(token=...)`)."""
        self.tokens.add(token)
        return token

    def partition(self, token: str) -> None:
        """Cut that client off, as a network partition would: its requests get no answer (they hang
        until it gives up), its open watches go silent."""
        self._cut.setdefault(token, asyncio.Event())
        for watch in self._watches:
            if watch.token == token and watch.stalled is None:
                watch.stalled = self._released

    def heal(self, token: str) -> None:
        healed = self._cut.pop(token, None)
        if healed is not None:
            healed.set()

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        return header.startswith("Bearer ") and header[len("Bearer ") :] in self.tokens

    @web.middleware
    async def _partition(self, request: web.Request, handler: Any) -> web.StreamResponse:
        token = request.headers.get("Authorization", "")[len("Bearer ") :]
        healed = self._cut.get(token)
        if healed is not None:
            await healed.wait()  # cancelled when the client hangs up (handler_cancellation)
            raise web.HTTPServiceUnavailable()  # healed while this request waited: it is lost
        return await handler(request)  # type: ignore[no-any-return]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path, namespace: str = "default", token: str | None = None) -> Path:
        """A kubeconfig pointing at this server (plain http, bearer token)."""
        path.write_text(json.dumps(kubeconfig(self.url, token or self.token, namespace)))
        return path

    # -- scripting ---------------------------------------------------------------------------------

    def put_slice(
        self,
        name: str,
        endpoints: list[dict[str, Any]],
        *,
        namespace: str = "default",
        service: str | None = "vllm",
        ports: list[dict[str, Any]] | None = None,
        address_type: str = "IPv4",
        labels: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Create (ADDED) or replace (MODIFIED) a slice; returns it at its new resourceVersion."""
        all_labels = dict(labels or {})
        if service is not None:
            all_labels[SERVICE_LABEL] = service
        body = {
            "addressType": address_type,
            "endpoints": copy.deepcopy(endpoints),
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}] if ports is None else ports,
        }
        return self.put("endpointslices", name, body, namespace=namespace, labels=all_labels)

    def put_pod(
        self, name: str, ip: str | None, *, namespace: str = "default", **fields: Any
    ) -> dict[str, Any]:
        """A pod (see kube_objects.pod for `fields`: labels, ready, phase, deleting, container_ports)."""
        labels, metadata, body = pod(ip, **fields)
        return self.put("pods", name, body, namespace=namespace, labels=labels, metadata=metadata)

    def put_pool(self, name: str, *, namespace: str = "default", **fields: Any) -> dict[str, Any]:
        """An InferencePool (see kube_objects.inference_pool: selector, ports, picker)."""
        return self.put("inferencepools", name, inference_pool(**fields), namespace=namespace)

    def put_objective(self, name: str, *, namespace: str = "default", **fields: Any) -> dict[str, Any]:
        """An InferenceObjective (see kube_objects.inference_objective: priority, pool)."""
        return self.put("inferenceobjectives", name, inference_objective(**fields), namespace=namespace)

    def put(
        self,
        resource: str,
        name: str,
        body: dict[str, Any],
        *,
        namespace: str = "default",
        labels: dict[str, str] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Create (ADDED) or replace (MODIFIED) any object; `body` is all but kind/apiVersion/metadata."""
        _, kind, api_version = RESOURCES[resource]
        key = (resource, namespace, name)
        previous = self._objects.get(key)
        rv = next(self._rv)
        meta = {
            "name": name,
            "namespace": namespace,
            "uid": previous["metadata"]["uid"] if previous else f"uid-{name}-{rv}",
            "resourceVersion": str(rv),
            "generation": (previous["metadata"]["generation"] + 1) if previous else 1,
            "labels": dict(labels or {}),
            **(metadata or {}),
        }
        obj = {"kind": kind, "apiVersion": api_version, "metadata": meta, **copy.deepcopy(body)}
        if resource in STATUS_SUBRESOURCE:  # a write of the object leaves its status as it was
            obj.pop("status", None)
            if previous is not None and "status" in previous:
                obj["status"] = copy.deepcopy(previous["status"])
        self._objects[key] = obj
        self._record(rv, "MODIFIED" if previous else "ADDED", obj, previous)
        return obj

    def _next_version(self) -> int:
        self.resource_version = next(self._rv)
        return self.resource_version

    def delete_slice(self, name: str, namespace: str = "default") -> None:
        self.delete("endpointslices", name, namespace)

    def delete(self, resource: str, name: str, namespace: str = "default") -> None:
        previous = self._objects.pop((resource, namespace, name))
        rv = next(self._rv)
        obj = copy.deepcopy(previous)
        obj["metadata"]["resourceVersion"] = str(rv)
        self._record(rv, "DELETED", obj, previous)

    def compact(self) -> None:
        """Forget the event history (etcd compaction): watches from older versions now get 410."""
        self._history.clear()
        self._pages.clear()
        self._compacted_at = self.resource_version

    def drop_watches(self) -> int:
        """Abort every open watch connection mid-stream (no terminating chunk). Returns how many."""
        live = [w for w in self._watches if w.stalled is None]
        for watch in live:
            watch.queue.put_nowait(_DROP)
        return len(live)

    def stall_watches(self) -> int:
        """Keep every open watch connection open but send nothing more on it, ever."""
        live = [w for w in self._watches if w.stalled is None]
        for watch in live:
            watch.stalled = self._released
        return len(live)

    def inject(self, raw: str) -> int:
        """Send one raw line (garbage, a hand-made event) on every live watch."""
        live = [w for w in self._watches if w.stalled is None]
        for watch in live:
            watch.queue.put_nowait(raw if raw.endswith("\n") else raw + "\n")
        return len(live)

    def send_bookmarks(self) -> int:
        live = [w for w in self._watches if w.stalled is None and w.bookmarks]
        for watch in live:
            watch.queue.put_nowait(self._bookmark(watch.resource))
        return len(live)

    def fail_next(self, count: int, code: int = 500, resource: str | None = None) -> None:
        """The next `count` requests (list or watch; of `resource` only, if named) get this status."""
        self._failures.extend([(code, resource)] * count)

    def clear_failures(self) -> None:
        self._failures.clear()

    def objects(
        self,
        namespace: str = "default",
        selector: str = f"{SERVICE_LABEL}=vllm",
        resource: str = "endpointslices",
    ) -> list[dict[str, Any]]:
        """The objects a list would return now: the truth a client should converge to."""
        requirements = parse_selector(selector)
        return [
            copy.deepcopy(obj)
            for key, obj in sorted(self._objects.items())
            if key[:2] == (resource, namespace) and matches(requirements, obj)
        ]

    @property
    def live_watches(self) -> int:
        return sum(1 for w in self._watches if w.stalled is None)

    def watch_requests(self, resource: str = "endpointslices") -> list[dict[str, str]]:
        return [
            r["query"]
            for r in self.requests
            if r["query"].get("watch") in ("1", "true") and r["path"].endswith("/" + resource)
        ]

    # -- protocol ----------------------------------------------------------------------------------

    def _record(self, rv: int, kind: str, obj: dict[str, Any], previous: dict[str, Any] | None) -> None:
        self.resource_version = rv
        self._history.append((rv, kind, copy.deepcopy(obj), copy.deepcopy(previous)))
        for watch in self._watches:
            line = self._line_for(watch, kind, obj, previous)
            if line is not None:
                watch.queue.put_nowait(line)

    def _line_for(
        self, watch: _Watch, kind: str, obj: dict[str, Any], previous: dict[str, Any] | None
    ) -> str | None:
        if not self._in_watch(watch, obj):
            return None
        now_in, was_in = matches(watch.selector, obj), matches(watch.selector, previous)
        if kind == "DELETED":
            kind = "DELETED" if was_in else ""
        elif now_in and not was_in:
            kind = "ADDED"
        elif was_in and not now_in:
            kind = "DELETED"
        elif not now_in:
            kind = ""
        return json.dumps({"type": kind, "object": obj}) + "\n" if kind else None

    @staticmethod
    def _in_watch(watch: _Watch, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        return (
            obj["kind"] == RESOURCES[watch.resource][1]
            and meta["namespace"] == watch.namespace
            and (watch.name is None or meta["name"] == watch.name)
        )

    def _bookmark(self, resource: str) -> str:
        _, kind, api_version = RESOURCES[resource]
        mark = {
            "kind": kind,
            "apiVersion": api_version,
            "metadata": {"resourceVersion": str(self.resource_version)},
        }
        return json.dumps({"type": "BOOKMARK", "object": mark}) + "\n"

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append({"method": request.method, "path": request.path, "query": query})
        if not self._authorized(request):
            return status_response(401, "Unauthorized", "Unauthorized")
        plural = request.path.rsplit("/", 1)[1]
        failure = next((f for f in self._failures if f[1] in (None, plural)), None)
        if failure is not None:
            self._failures.remove(failure)
            code = failure[0]
            return status_response(code, "InternalError" if code >= 500 else "Forbidden", f"injected {code}")
        try:
            selector = parse_selector(query.get("labelSelector", ""))
            name = field_name(query.get("fieldSelector", ""), request.match_info["namespace"])
        except ValueError as exc:
            return status_response(400, "BadRequest", str(exc))
        watch = _Watch(
            plural,
            request.match_info["namespace"],
            selector,
            name,
            query.get("allowWatchBookmarks") == "true",
            token=request.headers.get("Authorization", "")[len("Bearer ") :],
        )
        if query.get("watch") in ("1", "true"):
            return await self._watch(request, watch, query)
        return self._list(watch, query)

    def _current(self, watch: _Watch) -> list[dict[str, Any]]:
        return [
            obj
            for _, obj in sorted(self._objects.items())
            if self._in_watch(watch, obj) and matches(watch.selector, obj)
        ]

    def _list(self, watch: _Watch, query: dict[str, str]) -> web.Response:
        token = query.get("continue")
        if token:
            items = self._pages.pop(token, None)
            if items is None:
                return status_response(410, "Expired", "The provided continue parameter is too old")
            version = items[0]["_rv"] if items else str(self.resource_version)
        else:
            version = str(self.resource_version)
            items = [
                {
                    **{k: copy.deepcopy(v) for k, v in obj.items() if k not in ("kind", "apiVersion")},
                    "_rv": version,
                }
                for obj in self._current(watch)
            ]
        limit = int(query["limit"]) if query.get("limit", "").isdigit() and int(query["limit"]) > 0 else None
        page, rest = (items[:limit], items[limit:]) if limit else (items, [])
        metadata: dict[str, Any] = {"resourceVersion": version}
        if rest:
            next_token = f"page-{next(self._page_ids)}"
            self._pages[next_token] = rest
            metadata["continue"] = next_token
        _, kind, api_version = RESOURCES[watch.resource]
        body = {
            "kind": kind + "List",
            "apiVersion": api_version,
            "metadata": metadata,
            "items": [{k: v for k, v in item.items() if k != "_rv"} for item in page],
        }
        return web.Response(body=json.dumps(body), content_type=JSON)

    async def _watch(self, request: web.Request, watch: _Watch, query: dict[str, str]) -> web.StreamResponse:
        since = query.get("resourceVersion", "")
        timeout = float(query.get("timeoutSeconds") or _DEFAULT_WATCH_TIMEOUT_S)
        # Replay and registration happen in one synchronous step: no event can fall in between.
        if since in ("", "0"):
            replay = [json.dumps({"type": "ADDED", "object": obj}) + "\n" for obj in self._current(watch)]
        elif not since.isdigit():
            return status_response(400, "BadRequest", f"invalid resource version {since!r}")
        elif int(since) < self._compacted_at:
            message = f"too old resource version: {since} ({self._compacted_at})"
            if self.gone_as == "http":
                return status_response(410, "Expired", message)
            return await self._single_event(
                request, {"type": "ERROR", "object": status(410, "Expired", message)}
            )
        else:
            replay = [
                line
                for rv, kind, obj, previous in self._history
                if rv > int(since) and (line := self._line_for(watch, kind, obj, previous)) is not None
            ]
        self._watches.add(watch)
        try:
            response = web.StreamResponse(status=200, headers={"Content-Type": JSON})
            response.enable_chunked_encoding()
            await response.prepare(request)
            for line in replay:
                await response.write(line.encode())
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                remaining = deadline - loop.time()
                try:
                    item = await asyncio.wait_for(watch.queue.get(), timeout=max(remaining, 0))
                except TimeoutError:
                    item = None
                if watch.stalled is not None:
                    await watch.stalled.wait()  # silent until the server stops
                    return response
                if item is None:
                    await response.write_eof()
                    return response
                if item is _DROP:
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                await response.write(item.encode())
        except ConnectionResetError:  # the client went away
            return web.Response(status=499)
        finally:
            self._watches.discard(watch)

    async def _single_event(self, request: web.Request, event: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"Content-Type": JSON})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write((json.dumps(event) + "\n").encode())
        await response.write_eof()
        return response

    # -- single objects: get, create (POST), replace (PUT, optimistic on resourceVersion) ---------------

    def _add_write_routes(self, app: web.Application) -> None:
        for plural, (path, _, _) in RESOURCES.items():
            collection = f"{path}/namespaces/{{namespace}}/{plural}"
            app.router.add_post(collection, self._create)
            app.router.add_get(collection + "/{name}", self._get_one)
            app.router.add_put(collection + "/{name}", self._replace)

    def _write_target(self, request: web.Request) -> tuple[str, str, str | None] | web.Response:
        self.requests.append({"method": request.method, "path": request.path, "query": dict(request.query)})
        if not self._authorized(request):
            return status_response(401, "Unauthorized", "Unauthorized")
        plural = request.path.split("/namespaces/", 1)[1].split("/")[1]
        failure = next((f for f in self._failures if f[1] in (None, plural)), None)
        if failure is not None:
            self._failures.remove(failure)
            return status_response(failure[0], "InternalError", f"injected {failure[0]}")
        return plural, request.match_info["namespace"], request.match_info.get("name")

    async def _get_one(self, request: web.Request) -> web.Response:
        target = self._write_target(request)
        if isinstance(target, web.Response):
            return target
        obj = self._objects.get(target)  # type: ignore[arg-type]
        if obj is None:
            return status_response(404, "NotFound", f"{target[0]} {target[2]!r} not found")
        return web.Response(body=json.dumps(obj), content_type=JSON)

    async def _create(self, request: web.Request) -> web.Response:
        target = self._write_target(request)
        if isinstance(target, web.Response):
            return target
        plural, namespace, _ = target
        body = await request.json()
        name = body["metadata"]["name"]
        if (plural, namespace, name) in self._objects:
            return status_response(409, "AlreadyExists", f"{plural} {name!r} already exists")
        return self._stored(plural, namespace, name, body, 201)

    async def _replace(self, request: web.Request) -> web.Response:
        target = self._write_target(request)
        if isinstance(target, web.Response):
            return target
        plural, namespace, name = target
        assert name is not None
        body = await request.json()
        current = self._objects.get((plural, namespace, name))
        if current is None:
            return status_response(404, "NotFound", f"{plural} {name!r} not found")
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            return status_response(409, "Conflict", "the object has been modified; apply your changes again")
        return self._stored(plural, namespace, name, body, 200)

    def _stored(
        self, plural: str, namespace: str, name: str, body: dict[str, Any], code: int
    ) -> web.Response:
        meta = body.get("metadata") or {}
        rest = {k: v for k, v in body.items() if k not in ("kind", "apiVersion", "metadata")}
        obj = self.put(plural, name, rest, namespace=namespace, labels=meta.get("labels"))
        return web.Response(status=code, body=json.dumps(obj), content_type=JSON)
