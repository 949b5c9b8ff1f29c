"""The list -> watch -> relist loop for one collection of Kubernetes objects; forever.

`ListWatch` keeps a store (a pure object that takes a full list or one watch event and says what was
wrong) in step with one collection (EndpointSlices of a Service, the pods of an InferencePool, the
pool itself, its InferenceObjectives). Three finite steps, each driven directly by the tests, and a
trivial loop around them:
- `relist()`: list every object and replace the store with exactly that (so a delete missed while
  disconnected leaves no ghost), publish, remember the list's resourceVersion;
- `watch_stream()`: one watch from that version, with bookmarks and an inactivity deadline; apply each
  event as it comes; return on the server's clean end (timeoutSeconds), raise on anything else;
- `sync_once()`: relist when there is no version to resume from, then one watch stream. A 410 clears
  the version, so the next call relists at once; undecodable data does too, after a pause.
`run()` repeats `sync_once()` forever, pausing with exponential backoff and jitter (tenacity) after
failures. The last good view stays published meanwhile. The API sits behind `Collection`
(`kube_api.py` implements it with lightkube), so this module knows nothing of HTTP.
`SliceWatcher` is the loop over a Service's EndpointSlices, feeding the pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential, wait_random

from picker.pool import Pool
from picker.pool.slices import SliceStore, TargetPort
from picker.sources.cancel import raise_if_cancelled

log = logging.getLogger(__name__)

SOURCE = "kube"


class SourceError(Exception):
    """A failure of the endpoint source that a retry can fix; `kind` names it in logs and metrics."""

    kind = "error"


class Expired(SourceError):
    """410 Gone: the resourceVersion is older than the API server keeps. Only a relist helps."""

    kind = "expired"


class Disconnected(SourceError):
    """The connection failed or broke mid-stream."""

    kind = "disconnected"


class ApiFailure(SourceError):
    """The API server answered with an error status (other than 410)."""

    kind = "api-error"


class ReviewNotServed(ApiFailure):
    """The API server, or a proxy in front of it, does not serve SelfSubjectAccessReview (404): no
    answer either way; the operation itself will say whether it is allowed."""

    kind = "not-served"


class BadData(SourceError):
    """The API server (or something in between) sent something undecodable."""

    kind = "bad-data"


class Stalled(SourceError):
    """The watch stream sent nothing, not even a bookmark, for the inactivity deadline."""

    kind = "stalled"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One decoded watch event. `version` is the object's resourceVersion (bookmarks carry only that)."""

    type: str  # ADDED, MODIFIED, DELETED, BOOKMARK, ERROR
    obj: Mapping[str, Any] | None = None
    version: str | None = None
    code: int | None = None  # ERROR: the Status code
    message: str = ""


WatchStream = AbstractAsyncContextManager[AsyncIterator[WatchEvent]]


class Collection(Protocol):
    """One collection the loop lists and watches (implemented over lightkube in kube_api.py)."""

    async def list(self) -> tuple[list[Mapping[str, Any]], str]:
        """Every matching object and the list's resourceVersion."""
        ...

    def watch(self, version: str, timeout_s: int) -> WatchStream:
        """One watch stream from `version`, bookmarks on, ended by the server after `timeout_s`."""
        ...


class Store(Protocol):
    """What the loop keeps in step: a full list replaces it, an event updates it; both return problems."""

    def __len__(self) -> int: ...

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> list[str]: ...

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> list[str]: ...


class SliceApi(Protocol):
    """What the EndpointSlice loop needs from the API server (kube_api.LightkubeSliceApi)."""

    async def list_slices(self) -> tuple[list[Mapping[str, Any]], str]:
        """Every matching slice and the list's resourceVersion."""
        ...

    def watch_slices(self, version: str, timeout_s: int) -> WatchStream:
        """One watch stream from `version`, bookmarks on, ended by the server after `timeout_s`."""
        ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class WatchSettings:
    watch_timeout_s: int = 60
    inactivity_deadline_s: float = 90.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0


