"""Admin drains shared through the endpoints file: any replica's admin API rewrites the one record,
every replica applies it. Unit tests on the store, then two picker processes on one file behind the
real Envoy (drain through picker A, picker B stops picking the endpoint)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtest import http_client
from loadtest.procs import Proc, free_port, wait_until
from loadtest.stack import Stack, StackOptions, serve_argv
from loadtest.traffic import completion_body
from picker.pool import DrainCause, Endpoint, EndpointConflict, EndpointState, Pool, UnknownEndpoint
from picker.sources.drain_causes import OPERATOR, PRESTOP, rollback
from picker.sources.drain_store import EndpointsFileDrains
from picker.sources.static_file import EndpointsFile, parse_endpoints

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "[fd00::3]:8000"
READY, DRAINING = EndpointState.READY, EndpointState.DRAINING


def run(call: Coroutine[Any, Any, Endpoint]) -> Endpoint:
    return asyncio.run(call)


def replica(path: Path) -> tuple[Pool, EndpointsFile, EndpointsFileDrains]:
    """One picker replica's view of the shared file (no I/O loop: `check()` is its poll)."""
    pool = Pool()
    file = EndpointsFile(path, pool, poll_s=1.0)
    file.load()
    return pool, file, EndpointsFileDrains(file, pool)


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    path = tmp_path / "endpoints.yaml"
    path.write_text(f"- {A}\n- {{address: {B}}}\n- '{C}'\n")
    return path


def caught_up(file: EndpointsFile) -> None:
    """The replica's next polls: a new file that got a former one's inode reads as changed in place,
    and is read at the next check, once it has not changed since."""
    file.check() or file.check()


def states(pool: Pool) -> dict[str, EndpointState]:
    return {e.address: e.state for e in pool.endpoints()}


def test_drain_rewrites_the_file_and_every_replica_applies_it(shared: Path) -> None:
    first, _, drains = replica(shared)
    second, second_file, _ = replica(shared)
    endpoint = run(drains.drain(B))
    assert endpoint.state is DRAINING and endpoint.drain is not None
    assert parse_endpoints(shared.read_text()) == {A: READY, B: DRAINING, C: READY}
    assert yaml.safe_load(shared.read_text()) == [A, {"address": B, "draining": True}, C]  # order kept
    assert states(second)[B] is READY  # until its next poll
    assert second_file.check()
    assert states(second) == {A: READY, B: DRAINING, C: READY}
    assert states(first) == states(second)
    # the file holds admin drains (the operator's here): every replica's record says so, not `source`
    assert [p.get(B).drain.cause for p in (first, second)] == [DrainCause.ADMIN] * 2  # type: ignore[union-attr]


async def test_an_operators_drain_through_the_admin_api_is_recorded_as_the_admins(shared: Path) -> None:
    """POST .../drain with an endpoints file: the drain record (/admin/drains, the scorecard) says
    `admin`, held by the operator, as with any other store."""
    from aiohttp.test_utils import TestClient, TestServer

    from picker.admin.api import admin_app
    from picker.observability.metrics import Metrics

    pool, _, drains = replica(shared)
    client = TestClient(TestServer(admin_app(pool, Metrics(pool="default"), drains=drains), host="127.0.0.1"))
    await client.start_server()
    try:
        assert (await client.post(f"/admin/endpoints/{B}/drain")).status == 200
        (record,) = (await (await client.get("/admin/drains")).json())["drains"]
        assert record["address"] == B and record["cause"] == "admin"
        assert record["drained_by"] == [{"cause": "operator"}]
    finally:
        await client.close()


