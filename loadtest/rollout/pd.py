"""A rollout of a prefill / decode pool: the fleet (each replica with its role and revision), the
load (long unique prompts, so the prefill hop is taken), the three setups it is run against, and what
the simulators' own books say afterwards (pairs, pulls).

The pool: prefill x2 and decode x2 (the decode replicas play llm-d's routing sidecar, `--pd-sidecar`),
revision v1; each is replaced by a v2 replica of the same role, one at a time (maxSurge 1), in the
order P1, D1, P2, D2 (two Deployments rolling at the same pace). The setups:
- `PdPickerSetup(roles=True)`: Envoy + the picker, the endpoints file naming each replica's role and
  its revision label; a replica leaves as a preStop drain makes it: the file marks it draining, it is
  stopped once the picker's view counts nothing in flight on it and no KV pull pending from it (or at
  the bound), then removed from the file.
- `PdPickerSetup(roles=False)`: the same with no roles in the file (a flat pool): no pairs, the decode
  replicas' sidecars get no header and compute the prompt themselves; prefill replicas serve like any.
- `PdRoundRobinSetup`: Envoy alone, round robin over all four (rollout.setups.RoundRobinSetup).
Before a replica is stopped its request log and its `kv_transfer` counters are read (`Books`).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest import http_client
from loadtest.procs import Proc, wait_until
from loadtest.rollout.fleet import Fleet
from loadtest.rollout.load import Arrival, LoadReport, Outcome
from loadtest.rollout.setups import PickerSetup, RoundRobinSetup, _replace
from loadtest.sse_client import stream_request
from picker.drain import scorecard

VERSION_LABEL = "app.kubernetes.io/version"
PREFILLER = "x-prefiller-host-port"
ROLES = ("prefill", "decode", "prefill", "decode")  # the order the rollout replaces them in
# The simulator's P/D timing for these benchmarks: a 20 ms step to the first token, 10 ms a token,
# prefill as a shared compute of 20,000 prompt tokens/s, a KV pull of 5 ms + 0.2 ms a 16-token block.
PD_SIM_ARGS = (
    "--ttft-ms", "20", "--itl-ms", "10", "--prefill-tokens-per-s", "20000",
    "--kv-transfer-ms", "5", "--kv-transfer-per-block-ms", "0.2", "--max-num-seqs", "64",
)  # fmt: skip


def prompt(index: int, tokens: int, salt: str = "") -> str:
    """A prompt of about `tokens` tokens (the simulator counts 4 characters a token), unique from its
    first block on (per index and `salt`), so no replica holds any of it."""
    head = f"{salt}request {index:06d}. "
    body = "Summarise the quarterly report, citing each table. " * (1 + tokens * 4 // 51)
    return (head + body)[: max(len(head), tokens * 4)]


def body_of(index: int, arrival: Arrival, prompt_tokens: int, salt: str = "") -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "prompt": prompt(index, prompt_tokens, salt),
        "max_tokens": arrival.max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


class PdFleet(Fleet):
    """A fleet whose replica i (and its replacement) runs with role ROLES[i]; first v1, then v2."""

    def __init__(self, workdir: Path, sim_args: Sequence[str], roles: Sequence[str] = ROLES) -> None:
        super().__init__(workdir, len(roles), sim_args)
        self.roles = {
            a: r for pair in (self.first, self.replacements) for a, r in zip(pair, roles, strict=True)
        }
        self.revisions = {**dict.fromkeys(self.first, "v1"), **dict.fromkeys(self.replacements, "v2")}

    def launch(self, address: str) -> Proc:
        role = self.roles[address]
        extra = ["--role", role, *(["--pd-sidecar"] if role == "decode" else [])]
        saved = self.sim_args
        self.sim_args = [*saved, *extra]
        try:
            return super().launch(address)
        finally:
            self.sim_args = saved

    def lane_names(self) -> dict[str, str]:
        names = {}
        count = {"prefill": 0, "decode": 0}
        for old, new in zip(self.first, self.replacements, strict=True):
            role = self.roles[old]
            count[role] += 1
            letter = role[0].upper()
            names[old] = f"{letter}{count[role]} v1  :{old.rsplit(':', 1)[1]}"
            names[new] = f"{letter}{count[role]} v2  :{new.rsplit(':', 1)[1]}"
        return names


@dataclass
class Books:
    """What the simulators recorded: request logs and kv_transfer counters, read before each replica
    stops (and at the end for the rest)."""

    requests: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    kv: dict[str, dict[str, Any]] = field(default_factory=dict)

    def read(self, address: str) -> None:
        try:
            answer = http_client.get(f"http://{address}/sim/requests", timeout=5).json()
            state = http_client.get(f"http://{address}/sim/state", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return
        self.requests[address] = list(answer["requests"] if isinstance(answer, dict) else answer)
        self.kv[address] = dict(state.get("kv_transfer") or {})

    def counts(self, roles: dict[str, str], revisions: dict[str, str]) -> dict[str, int]:
        return count_pairs(self.requests, self.kv, roles, revisions)


def count_pairs(
    requests: dict[str, list[dict[str, Any]]],
    kv: dict[str, dict[str, Any]],
    roles: dict[str, str],
    revisions: dict[str, str],
) -> dict[str, int]:
    """pairs: decodes that named a prefill replica; cross: of them, one of another revision than the
    decode's; steps: prefill steps served; on_prefill: client requests a prefill-only replica served
    itself; pulls_failed: the decode replicas' failed KV pulls (the prefill replica gone, or its blocks)."""
    pairs = cross = steps = on_prefill = 0
    for address, records in requests.items():
        for record in records:
            if record.get("remote_decode"):
                steps += 1
                continue
            if roles.get(address) == "prefill":
                on_prefill += 1
            named = record.get("prefiller")
            if named:
                pairs += 1
                cross += revisions.get(named) != revisions.get(address)
    failed = sum(int(state.get("pulls_failed", 0)) for state in kv.values())
    return {"pairs": pairs, "cross": cross, "steps": steps, "on_prefill": on_prefill, "pulls_failed": failed}