class ListWatch:
    """Keeps `store` in step with one collection; calls `publish()` after every change of the store."""

    def __init__(
        self,
        collection: Collection,
        store: Store,
        settings: WatchSettings,
        *,
        what: str,
        publish: Callable[[], None],
        kept: Callable[[], int] = lambda: 0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_event: Callable[[str], None] = lambda _: None,
    ) -> None:
        self._collection = collection
        self.store = store
        self._settings = settings
        self.what = what  # plural, for logs: "slices", "pods", "inferencepools"
        self._publish = publish
        self._kept = kept
        self._sleep = sleep
        self._on_event = on_event
        self.version: str | None = None
        self._reported: set[str] = set()

    async def relist(self) -> None:
        """List everything; the result replaces the whole view."""
        items, version = await self._collection.list()
        self._report(self.store.replace(items))
        self._publish()
        self.version = version
        self._on_event("relist")
        log.info("kube list %s=%d resource_version=%s", self.what, len(self.store), version)

    async def watch_stream(self) -> int:
        """One watch stream from `version`; the number of events it brought, on a clean end."""
        if self.version is None:
            raise RuntimeError("watch_stream() needs a resourceVersion: relist() first")
        count = 0
        deadline = self._settings.inactivity_deadline_s
        async with self._collection.watch(self.version, self._settings.watch_timeout_s) as events:
            iterator = aiter(events)
            while True:
                raise_if_cancelled()
                try:
                    async with asyncio.timeout(deadline):
                        event = await anext(iterator, None)
                except TimeoutError:
                    raise Stalled(f"the {self.what} watch sent nothing for {deadline:g} s") from None
                if event is None:
                    return count
                count += 1
                self._handle(event)

    async def sync_once(self) -> None:
        """Relist if needed, then watch until the stream ends. Raises what a pause should follow."""
        raise_if_cancelled()  # the retries of a failing relist run here, not in run()'s loop
        if self.version is None:
            await self.relist()
        try:
            count = await self.watch_stream()
        except Expired as exc:
            log.info("kube %s watch expired (410: %s); relisting", self.what, exc)
            self._on_event(Expired.kind)
            self.version = None
            return
        except BadData:
            self.version = None  # what it hid is unknown: the next step relists
            raise
        self._on_event("watch-ended")
        log.debug("kube %s watch ended events=%d resource_version=%s", self.what, count, self.version)

    async def run(self) -> None:
        """Forever: `sync_once`, with exponential backoff and jitter after failures."""
        settings = self._settings
        while True:
            raise_if_cancelled()  # one the HTTP client swallowed (picker/sources/cancel.py)
            retrying = AsyncRetrying(
                retry=retry_if_exception_type(Exception),
                wait=wait_exponential(multiplier=settings.backoff_initial_s, max=settings.backoff_max_s)
                + wait_random(0, settings.backoff_initial_s),
                sleep=self._sleep,
                before_sleep=self._before_retry,
            )
            async for attempt in retrying:
                with attempt:
                    await self.sync_once()

    def _handle(self, event: WatchEvent) -> None:
        match event.type:
            case "ADDED" | "MODIFIED" | "DELETED":
                if event.obj is None:
                    raise BadData(f"{event.type} event without an object")
                self._report(self.store.apply(event.type, event.obj))
                self._publish()
            case "BOOKMARK":
                pass
            case "ERROR":
                if event.code == 410:
                    raise Expired(event.message or "resource version too old")
                raise ApiFailure(f"watch ERROR event code={event.code}: {event.message}")
            case other:
                raise BadData(f"unknown watch event type {other!r}")
        if event.version:
            self.version = event.version

    def _report(self, problems: list[str]) -> None:
        for problem in problems:
            if problem not in self._reported:
                if len(self._reported) > 1000:
                    self._reported.clear()
                self._reported.add(problem)
                log.warning("kube %s ignored: %s", self.what.removesuffix("s"), problem)

    def _before_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        pause = state.next_action.sleep if state.next_action is not None else 0.0
        kept = self._kept()
        if isinstance(exc, SourceError):
            self._on_event(exc.kind)
            log.warning(
                "kube %s %s: %s; retrying in %.2f s (attempt %d), routing on the last good view (%d ready)",
                self.what,
                exc.kind,
                exc,
                pause,
                state.attempt_number,
                kept,
            )
        else:
            self._on_event("unexpected")
            self.version = None
            log.error(
                "kube %s source failed unexpectedly; relisting in %.2f s (%d ready)",
                self.what,
                pause,
                kept,
                exc_info=exc,
            )


class _SliceCollection:
    def __init__(self, api: SliceApi) -> None:
        self._api = api

    async def list(self) -> tuple[list[Mapping[str, Any]], str]:
        return await self._api.list_slices()

    def watch(self, version: str, timeout_s: int) -> WatchStream:
        return self._api.watch_slices(version, timeout_s)


class SliceWatcher(ListWatch):
    """Keeps the pool in step with the EndpointSlices the API server has."""

    store: SliceStore

    def __init__(
        self,
        api: SliceApi,
        pool: Pool,
        target: TargetPort,
        settings: WatchSettings,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_event: Callable[[str], None] = lambda _: None,
    ) -> None:
        store = SliceStore(target)
        super().__init__(
            _SliceCollection(api),
            store,
            settings,
            what="slices",
            publish=lambda: pool.reconcile(store.desired(), source=SOURCE),
            kept=lambda: len(pool.ready()),
            sleep=sleep,
            on_event=on_event,
        )
