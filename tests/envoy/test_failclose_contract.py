"""failClose in the status contract's words, through the real Envoy: with the picker unreachable the
client gets Envoy's own 503 `picker-unavailable` with Retry-After and the JSON body (the shipped
config's local_reply_config), while every other 503 keeps its own meaning."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import completion_body
from picker.contract import Outcome, headers, reply_for

pytestmark = pytest.mark.envoy


def _post(stack: Stack) -> httpx.Response:
    return http_client.post(f"{stack.url}/v1/completions", json=completion_body(3, stream=False), timeout=20)


def _is_contract_reply(response: httpx.Response, outcome: Outcome) -> bool:
    reply = reply_for(outcome)
    return (
        response.status_code == reply.status
        and response.headers.get(headers.DROPPED_REASON) == outcome.value
        and response.json()["error"]["reason"] == outcome.value
    )


def test_picker_down_gets_the_contract_503(tmp_path: Path) -> None:
    stack = Stack(tmp_path, StackOptions(replicas=1)).start()
    try:
        assert stack.picker is not None
        stack.picker.stop()
        response = _post(stack)
        reply = reply_for(Outcome.PICKER_UNAVAILABLE)
        assert response.status_code == 503
        assert response.headers[headers.DROPPED_REASON] == "picker-unavailable"
        assert response.headers[headers.RETRY_AFTER] == str(reply.retry_after_s)
        assert response.headers["content-type"] == "application/json"
        assert response.json() == json.loads(reply.body())
        # Envoy's own reply: the request never reached a replica.
        assert stack.sim_requests(stack.replicas[0]) == []
        wait_until(lambda: "ext_proc_error" in stack.access_log.read_text(), 10, what="access log line")
        line = json.loads(stack.access_log.read_text().splitlines()[-1])
        assert line["details"].startswith("ext_proc_error_gRPC_error_14"), line
        assert line["code"] == 503
    finally:
        stack.stop()


def test_other_503s_keep_their_meaning(tmp_path: Path) -> None:
    options = StackOptions(replicas=1, picker_args=("--reject-without-endpoints",))
    stack = Stack(tmp_path, options).start()
    try:
        replica = stack.replicas[0]
        # A replica's own 503 (after Envoy's retries) reaches the client as the replica sent it.
        stack.set_fault(replica, status=503)
        response = _post(stack)
        assert response.status_code == 503
        assert headers.DROPPED_REASON not in response.headers
        assert "picker-unavailable" not in response.text
        assert stack.sim_requests(replica), "the replica's 503 came from the replica"
        http_client.delete(f"http://{replica}/sim/faults", timeout=5).raise_for_status()
        # The picker's own rejected-no-endpoints 503 reaches the client unchanged.
        drained = http_client.post(
            f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints/{replica}/drain?force=true", timeout=5
        )
        assert drained.status_code == 200, drained.text
        response = _post(stack)
        assert _is_contract_reply(response, Outcome.REJECTED_NO_ENDPOINTS), (response.headers, response.text)
        assert response.json() == json.loads(reply_for(Outcome.REJECTED_NO_ENDPOINTS).body())
        stack.wait_no_leaks()
    finally:
        stack.stop()
