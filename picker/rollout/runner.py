"""The canary at run time: its tick every `rollout.tick_s`, the drains and undrains it asks for
(through the same drain store as the admin API, so every picker replica applies them), a log line
per decision, and the commands `picker rollout promote | abort | resume | pause` send.

A rollback's drains carry the cause `rollback` with the rollout's id (`<label>=<candidate>`) in the
shared record; `resume` lifts every drain of that cause and nothing else, whichever picker made
them and whether or not this one has restarted since: an operator's drain or a preStop hook's of the
same address stays (picker/sources/drain_causes.py).

The rule lives in picker/rollout; this module only clocks it and carries out what it returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from picker.config.model import PickerConfig
from picker.pool import EndpointConflict, EndpointState, Pool, UnknownEndpoint
from picker.request.pipeline import RequestPath
from picker.rollout import CANDIDATE, Actions, Canary, CanaryPlan
from picker.rollout.gates import EVIDENCE, HINT, UNOBSERVABLE
from picker.sources.drain_causes import Cause, rollback
from picker.sources.drain_store import DrainRecordUnavailable, DrainStore

log = logging.getLogger(__name__)

COMMANDS = ("promote", "abort", "resume", "pause")


class RolloutRunner:
    """Clocks one `Canary` over the pool and applies its actions."""

    def __init__(
        self,
        canary: Canary,
        pool: Pool,
        tick_s: float,
        *,
        drain_on_rollback: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.canary, self.pool, self.tick_s = canary, pool, tick_s
        self.drain_on_rollback = drain_on_rollback
        self.clock = clock
        self.store: DrainStore | None = None  # set by the wiring once the admin drains are open
        # rollout.move_streams (picker proxy with streams.resume): a rollback moves the candidate's
        # streams to stable replicas rather than let them run on the version it rolled back; as the
        # admin move does, on every picker sharing the books (picker/peers/moves.py `everywhere`)
        # (how many moved, and each peer not reached with why)
        self.move_streams: Callable[[str], Awaitable[tuple[int, dict[str, str]]]] | None = None
        self._logged = canary.events
        self._unobservable: set[str] = set()  # gates said to be unobservable here (said once each)
        self.cause: Cause = rollback(canary.plan.rollout_id)  # what its rollback's drains record

    def candidates(self) -> list[str]:
        """The candidate group's endpoints a rollback would drain: not gone, and not draining
        already (an operator's or its source's drain stays theirs)."""
        canary = self.canary
        return [
            e.address
            for e in self.pool.endpoints()
            if e.state not in (EndpointState.GONE, EndpointState.DRAINING)
            and canary.group_of(e.labels) == CANDIDATE
        ]

    async def run(self) -> None:
        """Forever: one tick every `tick_s`. A tick that raises is logged; the next one runs."""
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.tick()
            except Exception:
                log.exception("rollout tick failed; the next one runs in %.2f s", self.tick_s)

    async def tick(self) -> None:
        await self.apply(self.canary.tick(self.clock(), self.candidates()))
        for reading in self.canary.readings:
            if reading.verdict == UNOBSERVABLE and reading.gate not in self._unobservable:
                self._unobservable.add(reading.gate)
                log.warning(
                    "rollout gate %s %s (it reads %s); the steps end on the gates that can judge",
                    reading.gate,
                    HINT,
                    EVIDENCE[reading.gate],
                )

    async def command(self, verb: str) -> dict[str, Any]:
        """One operator command; the status after it."""
        canary, now = self.canary, self.clock()
        lift = False
        match verb:
            case "promote":
                actions = canary.promote(now)
            case "abort":
                actions = canary.abort(now, self.candidates())
            case "resume":  # lifts its rollback's drains, even those this picker never knew of
                actions, lift = canary.resume(now), True
            case "pause":
                canary.pause(now)
                actions = Actions()
            case _:
                raise ValueError(f"unknown rollout command {verb!r}: {', '.join(COMMANDS)}")
        await self.apply(actions, lift=lift)
        return self.status()

    def status(self) -> dict[str, Any]:
        """The canary's status; `clock_to_wall_s` turns its times (`at_s`) into wall-clock seconds;
        `rollback_drains`: the addresses its rollback's drains hold now (as this picker reads them)."""
        held = {} if self.store is None else self.store.drained_by()
        return {
            "clock_to_wall_s": round(time.time() - self.clock(), 3),
            "id": self.cause.rollout,
            "rollback_drains": sorted(a for a, causes in held.items() if self.cause in causes),
            **self.canary.status(self.clock()),
        }

    async def apply(self, actions: Actions, *, lift: bool = False) -> None:
        """Drain what the canary asks (each candidate's pod, caused by this rollout's rollback);
        `lift`: lift every drain of that cause (a `resume`), not only those this picker made."""
        self._log_events()
        if self.store is None:
            return
        drained: list[str] = []
        for address in actions.drain if self.drain_on_rollback else []:
            # a rollback drains the candidate's pod, not its IP: a later pod given that IP is not drained
            endpoint = self.pool.get(address)
            pod = endpoint.instance if endpoint is not None else None
            try:
                await self.store.drain(address, cause=self.cause, pod=pod)
                log.info("rollout drain address=%s pod=%s cause=%s", address, pod or "-", self.cause)
                drained.append(address)
            except (EndpointConflict, UnknownEndpoint, DrainRecordUnavailable) as exc:
                log.warning("rollout drain address=%s not done: %s", address, exc)
        await self._move(drained)
        if lift or actions.undrain:
            try:
                lifted = await self.store.lift(self.cause)
                log.info("rollout undrain cause=%s addresses=%s", self.cause, ",".join(lifted) or "-")
            except (EndpointConflict, DrainRecordUnavailable) as exc:
                log.warning("rollout undrain cause=%s not done: %s", self.cause, exc)

    async def _move(self, addresses: list[str]) -> None:
        """Move the streams off the drained `addresses` together: the peers are asked for
        `ASKING_AT_ONCE` of them at a time (picker/peers/moves.py: within a peer's pre-hello places),
        so a peer that does not answer holds the rollback one ask's timeout per such round at most.
        A peer not reached (its streams on the endpoint left where they were) is a warning."""
        if self.move_streams is None or not addresses:
            return
        counts = await asyncio.gather(*(self.move_streams(a) for a in addresses), return_exceptions=True)
        for address, result in zip(addresses, counts, strict=True):
            if isinstance(result, BaseException):
                log.warning("rollout moving streams off %s failed: %r", address, result)
                continue
            moved, unreached = result
            if unreached:
                log.warning(
                    "rollout moves %d stream(s) off %s; %d peer(s) not reached (their streams stay): %s",
                    moved,
                    address,
                    len(unreached),
                    ",".join(f"{peer}({why})" for peer, why in unreached.items()),
                )
            else:
                log.info("rollout moves %d stream(s) off %s", moved, address)

    def _log_events(self) -> None:
        """One log line per decision the canary took since the last look (steps, rollback, ...)."""
        canary = self.canary
        fresh = min(canary.events - self._logged, len(canary.history))
        self._logged = canary.events
        for event in list(canary.history)[len(canary.history) - fresh :]:
            kind = event["event"]
            if kind == "rolled-back":
                log.warning(
                    "rollout rolled back reason=%s weight=0 candidate=%s gates=%s",
                    event.get("reason"),
                    canary.plan.candidate,
                    json.dumps((canary.rollback or {}).get("gates", []), separators=(",", ":")),
                )
            elif kind == "step-ended":
                log.info(
                    "rollout step ended weight=%s routed=%s share=%s",
                    event["weight"],
                    event["routed"],
                    event["share"],
                )
            else:
                log.info("rollout %s weight=%s", kind, event.get("weight"))


def start_rollout(config: PickerConfig, pool: Pool, path: RequestPath) -> RolloutRunner:
    """The canary of `rollout.*`: its split in the request path, its clock in a runner."""
    r = config.rollout
    plan = CanaryPlan.of(r)
    canary = path.canary = Canary(plan, pool.now())
    log.info("rollout canary label=%s candidate=%s steps=%s", r.group_label, r.candidate, list(r.steps))
    for gate, evidence in EVIDENCE.items():
        log.info("rollout gate %s judges from %s", gate, evidence)
    return RolloutRunner(canary, pool, r.tick_s, drain_on_rollback=r.drain_on_rollback)