Target = Callable[[int], tuple[str, dict[str, str]]]  # request index -> (base URL, headers)


async def replay_to(
    target: Target,
    arrivals: Sequence[Arrival],
    prompt_tokens: int,
    *,
    origin: float | None = None,
    read_timeout_s: float = 10.0,
    salt: str = "",
    first: Callable[[int], None] | None = None,
    done: Callable[[int], None] | None = None,
) -> LoadReport:
    """Send every arrival at its time (open loop) to where `target` says, with a unique prompt of
    `prompt_tokens` tokens (`salt`: unique across runs too); `first(index)` at its first event,
    `done(index)` once its outcome is known. Bounded by the arrivals and the read timeout."""
    report = LoadReport()
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    started = time.monotonic() if origin is None else origin

    async def one(client: httpx.AsyncClient, index: int, arrival: Arrival) -> None:
        await asyncio.sleep(max(0.0, arrival.at_s - (time.monotonic() - started)))
        sent = time.monotonic() - started
        url, headers = target(index)
        body = body_of(index, arrival, prompt_tokens, salt)
        flowing = asyncio.Event()
        watch = asyncio.create_task(flowing.wait())
        if first is not None:
            watch.add_done_callback(lambda _t: first(index) if flowing.is_set() else None)
        try:
            result = await stream_request(
                client,
                url + "/v1/completions",
                body,
                headers=headers or None,
                read_timeout=read_timeout_s,
                first_event=flowing,
            )
        finally:
            flowing.set()  # set at the end too (stream_request's contract): `first` is called once
            if done is not None:
                done(index)
        await watch
        report.outcomes.append(Outcome(sent, result))

    async with http_client.AsyncClient(limits=limits) as client, asyncio.TaskGroup() as group:
        for index, arrival in enumerate(arrivals):
            group.create_task(one(client, index, arrival))
    report.outcomes.sort(key=lambda o: o.sent_s)
    report.wall_s = time.monotonic() - started
    return report


def cut_after_first_token(load: LoadReport) -> int:
    """Streams answered 200 that sent a token and then did not complete."""
    return sum(1 for o in load.outcomes if o.kind != "completed" and o.result.ttft is not None)


class PdRoundRobinSetup(RoundRobinSetup):
    """Envoy alone over all four replicas; each replica's books are read just before its SIGTERM."""

    title = "Envoy alone: round robin over all four, /health checks, removal at SIGTERM"

    def __init__(self, workdir: Path, fleet: PdFleet, *, propagation_s: float, grace_s: float) -> None:
        super().__init__(workdir, fleet, propagation_s=propagation_s, grace_s=grace_s)
        self.books = Books()

    async def terminate(self, address: str) -> None:
        await asyncio.to_thread(self.books.read, address)
        await super().terminate(address)


