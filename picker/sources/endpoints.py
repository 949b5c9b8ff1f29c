"""The one configured endpoint source (static list, endpoints file or EndpointSlices), owned end to end.

`EndpointSources` builds the source from the config, does its first load in `start()` (a static
list or a file at once, failing loudly; the first Kubernetes list once, retried in the background if
the API server is not there yet), then runs it as one task it owns: an unexpected exit is logged, and
`aclose()` cancels only that task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from picker.config import ConfigError, PickerConfig
from picker.pool import Pool
from picker.pool.slices import TargetPort
from picker.sources import kube, static_file
from picker.telemetry import Metrics

log = logging.getLogger(__name__)


class EndpointSources:
    """Feeds `pool` from whichever source the config names."""

    def __init__(self, config: PickerConfig, pool: Pool, metrics: Metrics) -> None:
        self._config = config
        self._pool = pool
        self._metrics = metrics
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._api: kube.SliceApi | None = None
        self.watcher: kube.SliceWatcher | None = None
        self.file: static_file.EndpointsFile | None = None
        if config.pool.endpoints:
            pool.apply(ready=config.pool.endpoints, source="static")

    @property
    def name(self) -> str:
        if self._config.kube.enabled:
            return kube.SOURCE
        if self._config.pool.endpoints_file is not None:
            return static_file.SOURCE
        return "static"

    async def start(self) -> None:
        """First load, then the background task. ConfigError when the source cannot even start."""
        pool_config, kube_config = self._config.pool, self._config.kube
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

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        self._task = asyncio.get_running_loop().create_task(work, name=f"endpoint-source-{self.name}")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() and self._closing:
            return
        exc = None if task.cancelled() else task.exception()
        log.error(
            "endpoint source %s stopped unexpectedly; the pool keeps its last view",
            self.name,
            exc_info=exc,
        )
