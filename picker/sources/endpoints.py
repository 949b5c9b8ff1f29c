"""The one configured endpoint source (static list, endpoints file, EndpointSlices or an InferencePool's
pods), owned end to end.

`EndpointSources` builds the source from the config, does its first load in `start()` (a static
list or a file at once, failing loudly; the first Kubernetes list once, retried in the background if
the API server is not there yet), then runs it as one task it owns: an unexpected exit is logged in
one line and is a `problem` for good (the picker stops being ready), and `aclose()` cancels only
that task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from picker.config.model import ConfigError, PickerConfig
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.pool.deletion_cost import PodRef
from picker.pool.pods import PodStore
from picker.pool.slices import TargetPort
from picker.request.objectives import Objectives
from picker.sources import kube, kube_pool, static_file
from picker.sources.deletion_cost import DeletionCostWriter, Parts, PodPatcher, verified
from picker.sources.pool_status import Grants, StatusApi
from picker.sources.pool_status import verified as verify_status

log = logging.getLogger(__name__)


class EndpointSources:
    """Feeds `pool` from whichever source the config names."""

    def __init__(self, config: PickerConfig, pool: Pool, metrics: Metrics) -> None:
        self._config = config
        self._pool = pool
        self._metrics = metrics
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._api: kube.SliceApi | kube_pool.PoolApi | None = None
        self.watcher: kube.SliceWatcher | None = None
        self.file: static_file.EndpointsFile | None = None
        self.pool_source: kube_pool.PoolSource | None = None
        self.selector_source: kube_pool.SelectorSource | None = None
        # kube.deletion_cost: the client that writes the annotation, opened (and its permission
        # asked) in start(); `patch_allowed` False: the API server could not be asked then
        self.pod_patcher: PodPatcher | None = None
        self.patch_allowed = False
        # kube.pool_status: the client that writes the pool's condition and events, opened (and its
        # grants asked) in start(); `status_grants` None: the API server could not be asked then
        self.status_api: StatusApi | None = None
        self.status_grants: Grants | None = None
        # InferenceObjective name -> priority (the pool source with kube.objectives on); else None.
        self.objectives: Objectives | None = (
            Objectives(config.kube.pool_name)
            if config.kube.pool_name is not None and config.kube.objectives
            else None
        )
        # Why the source cannot be trusted to say which endpoints exist (a missing InferencePool);
        # None when it can. Listeners (readiness) hear every change.
        self.problem: str | None = None
        self._problem_listeners: list[Callable[[str | None], None]] = []
        self._stopped = False  # the source task ended on its own
        if config.pool.endpoints:
            pool.apply(ready=config.pool.endpoints, source="static")

    @property
    def name(self) -> str:
        if self._config.kube.pool_name is not None:
            return kube_pool.SOURCE
        if self._config.kube.endpoint_selector is not None:
            return kube_pool.SELECTOR_SOURCE
        if self._config.kube.enabled:
            return kube.SOURCE
        if self._config.pool.endpoints_file is not None:
            return static_file.SOURCE
        return "static"

    async def start(self) -> None:
        """First load, then the background task. ConfigError when the source cannot even start."""
        pool_config, kube_config = self._config.pool, self._config.kube
        if kube_config.deletion_cost:  # first: a refusal stops the start before anything runs
            await self._open_pod_patcher()
        if kube_config.pool_status:
            await self._open_status_api()
        if pool_config.endpoints_file is not None:
            self.file = static_file.EndpointsFile(
                pool_config.endpoints_file,
                self._pool,
                poll_s=pool_config.endpoints_file_poll_s,
                on_event=lambda event: self._metrics.count_source_event(static_file.SOURCE, event),
            )
            try:
                self.file.load()
            except (OSError, static_file.EndpointsFileError) as exc:
                raise ConfigError(f"pool.endpoints_file: {exc}") from exc
            self._spawn(self.file.run())
        elif kube_config.enabled:
            from picker.sources.kube_api import LightkubeSliceApi, load_kubeconfig

            api = LightkubeSliceApi(
                load_kubeconfig(kube_config.kubeconfig),
                selector=kube_config.selector,
                namespace=kube_config.namespace,
                request_timeout_s=kube_config.request_timeout_s,
                read_timeout_s=kube_config.inactivity_deadline_s + kube_config.request_timeout_s,
            )
            self._api = api
            self.watcher = kube.SliceWatcher(
                api,
                self._pool,
                TargetPort.parse(kube_config.target_port),
                kube.WatchSettings(
                    watch_timeout_s=kube_config.watch_timeout_s,
                    inactivity_deadline_s=kube_config.inactivity_deadline_s,
                    backoff_initial_s=kube_config.backoff_initial_s,
                    backoff_max_s=kube_config.backoff_max_s,
                ),
                on_event=lambda event: self._metrics.count_source_event(kube.SOURCE, event),
            )
            log.info(
                "kube source server=%s namespace=%s selector=%s target=%s",
                api.server,
                api.namespace,
                kube_config.selector,
                TargetPort.parse(kube_config.target_port).describe(),
            )
            try:
                await self.watcher.relist()
            except kube.SourceError as exc:
                log.warning("kube first list failed (%s: %s); retrying in the background", exc.kind, exc)
            self._spawn(self.watcher.run())
        elif kube_config.pool_name is not None:
            await self._start_pool_source(kube_config.pool_name)
        elif kube_config.endpoint_selector is not None:
            await self._start_selector_source(
                kube_config.endpoint_selector, kube_config.endpoint_target_ports
            )

    async def _open_pod_patcher(self) -> None:
        """kube.deletion_cost: the patch client, and whether it may patch pods; DeletionCostRefused
        (a ConfigError: the picker does not start) when the API server says it may not."""
        from picker.sources.deletion_cost_api import LightkubePodPatcher
        from picker.sources.kube_api import load_kubeconfig

        kube_config = self._config.kube
        patcher = LightkubePodPatcher(
            load_kubeconfig(kube_config.kubeconfig),
            namespace=kube_config.namespace,
            request_timeout_s=kube_config.request_timeout_s,
        )
        try:
            self.patch_allowed = await verified(patcher)
        except BaseException:
            await patcher.aclose()
            raise
        self.pod_patcher = patcher

    async def _open_status_api(self) -> None:
        """kube.pool_status: the status client and its grants; PoolStatusRefused (a ConfigError: the
        picker does not start) when it may write neither the condition nor events."""
        from picker.sources.kube_api import load_kubeconfig
        from picker.sources.pool_status.api import LightkubePoolStatusApi

        kube_config = self._config.kube
        api = LightkubePoolStatusApi(
            load_kubeconfig(kube_config.kubeconfig),
            namespace=kube_config.namespace,
            request_timeout_s=kube_config.request_timeout_s,
        )
        try:
            self.status_grants = await verify_status(api)
        except BaseException:
            await api.aclose()
            raise
        self.status_api = api

    def run_deletion_cost(self, core: Parts, spawn: Callable[[Coroutine[Any, Any, None], str], None]) -> None:
        """kube.deletion_cost: the writer of the pool pods' annotation, run by `spawn` (nothing when off)."""
        if self.pod_patcher is not None:
            spawn(DeletionCostWriter.of(core).run(), "deletion-cost")

    def pod_refs(self) -> list[PodRef]:
        """The pool's pods as the Kubernetes source lists them (kube.deletion_cost ranks them)."""
        if self.watcher is not None:
            return self.watcher.store.pod_refs()
        pods = self.pool_source.pods if self.pool_source is not None else None
        if self.selector_source is not None:
            pods = self.selector_source.pods
        store = pods.store if pods is not None else None
        return store.pod_refs() if isinstance(store, PodStore) else []

    def on_problem(self, listener: Callable[[str | None], None]) -> None:
        """`listener(problem)` on every change of `problem` (a string: not ready; None: ready again)."""
        self._problem_listeners.append(listener)

    async def _start_pool_source(self, pool_name: str) -> None:
        from picker.sources.kube_api import LightkubePoolApi, load_kubeconfig

        kube_config = self._config.kube
        api = LightkubePoolApi(
            load_kubeconfig(kube_config.kubeconfig),
            namespace=kube_config.namespace,
            request_timeout_s=kube_config.request_timeout_s,
            read_timeout_s=kube_config.inactivity_deadline_s + kube_config.request_timeout_s,
        )
        self._api = api
        self.pool_source = kube_pool.PoolSource(
            api,
            self._pool,
            pool_name,
            kube.WatchSettings(
                watch_timeout_s=kube_config.watch_timeout_s,
                inactivity_deadline_s=kube_config.inactivity_deadline_s,
                backoff_initial_s=kube_config.backoff_initial_s,
                backoff_max_s=kube_config.backoff_max_s,
            ),
            on_event=lambda event: self._metrics.count_source_event(kube_pool.SOURCE, event),
            on_problem=self._set_problem,
            objectives=self.objectives,
        )
        log.info("kube pool source server=%s pool=%s/%s", api.server, api.namespace, pool_name)
        try:
            await self.pool_source.first_load()
        except kube.SourceError as exc:
            log.warning("kube first list failed (%s: %s); retrying in the background", exc.kind, exc)
        self._spawn(self.pool_source.run())

    async def _start_selector_source(self, selector: str, ports: tuple[int, ...]) -> None:
        from picker.sources.kube_api import LightkubePoolApi, load_kubeconfig

        kube_config = self._config.kube
        api = LightkubePoolApi(
            load_kubeconfig(kube_config.kubeconfig),
            namespace=kube_config.namespace,
            request_timeout_s=kube_config.request_timeout_s,
            read_timeout_s=kube_config.inactivity_deadline_s + kube_config.request_timeout_s,
        )
        self._api = api
        self.selector_source = source = kube_pool.SelectorSource(
            api,
            self._pool,
            selector,
            ports,
            self._watch_settings(),
            on_event=lambda event: self._metrics.count_source_event(kube_pool.SELECTOR_SOURCE, event),
        )
        log.info(
            "kube pod source server=%s namespace=%s selector=%s ports=%s",
            api.server,
            api.namespace,
            selector,
            ",".join(map(str, ports)),
        )
        try:
            await source.first_load()
        except kube.SourceError as exc:
            log.warning("kube first list failed (%s: %s); retrying in the background", exc.kind, exc)
        self._spawn(source.run())

    def _watch_settings(self) -> kube.WatchSettings:
        kube_config = self._config.kube
        return kube.WatchSettings(
            watch_timeout_s=kube_config.watch_timeout_s,
            inactivity_deadline_s=kube_config.inactivity_deadline_s,
            backoff_initial_s=kube_config.backoff_initial_s,
            backoff_max_s=kube_config.backoff_max_s,
        )

    def _set_problem(self, problem: str | None) -> None:
        if self._stopped:
            return  # a source that stopped for good stays a problem
        self.problem = problem
        for listener in self._problem_listeners:
            listener(problem)

    async def aclose(self) -> None:
        """Stop the source task this object started, and close its client."""
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # its outcome, if any, was logged by `_ended`
        if self._api is not None:
            await self._api.aclose()
            self._api = None
        if self.pod_patcher is not None:
            await self.pod_patcher.aclose()
            self.pod_patcher = None
        if self.status_api is not None:
            await self.status_api.aclose()
            self.status_api = None

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        self._task = asyncio.get_running_loop().create_task(work, name=f"endpoint-source-{self.name}")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The source task ended without `aclose()`: it will never update the pool again.

        The pool keeps its last view, but nothing will drain or remove an endpoint any more, so the
        picker stops being ready (a `problem` for good): one log line says why.
        """
        if task.cancelled() and self._closing:
            return
        exc = None if task.cancelled() else task.exception()
        why = "cancelled" if exc is None and task.cancelled() else "returned"
        if exc is not None:
            why = f"{type(exc).__name__}: {str(exc)[:300]}"
        problem = f"endpoint source {self.name} stopped unexpectedly ({why})"
        log.error("%s; the pool keeps its last view and the picker is no longer ready", problem)
        if exc is not None:
            log.debug("endpoint source %s failure", self.name, exc_info=exc)
        self._set_problem(problem)
        self._stopped = True