class PdPickerSetup(PickerSetup):
    """Envoy + the picker over an endpoints file with each replica's revision label and, with
    `roles`, its role; drains as the module docstring says."""

    def __init__(
        self,
        workdir: Path,
        fleet: PdFleet,
        *,
        roles: bool,
        propagation_s: float,
        grace_s: float,
        pd: dict[str, Any] | None = None,
        engine_only: bool = False,
    ) -> None:
        """`engine_only`: the old replica is stopped when `picker drain-wait` against its own /metrics
        exits (no --pulls-url: the engine's running and waiting counts alone, which do not count the
        KV it holds for decode replicas), not by the picker's view."""
        super().__init__(workdir, fleet, propagation_s=propagation_s, grace_s=grace_s, source="file")
        self.pd_fleet, self.roles, self.engine_only = fleet, roles, engine_only
        self.books = Books()
        self.title = (
            "Envoy + picker, P/D pairs (roles and revisions in the endpoints file)"
            if roles
            else "Envoy + picker, a flat pool (no roles in the file: no pairs)"
        )
        if engine_only:
            self.title = "Envoy + picker, P/D pairs, stopped by drain-wait on the engine's /metrics alone"
        config: dict[str, Any] = {
            "pool": {"endpoints_file": str(self.endpoints_path), "endpoints_file_poll_s": 0.1}
        }
        if pd:
            config["pd"] = pd
        (workdir / "picker.yaml").write_text(json.dumps(config))

    def _write_file(self) -> None:
        entries = []
        for address, draining in self.entries.items():
            entry: dict[str, Any] = {
                "address": address,
                "draining": draining,
                "labels": {VERSION_LABEL: self.pd_fleet.revisions[address]},
            }
            if self.roles:
                entry["role"] = self.pd_fleet.roles[address]
            entries.append(entry)
        _replace(self.endpoints_path, json.dumps(entries), self.workdir)

    def _busy(self, address: str) -> int:
        view = http_client.get(f"{self.admin_url}/admin/endpoints", timeout=5).json()
        for entry in view["endpoints"]:
            if entry["address"] == address:
                return int(entry.get("in_flight") or 0) + int(entry.get("kv_pulls_pending") or 0)
        return 0

    async def terminate(self, address: str) -> None:
        """Draining in the file (after the propagation delay every setup gets), stopped once the
        picker counts nothing in flight and no pull pending on it (or at the bound), then removed."""
        self.fleet.mark(address, "draining")
        hook = self._engine_hook(address) if self.engine_only else None
        await asyncio.sleep(self.propagation_s)  # models the endpoint controller -> picker delay
        self.entries[address] = True
        self._write_file()
        self.fleet.moment(address, "router told")
        await self._until_state(address, "draining")
        if hook is not None:
            await asyncio.to_thread(hook.wait_exit, self.grace_s + 5)
            hook.stop()
        else:
            try:
                await asyncio.to_thread(wait_until, lambda: self._busy(address) == 0, self.grace_s, 0.05)
            except TimeoutError:
                print(
                    f"    {address}: still busy at the bound ({self.grace_s:g} s): stopped anyway",
                    file=sys.stderr,
                )
        await asyncio.to_thread(self.books.read, address)
        self.fleet.moment(address, "SIGTERM")
        self.fleet.procs[address].signal(signal.SIGTERM)
        await self.fleet.wait_exit(address, self.grace_s)
        del self.entries[address]
        self._write_file()

    def _engine_hook(self, address: str) -> Proc:
        """The preStop hook most setups have: `picker drain-wait` on the replica's own /metrics."""
        argv = [
            sys.executable, "-m", "picker", "drain-wait", "--metrics-url", f"http://{address}/metrics",
            "--quiet-interval", "0.5", "--poll-interval", "0.1", "--deadline", str(self.grace_s),
        ]  # fmt: skip
        hook = Proc(
            f"drain-wait-{address}", argv, self.workdir / f"drain-wait-{address.replace(':', '-')}.log"
        )
        self.hooks.append(hook)
        return hook


def drain_lines(setup: PdPickerSetup) -> list[str]:
    """One line per old replica's drain, from the picker's records (GET /admin/drains)."""
    names = setup.pd_fleet.lane_names()
    lines = []
    for drain in sorted(scorecard.fetch(setup.admin_url), key=lambda d: d.get("started_wall") or 0):
        address = drain.get("address")
        if address not in setup.pd_fleet.first:
            continue
        ended = {k: v for k, v in (drain.get("ended") or {}).items() if v}
        lines.append(
            f"    {names[address].split()[0]:<3} in flight at start {drain.get('in_flight_at_start')}, "
            f"KV pulls pending at start {drain.get('pulls_at_start')}, ended {ended or '{}'}, "
            f"picks after start {drain.get('picks_after_start')}, to zero {drain.get('time_to_zero_s')} s"
        )
    return lines


async def read_rest(books: Books, addresses: Sequence[str]) -> None:
    """The books of replicas still running at the end."""
    await asyncio.gather(*(asyncio.to_thread(books.read, a) for a in addresses if a not in books.requests))