def test_a_drain_and_its_undrain_keep_the_entrys_labels(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text(f"- {{address: {A}, labels: {{version: v2}}}}\n- {B}\n")
    pool, _, drains = replica(path)
    run(drains.drain(A))
    assert yaml.safe_load(path.read_text())[0] == {
        "address": A,
        "labels": {"version": "v2"},
        "draining": True,
    }
    run(drains.undrain(A))
    assert yaml.safe_load(path.read_text())[0] == {"address": A, "labels": {"version": "v2"}}
    assert pool.get(A).labels == {"version": "v2"}  # type: ignore[union-attr]


def test_undrain_through_another_replica(shared: Path) -> None:
    first, first_file, drains_first = replica(shared)
    second, _, drains_second = replica(shared)
    run(drains_first.drain(C))
    assert states(second)[C] is READY
    run(drains_second.undrain(C))  # the second never applied the drain: the record is what counts
    assert parse_endpoints(shared.read_text())[C] is READY
    assert first_file.check()
    assert states(first)[C] is READY and states(second)[C] is READY


def test_drain_twice_is_one_drain_and_undrain_of_a_ready_one_conflicts(shared: Path) -> None:
    pool, _, drains = replica(shared)
    run(drains.drain(A))
    before = shared.stat().st_ino
    run(drains.drain(A))
    assert shared.stat().st_ino == before  # nothing to write
    run(drains.undrain(A))
    with pytest.raises(EndpointConflict):
        run(drains.undrain(A))
    assert states(pool)[A] is READY


def test_unknown_and_unlisted_addresses(shared: Path) -> None:
    _, _, drains = replica(shared)
    with pytest.raises(UnknownEndpoint):
        run(drains.drain("10.9.9.9:8000"))
    before = shared.read_text()
    with pytest.raises(UnknownEndpoint):
        run(drains.undrain("10.9.9.9:8000"))
    assert shared.read_text() == before


def test_a_file_the_source_rejects_is_not_rewritten(shared: Path) -> None:
    pool, _, drains = replica(shared)
    shared.write_text("- {address: 10.0.0.1")  # a partial write in progress
    with pytest.raises(EndpointConflict, match="cannot be changed now"):
        run(drains.drain(A))
    assert shared.read_text() == "- {address: 10.0.0.1"
    assert states(pool)[A] is READY


def test_mapping_form_and_mode_are_kept(shared: Path) -> None:
    shared.write_text(f"endpoints:\n- {A}\n- {B}\n")
    shared.chmod(0o644)
    _, _, drains = replica(shared)
    run(drains.drain(A))
    assert yaml.safe_load(shared.read_text()) == {"endpoints": [{"address": A, "draining": True}, B]}
    assert shared.stat().st_mode & 0o777 == 0o644


def test_the_file_records_each_drains_cause_and_a_rollouts_lift_takes_its_own(shared: Path) -> None:
    """Issue 53, item 5: `drained_by` beside `draining: true` (none for the operator's alone, so
    the entry reads as before); a rollout lifts its rollback's drains only; a malformed item is
    counted and not applied (the drain stays the operator's)."""
    mine = rollback("app.kubernetes.io/version=v2")
    _, first_file, drains = replica(shared)
    second, second_file, second_drains = replica(shared)
    run(drains.drain(A, cause=mine))
    run(drains.drain(B, cause=mine))
    run(drains.drain(A))  # the operator's, on top
    run(drains.drain(C, cause=PRESTOP))
    assert yaml.safe_load(shared.read_text()) == [
        {"address": A, "draining": True, "drained_by": [{"cause": "operator"}, mine.as_dict()]},
        {"address": B, "draining": True, "drained_by": [mine.as_dict()]},
        {"address": C, "draining": True, "drained_by": [{"cause": "prestop"}]},
    ]
    caught_up(second_file)
    assert second_drains.drained_by() == {A: [OPERATOR, mine], B: [mine], C: [PRESTOP]}
    assert asyncio.run(second_drains.lift(mine)) == [A, B]  # through the other replica
    assert yaml.safe_load(shared.read_text()) == [
        {"address": A, "draining": True},
        B,
        {"address": C, "draining": True, "drained_by": [{"cause": "prestop"}]},
    ]
    caught_up(second_file)
    assert states(second) == {A: DRAINING, B: READY, C: DRAINING}
    lifted = asyncio.run(drains.undrain(C))
    assert lifted.causes == (PRESTOP,)
    assert yaml.safe_load(shared.read_text())[2] == C
    shared.write_text(
        f"- {{address: {A}, draining: true, drained_by: [{{cause: autoscaler}}, oops]}}\n- {B}\n"
    )
    caught_up(first_file)  # what the admin API shows is the version the source has in force
    assert drains.drained_by() == {A: [OPERATOR]}  # nothing it names is read: the operator's
    assert dict(drains.rejected) == {"unknown-cause": 1, "bad-item": 1}
    assert drains.drained_by() == {A: [OPERATOR]} and dict(drains.rejected) == {
        "unknown-cause": 1,
        "bad-item": 1,
    }


def put(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def got(path: Path) -> bytes:
    return path.read_bytes()


async def test_a_file_that_is_not_utf8_never_answers_500(shared: Path) -> None:
    """Bytes that are not UTF-8 (in a comment: the source reads the file as it always has) leave
    GET /admin/endpoints answering who holds each drain; a drain answers 409, the file untouched (a
    rewrite would change those bytes); a version the source rejects (a partial write) is never
    read by the admin API: it answers from the version in force."""
    from aiohttp.test_utils import TestClient, TestServer

    from picker.admin.api import admin_app
    from picker.observability.metrics import Metrics

    comment = b"# caf\xe9 (latin-1)\n"
    put(
        shared,
        comment + f"- {A}\n- {{address: {B}, draining: true, drained_by: [{{cause: prestop}}]}}\n".encode(),
    )
    pool, file, drains = replica(shared)
    metrics = Metrics(pool="default")
    client = TestClient(TestServer(admin_app(pool, metrics, drains=drains), host="127.0.0.1"))
    await client.start_server()
    try:
        answer = await client.get("/admin/endpoints")
        assert answer.status == 200, await answer.text()
        shown = {e["address"]: e["drained_by"] for e in (await answer.json())["endpoints"]}
        assert shown == {A: [], B: [{"cause": "prestop"}]}
        before = got(shared)
        answer = await client.post(f"/admin/endpoints/{A}/drain")
        assert answer.status == 409 and "UTF-8" in (await answer.json())["error"]["message"]
        assert got(shared) == before and states(pool)[A] is READY
        put(shared, f"- {{address: {B}, draining: true, drained_by: [{{cause: pre".encode())  # mid-write
        assert file.check() is False  # the source keeps its last good view; so does the record's read
        answer = await client.get("/admin/endpoints")
        assert answer.status == 200
        assert {e["address"]: e["drained_by"] for e in (await answer.json())["endpoints"]} == shown
        put(shared, bytes(range(256)) * 16)  # garbage: the view in force answers, as for a partial write
        assert file.check() is False
        answer = await client.get("/admin/endpoints")
        assert answer.status == 200
        assert {e["address"]: e["drained_by"] for e in (await answer.json())["endpoints"]} == shown
    finally:
        await client.close()


# Two picker processes on one endpoints file, through the real Envoy.

POLL_S = 0.2  # --endpoints-file-poll of both pickers


def second_picker(workdir: Path, endpoints_file: Path) -> tuple[Proc, int]:
    """Picker A: not behind the stack's Envoy, just another replica reading the same file."""
    metrics = free_port()
    argv = serve_argv(
        free_port(),
        free_port(),
        metrics,
        "--secure-serving=false",
        "--endpoints-file",
        str(endpoints_file),
        "--endpoints-file-poll",
        str(POLL_S),
        "--quiet-interval",
        "0.2",
    )
    proc = Proc("picker-a", argv, workdir / "picker-a.log")
    proc.wait_ready(lambda: "picker ready" in proc.log_text())
    return proc, metrics


def endpoint_state(metrics_port: int, address: str) -> str:
    url = f"http://127.0.0.1:{metrics_port}/admin/endpoints/{address}"
    return str(http_client.get(url, timeout=5).json()["endpoint"]["state"])


@pytest.mark.envoy
def test_drain_through_one_picker_stops_the_other_picking(tmp_path: Path) -> None:
    endpoints_file = tmp_path / "endpoints.yaml"
    options = StackOptions(
        replicas=2,
        static_endpoints=False,
        picker_args=("--endpoints-file", str(endpoints_file), "--endpoints-file-poll", str(POLL_S)),
    )
    stack = Stack(tmp_path, options)  # picker B, behind Envoy
    endpoints_file.write_text("".join(f"- {r}\n" for r in stack.replicas))
    picker_a: Proc | None = None
    try:
        stack.start()
        picker_a, a_metrics = second_picker(tmp_path, endpoints_file)
        drained, kept = stack.replicas
        response = http_client.post(
            f"http://127.0.0.1:{a_metrics}/admin/endpoints/{drained}/drain", timeout=5
        )
        assert response.status_code == 200, response.text
        asked = time.monotonic()
        assert response.json()["endpoint"]["state"] == "draining"
        wait_until(lambda: endpoint_state(stack.metrics_port, drained) == "draining", 10, what="B applies it")
        applied_s = time.monotonic() - asked
        print(f"drain through picker A applied by picker B after {applied_s:.2f} s (poll {POLL_S} s)")
        http_client.delete(f"http://{drained}/sim/requests", timeout=5).raise_for_status()
        for _ in range(10):
            body = completion_body(2, stream=False)
            result = http_client.post(f"{stack.url}/v1/completions", json=body, timeout=20)
            assert result.status_code == 200
        assert stack.sim_requests(drained) == []
        assert len(stack.sim_requests(kept)) >= 10
        # Undrain through picker B: picker A follows.
        response = http_client.post(
            f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints/{drained}/undrain", timeout=5
        )
        assert response.status_code == 200, response.text
        wait_until(lambda: endpoint_state(a_metrics, drained) == "ready", 10, what="A applies the undrain")
        stack.wait_no_leaks()
    finally:
        if picker_a is not None:
            picker_a.stop()
        stack.stop()
