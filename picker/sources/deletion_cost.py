"""kube.deletion_cost: the pool's pods ranked for the ReplicaSet controller, kept in step.

Every `scale_down.step_s` the writer reads the live requests and the pool's pods (from the
endpoint source: an InferencePool's or a selector's pods, or the pods EndpointSlices name in their
targetRef), costs each pod (picker/pool/deletion_cost.py) and writes the annotation values the
ranking asks for (picker/pool/deletion_rank.py: a sticky order, a pod at most once per
`kube.deletion_cost_interval_s`, at most `scale_down.max_writes` a step). A write is a JSON merge
patch of that one annotation (deletion_cost_api.py); nothing else on the pod is touched.

One writer per pool: with leader election only the Lease's holder writes; with peers (active-active)
the picker whose peer name sorts first among itself and the peers it is linked to (until the links
are up, at start, and across a partition, two may write: each within the same bounds); otherwise
every picker pointed at the pool writes (run one, or turn on one of the two). A picker that stops
writing forgets what it wrote, so the next writer starts from what the pods say.

Patching pods is a broad permission: the picker asks the API server (SelfSubjectAccessReview) at
start and refuses to start without it (`DeletionCostRefused`); when the review cannot be made then,
it starts and asks again before its first write, writing nothing until allowed. An API server that
does not serve the review (404; a proxy in front of it may not) gives no answer either way: the
picker says so once, never asks again, and lets the patches say. A patch refused (403) is counted
(`forbidden`) and holds the writes back, for longer at each refusal up to `_REFUSED_MAX_S`, so a
picker without the grant sends a patch every few minutes, not every step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

from picker.config.model import ConfigError, PickerConfig
from picker.observability.metrics import Metrics
from picker.peers.books import Peering
from picker.pool import Pool
from picker.pool.deletion_cost import CostPolicy, PodRef, Stream, pod_work, times_per_token
from picker.pool.deletion_rank import Ranker, RankPolicy, ScaleDownRanks, next_to_go
from picker.request.live_work import live_streams
from picker.sources.cancel import raise_if_cancelled
from picker.sources.kube import ReviewNotServed, SourceError
from picker.streams import RequestRecord

log = logging.getLogger(__name__)

_REFUSED_FIRST_S = 5.0  # writes held back after a first refused patch; doubled at each next one
_REFUSED_MAX_S = 300.0


class DeletionCostRefused(ConfigError):
    """kube.deletion_cost is on and the API server says this picker may not patch pods."""


class PodPatcher(Protocol):
    """What the writer needs of the API server (deletion_cost_api.LightkubePodPatcher)."""

    namespace: str

    async def may_patch(self, namespace: str) -> tuple[bool, str]: ...

    async def annotate(self, pod: PodRef, value: int) -> None: ...

    async def aclose(self) -> None: ...


class PodSource(Protocol):
    """The endpoint source, as far as the writer goes (picker/sources/endpoints.py)."""

    pod_patcher: PodPatcher | None
    patch_allowed: bool

    def pod_refs(self) -> list[PodRef]: ...


class LiveRequests(Protocol):
    """The request path, as far as the writer goes (picker/request/pipeline.py)."""

    peering: Peering | None

    def live_records(self) -> list[RequestRecord]: ...


class Parts(Protocol):
    """What the writer is made from: the core every frontend shares (picker/wiring.py `Core`)."""

    @property
    def config(self) -> PickerConfig: ...
    @property
    def sources(self) -> PodSource: ...
    @property
    def path(self) -> LiveRequests: ...
    @property
    def pool(self) -> Pool: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def leader(self) -> Callable[[], bool] | None: ...


def refusal(namespace: str, reason: str) -> str:
    why = f" ({reason})" if reason else ""
    return (
        f"kube.deletion_cost: this picker may not patch pods in namespace {namespace}{why}; grant it "
        "(config/k8s/deletion-cost-rbac.yaml) or turn the feature off"
    )


_LET_THE_PATCHES_SAY = (
    "the review is not served: not asked again, the patches will say whether they are allowed"
)


async def verified(patcher: PodPatcher) -> bool:
    """At start: True when allowed (or when the review is not served: the patches will say), False
    when the review could not be made (asked again before the first write); DeletionCostRefused
    when the API server says no."""
    try:
        allowed, reason = await patcher.may_patch(patcher.namespace)
    except ReviewNotServed as exc:
        log.warning("kube.deletion_cost: %s; %s", exc, _LET_THE_PATCHES_SAY)
        return True
    except SourceError as exc:
        log.warning(
            "kube.deletion_cost: cannot ask whether pods may be patched (%s); asking again later", exc
        )
        return False
    if not allowed:
        raise DeletionCostRefused(refusal(patcher.namespace, reason))
    return True


def writer_gate(leader: Callable[[], bool] | None, peering: Peering | None) -> Callable[[], bool]:
    """Whether this picker is the pool's one writer now (see the module's docstring)."""
    if leader is not None:
        return leader
    if peering is not None:

        def first_linked() -> bool:
            unlinked = set(peering.unlinked())
            return peering.name == min([peering.name, *(p for p in peering.peers if p not in unlinked)])

        return first_linked
    return lambda: True


class DeletionCostWriter:
    """The step (cost, rank, write) and its loop; counts what it wrote and what it held back."""

    def __init__(
        self,
        patcher: PodPatcher,
        pods: Callable[[], Sequence[PodRef]],
        streams: Callable[[], Sequence[Stream]],
        pool: Pool,
        cost: CostPolicy,
        rank: RankPolicy,
        *,
        step_s: float,
        steer_s: float = 0.0,
        writing: Callable[[], bool] = lambda: True,
        allowed: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._patcher = patcher
        self._pods, self._streams, self._pool = pods, streams, pool
        self.cost, self.ranker = cost, Ranker(rank)
        self.step_s = step_s
        self.steer_s = steer_s  # scale_down.steer_s: 0 leaves the placement unsteered
        self._writing = writing
        self.allowed = allowed  # the API server said this picker may patch pods
        self._clock = clock
        self.writer = False  # whether the last step found this picker to be the writer
        self.writes: Counter[str] = Counter()  # written | gone | forbidden | failed
        self.skipped: Counter[str] = Counter()  # interval | bound | standby | forbidden
        self.problem: str | None = None  # the last failure, logged once
        self._held_until = 0.0  # after a refused patch: no writes before this (clock)
        self._hold_s = 0.0  # how long the last refusal held them back

    @classmethod
    def of(cls, core: Parts) -> DeletionCostWriter:
        """The writer over the endpoint source's pods and patcher and the request path's live
        requests, with `scale_down`'s figures, counted in the core's metrics."""
        source, config = core.sources, core.config
        assert source.pod_patcher is not None
        s = config.scale_down
        writer = cls(
            source.pod_patcher,
            source.pod_refs,
            lambda: live_streams(core.path.live_records()),
            core.pool,
            CostPolicy(s.unknown_tokens, s.time_per_token_s, s.work_weight, s.cache_s),
            RankPolicy(config.kube.deletion_cost_interval_s, s.margin_s, s.margin_ratio, s.max_writes),
            step_s=s.step_s,
            steer_s=s.steer_s,
            writing=writer_gate(core.leader, core.path.peering),
            allowed=source.patch_allowed,
        )
        core.metrics.register_deletion_cost(writer.figures)
        return writer

    def figures(self) -> tuple[bool, Counter[str], Counter[str]]:
        """For the metrics: (writing now, writes by result, changes held back by why)."""
        return self.writer, self.writes, self.skipped

    async def step(self) -> int:
        """One round: the writes made (0 when standing by, or when the ranks hold)."""
        if not self._writing():
            self._steer(self._pods(), lambda pod: pod.value, self._streams())  # as the pods say
            if self.writer:
                log.info("kube.deletion_cost: another picker writes now; standing by")
                self.ranker.reset()
            self.writer = False
            self.skipped["standby"] += 1
            return 0
        if not self.writer:
            log.info("kube.deletion_cost: this picker writes the pool's pod-deletion-cost annotations")
        self.writer = True
        if not self.allowed and not await self._ask():
            self._steer(self._pods(), lambda pod: pod.value, self._streams())  # as the pods say
            return 0
        pods = self._pods()
        now = self._clock()
        streams = self._streams()
        if now < self._held_until:  # a patch was refused: not one a step
            self.skipped["forbidden"] += 1
            self._steer(pods, lambda pod: pod.value, streams)
            return 0
        work = pod_work(pods, streams, {e.address: e for e in self._pool.endpoints()}, self.cost, now)
        self.ranker.keep_only({pod.key for pod in pods})
        plan = self.ranker.plan(pods, {key: w.cost for key, w in work.items()}, now)
        self.skipped["interval"] += plan.deferred
        self.skipped["bound"] += plan.over_bound
        made = 0
        for write in plan.writes:
            try:
                await self._patcher.annotate(write.pod, write.value)
            except SourceError as exc:
                self.writes[exc.kind if exc.kind in ("gone", "forbidden") else "failed"] += 1
                if exc.kind == "forbidden":
                    self._hold_s = min(max(2 * self._hold_s, _REFUSED_FIRST_S), _REFUSED_MAX_S)
                    self._held_until = self._clock() + self._hold_s
                if exc.kind != "gone":
                    self._failed(exc)
                    break  # the API server is unhappy: the rest waits for the next step
                continue
            except Exception as exc:  # a surprise (a bug, the client library's): one failed write a step
                self.writes["failed"] += 1
                self._failed(f"{type(exc).__name__}: {exc}")
                break
            self.ranker.wrote(write.pod, write.value, self._clock())
            self.writes["written"] += 1
            made += 1
            self.problem, self._hold_s = None, 0.0
        self._steer(pods, self.ranker.current, streams)
        if made and log.isEnabledFor(logging.DEBUG):
            order = ", ".join(f"{key}={work[key].cost:.2f}s/{work[key].streams}" for key in plan.order)
            log.debug("kube.deletion_cost: %d written; order (cost/streams) %s", made, order)
        return made

    def _steer(
        self, pods: Sequence[PodRef], value: Callable[[PodRef], int | None], streams: Sequence[Stream]
    ) -> None:
        """Tell the placement where each pod stands in the next scale-down (by the values the
        controller will read), and how many output tokens make a request long enough to keep off
        the first to go: scale_down.steer_s at the pool's measured pace (else the configured one)."""
        if not self.steer_s:
            return
        pace = times_per_token(streams, self._clock())[1] or self.cost.time_per_token_s
        self._pool.scale_down = ScaleDownRanks(next_to_go(pods, value), max(1, round(self.steer_s / pace)))

    async def _ask(self) -> bool:
        try:
            allowed, reason = await self._patcher.may_patch(self._patcher.namespace)
        except ReviewNotServed as exc:
            self._failed(f"{exc}; {_LET_THE_PATCHES_SAY}")
            self.allowed = True
            return True
        except SourceError as exc:
            self._failed(exc)
            return False
        if not allowed:
            self._failed(refusal(self._patcher.namespace, reason))
            return False
        self.allowed = True
        return True

    def _failed(self, problem: object) -> None:
        text = str(problem)
        if text != self.problem:
            log.warning("kube.deletion_cost: %s", text)
        self.problem = text

    async def run(self) -> None:
        """Forever; a step that raises is logged and the next one runs. The patcher is the endpoint
        source's (picker/sources/endpoints.py): it closes it."""
        while True:
            raise_if_cancelled()  # one the HTTP client swallowed (picker/sources/cancel.py)
            try:
                await self.step()
            except Exception:
                log.exception("kube.deletion_cost step failed; the next one runs in %.1f s", self.step_s)
            await asyncio.sleep(self.step_s)  # the step's period, not a synchronisation
