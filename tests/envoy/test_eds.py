"""Envoy's pool cluster served by the picker over EDS, through the real Envoy: the picker's drains
reach Envoy's own view, which outlives the picker, so failOpen round robin never reaches a replica
the picker had seen draining (a STATIC cluster does); a restarted picker resends its view."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import completion_body

pytestmark = pytest.mark.envoy

REQUESTS = 30  # round robin over 3 replicas would send ~10 of them to each


def envoy_health(stack: Stack) -> dict[str, str]:
    """Envoy's pool members and their health flags (GET /clusters)."""
    text = http_client.get(f"http://127.0.0.1:{stack.admin_port}/clusters", timeout=5).text
    out = {}
    for line in text.splitlines():
        parts = line.split("::")
        if parts[0] == "pool" and len(parts) == 4 and parts[2] == "health_flags":
            out[parts[1]] = parts[3]
    return out


def admin(stack: Stack, address: str, verb: str) -> None:
    url = f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints/{address}/{verb}"
    http_client.post(url, timeout=5).raise_for_status()


def served_by_drained_after_picker_loss(stack: Stack) -> int:
    """Drain one replica, stop the picker, send REQUESTS (failOpen): how many reached the drained one."""
    drained = stack.replicas[0]
    admin(stack, drained, "drain")
    if stack.options.eds is not False:
        wait_until(lambda: "eds_status_draining" in envoy_health(stack).get(drained, ""), 10, what="EDS push")
    http_client.delete(f"http://{drained}/sim/requests", timeout=5).raise_for_status()
    assert stack.picker is not None
    stack.picker.stop()
    statuses = [
        http_client.post(
            f"{stack.url}/v1/completions", json=completion_body(2, stream=False), timeout=20
        ).status_code
        for _ in range(REQUESTS)
    ]
    assert statuses == [200] * REQUESTS  # failOpen: every request was served, by round robin
    return len(stack.sim_requests(drained))


@pytest.mark.parametrize("eds", [True, False], ids=["eds", "static"])
def test_fail_open_with_the_picker_down_avoids_what_it_saw_draining(tmp_path: Path, eds: bool) -> None:
    stack = Stack(tmp_path, StackOptions(replicas=3, failure_mode_allow=True, eds=eds)).start()
    try:
        reached = served_by_drained_after_picker_loss(stack)
        print(
            f"failOpen, picker down, {'EDS' if eds else 'STATIC'} pool: {reached}/{REQUESTS} to the drained"
        )
        if eds:
            assert reached == 0
            assert "eds_status_draining" in envoy_health(stack)[stack.replicas[0]]  # the last view stays
        else:
            assert reached > 0  # what EDS is for: the static cluster knows nothing of the drain
    finally:
        stack.stop()


def test_envoy_follows_the_pool_and_a_restarted_picker(tmp_path: Path) -> None:
    stack = Stack(tmp_path, StackOptions(replicas=2, eds=True)).start()
    try:
        first, second = stack.replicas
        assert envoy_health(stack) == {first: "healthy", second: "healthy"}
        admin(stack, first, "drain")
        wait_until(lambda: "eds_status_draining" in envoy_health(stack)[first], 10, what="drain pushed")
        admin(stack, first, "undrain")
        wait_until(lambda: envoy_health(stack)[first] == "healthy", 10, what="undrain pushed")
        admin(stack, second, "drain")
        wait_until(lambda: "eds_status_draining" in envoy_health(stack)[second], 10, what="drain pushed")
        # A restarted picker forgets its admin drains (not shared: static source) and resends its view.
        assert stack.picker is not None
        stack.picker.stop()
        assert "eds_status_draining" in envoy_health(stack)[second]  # Envoy keeps the last view
        stack.start_picker()
        wait_until(lambda: envoy_health(stack)[second] == "healthy", 20, what="restarted picker's view")
        response = http_client.post(
            f"{stack.url}/v1/completions", json=completion_body(2, stream=False), timeout=20
        )
        assert response.status_code == 200
        stack.wait_no_leaks()
    finally:
        stack.stop()


def test_envoy_started_before_the_picker(tmp_path: Path) -> None:
    """Envoy comes up without its pool (initial_fetch_timeout) answering the contract's 503, then routes
    as soon as the picker serves it (the EDS stream reconnects within its short backoff)."""
    stack = Stack(tmp_path, StackOptions(replicas=1, eds=True))
    try:
        stack.start_sims()
        stack.start_envoy()  # waits for Envoy's /ready: only after the initial fetch gave up
        body = completion_body(2, stream=False)
        before = http_client.post(f"{stack.url}/v1/completions", json=body, timeout=20)
        assert before.status_code == 503
        assert before.headers["x-picker-dropped-reason"] == "picker-unavailable"
        stack.start_picker()

        def routed() -> bool:
            return http_client.post(f"{stack.url}/v1/completions", json=body, timeout=20).status_code == 200

        wait_until(routed, 10, what="routing once the picker is up")
        assert envoy_health(stack) == {stack.replicas[0]: "healthy"}
    finally:
        stack.stop()


def test_an_admin_drain_answers_once_envoy_holds_it(tmp_path: Path) -> None:
    """The admin API answers a drain once Envoy has ACKed the EDS version carrying it: a picker killed
    right after the answer (no wait here) leaves failOpen round robin avoiding the drained replica."""
    stack = Stack(tmp_path, StackOptions(replicas=3, failure_mode_allow=True, eds=True)).start()
    try:
        drained = stack.replicas[0]
        url = f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints/{drained}/drain"
        answer = http_client.post(url, timeout=10)
        assert answer.status_code == 200
        assert stack.picker is not None
        stack.picker.kill()  # at once: no propagation wait of the test's own
        http_client.delete(f"http://{drained}/sim/requests", timeout=5).raise_for_status()
        statuses = [
            http_client.post(f"{stack.url}/v1/completions", json=completion_body(2, stream=False), timeout=20)
            for _ in range(9)
        ]
        assert [r.status_code for r in statuses] == [200] * 9
        assert len(stack.sim_requests(drained)) == 0
        assert answer.json()["eds"] == {"acked": True, "streams": 1}
    finally:
        stack.stop()
