"""The InferencePool source: the pool named by `--pool-name`, its pods as endpoints; both watched.

Two `ListWatch` loops (kube.py: list, watch from that version with bookmarks, 410 relist,
inactivity deadline, backoff), one inside the other:
- the InferencePool itself (a field selector on its name): its `selector` and `targetPorts`;
- the pods that selector picks: pod IP x each target port, states as picker/pool/pods.py reads them.
A change of the pool's selector restarts the pod watch with the new selector (its first list replaces
the whole view); a change of targetPorts alone re-reads the same pods. A missing or invalid pool is
reported once through `on_problem` (the picker stops being ready) and the last good view stays; a
usable pool again clears it. Given an `Objectives` (picker/request/objectives.py), a third loop keeps it in
step with the namespace's InferenceObjectives (request priorities). The API sits behind `PoolApi`
(kube_api.LightkubePoolApi).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from picker.pool import Pool
from picker.pool.pods import PodStore, PoolSpec, PoolSpecStore
from picker.request.objectives import Objectives
from picker.sources.kube import Collection, ListWatch, SourceError, WatchSettings

log = logging.getLogger(__name__)

SOURCE = "kube-pool"
SELECTOR_SOURCE = "kube-pods"  # pods by label selector, without an InferencePool (--endpoint-selector)


class PoolApi(Protocol):
    """The collections the pool source watches (implemented over lightkube in kube_api.py)."""

    namespace: str

    def pools(self, name: str) -> Collection: ...

    def pods(self, selector: str) -> Collection: ...

    def objectives(self) -> Collection: ...

    async def aclose(self) -> None: ...


class PoolSource:
    """Keeps the pool in step with the pods of one InferencePool, following the pool's own changes."""

    def __init__(
        self,
        api: PoolApi,
        pool: Pool,
        name: str,
        settings: WatchSettings,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_event: Callable[[str], None] = lambda _: None,
        on_problem: Callable[[str | None], None] = lambda _: None,
        objectives: Objectives | None = None,
    ) -> None:
        self._api = api
        self._pool = pool
        self._settings = settings
        self._sleep = sleep
        self._on_event = on_event
        self._on_problem = on_problem
        self.name = f"{api.namespace}/{name}"
        self._spec_store = PoolSpecStore(api.namespace, name)
        self.pool_watch = ListWatch(
            api.pools(name),
            self._spec_store,
            settings,
            what="inferencepools",
            publish=self._pool_changed,
            kept=self._kept,
            sleep=sleep,
            on_event=on_event,
        )
        self.spec: PoolSpec | None = None
        self.problem: str | None = None
        self.pods: ListWatch | None = None
        self._pods_task: asyncio.Task[None] | None = None
        self._running = False
        self.restarts = 0  # pod watches restarted for a new selector
        self.objectives_watch = (
            ListWatch(
                api.objectives(),
                objectives,
                settings,
                what="inferenceobjectives",
                publish=lambda: None,  # read live by the request path
                kept=self._kept,
                sleep=sleep,
                on_event=on_event,
            )
            if objectives is not None
            else None
        )
        self._objectives_task: asyncio.Task[None] | None = None

    async def first_load(self) -> None:
        """The pool and its pods once each; raises the first SourceError (run() retries). Then the
        objectives, whose failure only delays priorities (the header still works meanwhile)."""
        await self.pool_watch.relist()
        if self.pods is not None and self.pods.version is None:
            await self.pods.relist()
        if self.objectives_watch is not None:
            try:
                await self.objectives_watch.relist()
            except SourceError as exc:
                log.warning(
                    "kube InferenceObjectives not readable yet (%s: %s); default priorities until they are",
                    exc.kind,
                    exc,
                )

    async def run(self) -> None:
        """Forever: the pool's watch here, its pods' watch in a child task this object owns."""
        self._running = True
        if self.pods is not None and self._pods_task is None:
            self._spawn_pods()
        if self.objectives_watch is not None:
            self._objectives_task = self._spawn(self.objectives_watch.run(), "kube-pool-objectives")
        try:
            await self.pool_watch.run()
        finally:
            self._running = False
            children = [t for t in (self._pods_task, self._objectives_task) if t is not None]
            self._pods_task = self._objectives_task = None
            for task in children:
                task.cancel()
            if children:
                await asyncio.wait(children)  # their watches closed before the client is

    def _pool_changed(self) -> None:
        current = self._spec_store.current()
        if isinstance(current, str):
            if current != self.problem:
                log.error("%s; not ready, routing on the last good view (%d ready)", current, self._kept())
                self.problem = current
                self._on_problem(current)
            return
        if self.problem is not None:
            log.info("InferencePool %s is usable again", self.name)
            self.problem = None
            self._on_problem(None)
        previous, self.spec = self.spec, current
        if previous is None or previous.selector != current.selector or self.pods is None:
            log.info(
                "InferencePool %s selector=%s target_ports=%s",
                self.name,
                current.label_selector,
                ",".join(map(str, current.ports)),
            )
            self._watch_pods(current)
        elif previous.ports != current.ports:
            log.info("InferencePool %s target_ports=%s", self.name, ",".join(map(str, current.ports)))
            store = self.pods.store
            assert isinstance(store, PodStore)
            store.set_ports(current.ports)
            self._publish_pods(store)

    def _watch_pods(self, spec: PoolSpec) -> None:
        """A new pod watch for this selector; its first list replaces the view."""
        if self.pods is not None:
            self.restarts += 1
        self._stop_pods()
        store = PodStore(spec.ports)
        self.pods = ListWatch(
            self._api.pods(spec.label_selector),
            store,
            self._settings,
            what="pods",
            publish=lambda: self._publish_pods(store),
            kept=self._kept,
            sleep=self._sleep,
            on_event=self._on_event,
        )
        if self._running:
            self._spawn_pods()

    def _publish_pods(self, store: PodStore) -> None:
        if self.pods is not None and self.pods.store is store:  # never a replaced watch's late word
            self._pool.reconcile(
                store.desired(), source=SOURCE, labels=store.labels(), instances=store.instances()
            )

    def _spawn_pods(self) -> None:
        assert self.pods is not None
        self._pods_task = self._spawn(self.pods.run(), "kube-pool-pods")

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work, name=name)
        task.add_done_callback(self._child_ended)
        return task

    def _stop_pods(self) -> None:
        task, self._pods_task = self._pods_task, None
        if task is not None:
            task.cancel()

    def _child_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        log.error("%s of %s stopped unexpectedly", task.get_name(), self.name, exc_info=task.exception())

    def _kept(self) -> int:
        return len(self._pool.ready())


class SelectorSource:
    """The pods one label selector picks, at fixed ports: the reference picker's `--endpoint-selector`
    with `--endpoint-target-ports`, for a pool with no InferencePool object. One `ListWatch` (RBAC:
    get/list/watch pods); pod states as picker/pool/pods.py reads them."""

    def __init__(
        self,
        api: PoolApi,
        pool: Pool,
        selector: str,
        ports: tuple[int, ...],
        settings: WatchSettings,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_event: Callable[[str], None] = lambda _: None,
    ) -> None:
        self._pool = pool
        self.store = PodStore(ports)
        self.name = f"{api.namespace}/{selector}"
        self.pods = ListWatch(
            api.pods(selector),
            self.store,
            settings,
            what="pods",
            publish=lambda: pool.reconcile(
                self.store.desired(),
                source=SELECTOR_SOURCE,
                labels=self.store.labels(),
                instances=self.store.instances(),
            ),
            kept=lambda: len(pool.ready()),
            sleep=sleep,
            on_event=on_event,
        )

    async def first_load(self) -> None:
        await self.pods.relist()

    async def run(self) -> None:
        await self.pods.run()
