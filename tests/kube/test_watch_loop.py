"""The list -> watch -> relist loop on its own, against a scripted in-memory API (no HTTP, no clock):
which step follows which failure, how long it pauses, and what the pool sees meanwhile."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import pytest

from picker.pool import EndpointState, Pool
from picker.pool.slices import TargetPort
from picker.sources.kube import (
    ApiFailure,
    BadData,
    Disconnected,
    Expired,
    SliceWatcher,
    Stalled,
    WatchEvent,
    WatchSettings,
)
from tests.kube.fake_apiserver import endpoint

SETTINGS = WatchSettings(
    watch_timeout_s=60, inactivity_deadline_s=90, backoff_initial_s=1.0, backoff_max_s=8.0
)
HANG = "hang"


class ScriptDone(BaseException):
    """The script ran out: ends `run()` (a BaseException, so the loop does not retry it)."""


def slice_obj(name: str, *endpoints: dict[str, Any], version: str = "1") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default", "resourceVersion": version},
        "addressType": "IPv4",
        "endpoints": list(endpoints),
        "ports": [{"name": "http", "port": 8000}],
    }


class ScriptedApi:
    """Answers list and watch calls from scripts; records every call."""

    def __init__(self) -> None:
        self.lists: deque[tuple[list[Mapping[str, Any]], str] | BaseException] = deque()
        self.watches: deque[list[WatchEvent | BaseException | str] | BaseException] = deque()
        self.calls: list[tuple[str, str | None]] = []

    async def list_slices(self) -> tuple[list[Mapping[str, Any]], str]:
        self.calls.append(("list", None))
        step = self.lists.popleft() if self.lists else ScriptDone()
        if isinstance(step, BaseException):
            raise step
        return step

    @asynccontextmanager
    async def watch_slices(self, version: str, timeout_s: int) -> AsyncIterator[AsyncIterator[WatchEvent]]:
        self.calls.append(("watch", version))
        script = self.watches.popleft() if self.watches else ScriptDone()
        if isinstance(script, BaseException):
            raise script
        yield self._stream(script)

    async def _stream(self, script: list[WatchEvent | BaseException | str]) -> AsyncIterator[WatchEvent]:
        for step in script:
            if isinstance(step, BaseException):
                raise step
            if step == HANG:
                await asyncio.Event().wait()
            assert isinstance(step, WatchEvent)
            yield step

    async def aclose(self) -> None:
        pass


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def watcher_for(
    api: ScriptedApi, pool: Pool, sleeps: Sleeps, settings: WatchSettings = SETTINGS
) -> SliceWatcher:
    return SliceWatcher(api, pool, TargetPort("http"), settings, sleep=sleeps)


async def run_script(watcher: SliceWatcher) -> None:
    with pytest.raises(ScriptDone):
        await watcher.run()


async def test_events_update_the_pool_and_advance_the_version() -> None:
    api, pool, sleeps = ScriptedApi(), Pool(), Sleeps()
    api.lists.append(([slice_obj("a", endpoint("10.0.0.1"), endpoint("10.0.0.2"))], "10"))
    drained = slice_obj(
        "a", endpoint("10.0.0.1", ready=False, terminating=True), endpoint("10.0.0.2"), version="11"
    )
    api.watches.append(
        [
            WatchEvent("MODIFIED", drained, "11"),
            WatchEvent("BOOKMARK", version="15"),
            WatchEvent("ADDED", slice_obj("b", endpoint("10.0.0.3"), version="16"), "16"),
            WatchEvent("DELETED", slice_obj("a", version="17"), "17"),
        ]
    )
    watcher = watcher_for(api, pool, sleeps)
    await run_script(watcher)
    assert {e.address: e.state for e in pool.endpoints()} == {"10.0.0.3:8000": EndpointState.READY}
    assert api.calls == [("list", None), ("watch", "10"), ("watch", "17")]
    assert sleeps.delays == []  # a clean end resumes at once


async def test_410_relists_at_once_and_the_relist_is_the_whole_truth() -> None:
    api, pool, sleeps = ScriptedApi(), Pool(), Sleeps()
    api.lists.append(([slice_obj("a", endpoint("10.0.0.1")), slice_obj("b", endpoint("10.0.0.2"))], "10"))
    api.watches.append([WatchEvent("ERROR", code=410, message="too old resource version")])
    api.lists.append(([slice_obj("b", endpoint("10.0.0.2"))], "30"))  # "a" was deleted meanwhile
    api.watches.append(Expired("HTTP 410"))  # the other way the API says it
    api.lists.append(([slice_obj("b", endpoint("10.0.0.2"))], "31"))
    await run_script(watcher_for(api, pool, sleeps))
    assert [e.address for e in pool.endpoints()] == ["10.0.0.2:8000"]
    assert api.calls == [
        ("list", None),
        ("watch", "10"),
        ("list", None),
        ("watch", "30"),
        ("list", None),
        ("watch", "31"),
    ]
    assert sleeps.delays == []


async def test_failures_back_off_exponentially_and_success_resets_the_backoff() -> None:
    api, pool, sleeps = ScriptedApi(), Pool(), Sleeps()
    api.lists.append(([slice_obj("a", endpoint("10.0.0.1"))], "10"))
    api.watches.extend([Disconnected("refused")] * 5)
    api.watches.append([])  # a clean end: success
    api.watches.append(ApiFailure("HTTP 500"))
    await run_script(watcher_for(api, pool, sleeps))
    # 1 s * 2^n capped at 8 s, plus up to 1 s of jitter
    bounds = [(1, 2), (2, 3), (4, 5), (8, 9), (8, 9), (1, 2)]
    assert len(sleeps.delays) == len(bounds)
    for delay, (low, high) in zip(sleeps.delays, bounds, strict=True):
        assert low <= delay <= high
    assert all(call == ("watch", "10") for call in api.calls[1:])  # resumed, never relisted
    assert [e.address for e in pool.ready()] == ["10.0.0.1:8000"]  # last good view throughout


@pytest.mark.parametrize("failure", [BadData("garbage"), ValueError("a bug")], ids=["bad-data", "unexpected"])
async def test_undecodable_data_and_bugs_relist_after_a_pause(failure: Exception) -> None:
    api, pool, sleeps = ScriptedApi(), Pool(), Sleeps()
    api.lists.append(([slice_obj("a", endpoint("10.0.0.1"))], "10"))
    api.watches.append([failure])
    api.lists.append(([slice_obj("a", endpoint("10.0.0.1"))], "20"))
    await run_script(watcher_for(api, pool, sleeps))
    assert api.calls == [("list", None), ("watch", "10"), ("list", None), ("watch", "20")]
    assert len(sleeps.delays) == 1


async def test_failed_list_is_retried_with_backoff_and_the_pool_stays_empty_meanwhile() -> None:
    api, pool, sleeps = ScriptedApi(), Pool(), Sleeps()
    api.lists.extend([Disconnected("no route"), ApiFailure("403 forbidden")])
    api.lists.append(([slice_obj("a", endpoint("10.0.0.1"))], "10"))
    await run_script(watcher_for(api, pool, sleeps))
    assert [c[0] for c in api.calls] == ["list", "list", "list", "watch"]
    assert len(sleeps.delays) == 2 and len(pool.ready()) == 1


async def test_error_event_other_than_410_resumes_from_the_same_version() -> None:
    api, pool, sleeps = ScriptedApi(), Pool(), Sleeps()
    api.lists.append(([slice_obj("a", endpoint("10.0.0.1"))], "10"))
    api.watches.append([WatchEvent("ERROR", code=500, message="etcd hiccup")])
    await run_script(watcher_for(api, pool, sleeps))
    assert api.calls == [("list", None), ("watch", "10"), ("watch", "10")]


async def test_a_silent_stream_is_stalled_after_the_inactivity_deadline() -> None:
    api, pool = ScriptedApi(), Pool()
    api.lists.append(([slice_obj("a", endpoint("10.0.0.1"))], "10"))
    api.watches.append([HANG])
    settings = WatchSettings(watch_timeout_s=60, inactivity_deadline_s=0.05)
    watcher = watcher_for(api, pool, Sleeps(), settings)
    await watcher.relist()
    with pytest.raises(Stalled, match=r"nothing for 0\.05 s"):
        await watcher.watch_stream()
    assert watcher.version == "10"  # resume from here, no relist needed


async def test_watch_needs_a_version_first() -> None:
    watcher = watcher_for(ScriptedApi(), Pool(), Sleeps())
    with pytest.raises(RuntimeError, match="relist"):
        await watcher.watch_stream()


async def test_problems_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    api, pool, sleeps = ScriptedApi(), Pool(), Sleeps()
    bad = slice_obj("a", endpoint("10.0.0.1"))
    bad["ports"] = [{"name": "metrics", "port": 9100}]
    api.lists.append(([bad], "10"))
    api.watches.append([WatchEvent("MODIFIED", bad, "11"), WatchEvent("MODIFIED", bad, "12")])
    await run_script(watcher_for(api, pool, sleeps))
    warnings = [r.getMessage() for r in caplog.records if "slice ignored" in r.getMessage()]
    assert warnings == ["kube slice ignored: slice default/a: no TCP port named 'http' (ports: metrics=9100)"]
