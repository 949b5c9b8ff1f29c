"""The picker behind the Envoy configs that Gateway API implementations generate (issue 11).

Each shape is a template in config/gateways/ whose header cites the generating code. Every shape runs
through the real Envoy 1.40, the picker and three simulated replicas:

  (a) eg-buffered           Envoy Gateway + EnvoyExtensionPolicy, as in the GIE Envoy Gateway guide:
                            request body BUFFERED, response headers only (body NONE), no observer
                            filter, fail-closed without status_on_error, message_timeout 1000s.
  (b) aigw-failopen         Envoy AI Gateway, InferencePool failureMode FailOpen: request and response
                            bodies FULL_DUPLEX_STREAMED (trailers SEND), failure_mode_allow true,
                            override_host from envoy.lb metadata with least_request fallback, a TCP
                            health check on the picker.
  (c) aigw-failclose        Envoy AI Gateway, failureMode FailClose (the API default): the same filter
                            fail-closed and without metadata_options, pool cluster ORIGINAL_DST on the
                            x-gateway-destination-endpoint header (also kgateway's and the GIE guides'
                            cluster shape).
  (d) aigw-failclose-tls    (c) with TLS to the picker (no certificate validation): exactly what the AI
                            Gateway generates for a pool left at its defaults; the picker serves its
                            self-signed certificate. (b) and (c) run plaintext (--secure-serving=false)
                            so that a failure there is the body mode's, not TLS's; (a) and (e) are
                            plaintext as their gateways generate them.
  (e) kgateway              kgateway's InferencePool backend: request body BUFFERED, response headers
                            SKIP and body NONE (the picker sees nothing of the response), fail-closed,
                            no metadata_options, pool cluster ORIGINAL_DST on the header.

On each: a 200 KB body arrives intact (streaming and not, HTTP/1.1 and h2c), the served endpoint is
the picker's primary pick, a drained endpoint gets no new request, a client disconnect aborts at the
replica, a stream past 2.5 s still counts against its endpoint, the contract replies (400, 413, 503
with every endpoint drained) reach the client, and a picker SIGKILL cuts the number of in-flight
streams the shape implies: none when the routing filter's gRPC stream ended at response headers
(response headers SEND, body NONE), every one when the response body flows through the picker
(FULL_DUPLEX_STREAMED: Envoy resets the stream even when failing open) or when response headers are
SKIP (kgateway: measured, the gRPC stream is still open while the response streams, and a
fail-closed filter resets the stream when it breaks). Then, with the picker down, a new request gets
Envoy's 500 in fail-closed shapes (none sets status_on_error) and is served under FailOpen.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import REPLICA_HEADER, Result, completion_body, stream_one
from picker.cli.envoyconf import SHAPES as GATEWAY_SHAPES
from picker.cli.envoyconf import SHIPPED, EnvoyParams, envoy_binary, render, shape_template
from picker.drain.check import check_paths
from picker.drain.rules import Budget

pytestmark = pytest.mark.envoy

MAX_BODY = 1024 * 1024  # the picker's --max-body-bytes; Envoy's buffer limit is 16 MiB above it
PROMPT_CHARS = 200_003  # a ~200 KB body; the simulator counts ceil(chars / 4) prompt tokens
ABORTED_WITHIN_S = 2.0  # a disconnected 2000-token stream would otherwise run 50 s
KILL_STREAMS = 10


@dataclass(frozen=True)
class Shape:
    id: str
    template: str
    tls: bool
    response_body: str  # the routing filter's response_body_mode
    response_headers: str = "SEND"  # its response_header_mode
    fail_open: bool = False  # failure_mode_allow

    @property
    def kill_resets_streams(self) -> bool:
        """Is the routing filter's gRPC stream still open while responses stream? Envoy closes it after
        the response headers' answer when no body is to follow (measured); with response headers
        SKIP it stays open to the end, and with a body mode the picker is on every chunk."""
        return self.response_body != "NONE" or self.response_headers == "SKIP"


SHAPES = [
    Shape("a-eg-buffered", "eg-buffered", tls=False, response_body="NONE"),
    Shape(
        "b-aigw-failopen", "aigw-failopen", tls=False, response_body="FULL_DUPLEX_STREAMED", fail_open=True
    ),
    Shape("c-aigw-failclose", "aigw-failclose", tls=False, response_body="FULL_DUPLEX_STREAMED"),
    Shape("d-aigw-failclose-tls", "aigw-failclose", tls=True, response_body="FULL_DUPLEX_STREAMED"),
    Shape("e-kgateway", "kgateway", tls=False, response_body="NONE", response_headers="SKIP"),
]


@pytest.fixture(scope="class", params=SHAPES, ids=[s.id for s in SHAPES])
def gw(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Shape, Stack]]:
    shape: Shape = request.param
    options = StackOptions(
        replicas=3,
        sim_args=("--ttft-ms", "20", "--itl-ms", "25", "--max-model-len", "100000"),
        picker_args=("--reject-without-endpoints", "--max-body-bytes", str(MAX_BODY)),
        shape=shape.template,
        envoy_picker_tls=shape.tls,  # both ends: False runs the picker with --secure-serving=false
    )
    stack = Stack(tmp_path_factory.mktemp(shape.id), options).start()
    try:
        yield shape, stack
    finally:
        stack.stop()


def big_body(stream: bool) -> dict[str, object]:
    text = ("0123456789abcdef" * (PROMPT_CHARS // 16 + 1))[:PROMPT_CHARS]
    return {**completion_body(4, stream=stream), "prompt": text}


def picks(stack: Stack) -> dict[str, float]:
    return {r: stack.picker_value("picker_picks_total", endpoint=r) for r in stack.replicas}


def admin(stack: Stack, replica: str, verb: str) -> None:
    # every replica drained on purpose: past the capacity guard's last-ready rule
    force = "?force=true" if verb == "drain" else ""
    url = f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints/{replica}/{verb}{force}"
    response = http_client.post(url, timeout=5)
    assert response.status_code == 200, response.text


def state_of(stack: Stack, replica: str) -> str:
    view = http_client.get(f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints", timeout=5).json()
    return str(next(e["state"] for e in view["endpoints"] if e["address"] == replica))


async def set_states(stack: Stack, replicas: list[str], verb: str, state: str) -> None:
    for replica in replicas:
        admin(stack, replica, verb)
    await asyncio.to_thread(
        wait_until, lambda: all(state_of(stack, r) == state for r in replicas), 5, 0.02, f"{verb} applied"
    )


def envoy_log(stack: Stack) -> str:
    """The tail of the access log and the Envoy log: what a failing assertion needs to be read."""
    access = stack.access_log.read_text()[-1500:] if stack.access_log.exists() else ""
    return access + (stack.workdir / "envoy.log").read_text()[-1500:]


@pytest.mark.parametrize("name", sorted(set(GATEWAY_SHAPES) - {SHIPPED}))
@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_gateway_shape_validates(tmp_path: Path, name: str, tls: bool) -> None:
    config = tmp_path / "envoy.yaml"
    params = EnvoyParams(
        listen_port=10000, admin_port=9901, picker_port=9002, endpoints=["127.0.0.1:8000"], picker_tls=tls
    )
    config.write_text(render(params, shape_template(name)))
    run = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


# What `picker check` says about each shape as the gateway generates it (README, "Behind your gateway").
CHECK_FINDINGS = {
    # default pool circuit breakers; the client's x-gateway-destination-endpoint not removed; no view
    # of response ends (no observer, response body NONE)
    "eg-buffered": {"ENVOY-003", "ENVOY-006", "ENVOY-014", "ENVOY-015"},  # 015: failClose, bare 503
    # ... the response body through the picker (a picker crash resets every stream); default
    # circuit breakers on the picker cluster too (016: 1024 ext_proc streams)
    "aigw-failopen": {"ENVOY-003", "ENVOY-006", "ENVOY-007", "ENVOY-016"},
    # (ORIGINAL_DST: fine, as the filter does not ask the picker for a fallback list)
    "aigw-failclose": {"ENVOY-003", "ENVOY-006", "ENVOY-007", "ENVOY-015", "ENVOY-016"},
    # the picker sees neither response headers nor bodies
    "kgateway": {"ENVOY-006", "ENVOY-014", "ENVOY-015", "ENVOY-016"},
}


@pytest.mark.parametrize("name", sorted(CHECK_FINDINGS))
def test_picker_check_reads_each_shape(tmp_path: Path, name: str) -> None:
    config = tmp_path / f"{name}.yaml"
    params = EnvoyParams(listen_port=10000, admin_port=9901, picker_port=9002, endpoints=["127.0.0.1:8000"])
    config.write_text(render(params, shape_template(name)))
    report, documents = check_paths([config], Budget())
    assert documents == 1
    assert {f.rule.id for f in report.findings} == CHECK_FINDINGS[name]


def test_a_grpc_access_log_to_the_picker_gives_kgateway_its_ends(tmp_path: Path) -> None:
    """kgateway's HTTPListenerPolicy access log to the picker: one gRPC logger, a valid config, and
    `picker check` no longer warns that the picker cannot see how responses end."""
    config = tmp_path / "kgateway.yaml"
    params = EnvoyParams(
        listen_port=10000,
        admin_port=9901,
        picker_port=9002,
        endpoints=["127.0.0.1:8000"],
        picker_access_log=True,
    )
    text = render(params, shape_template("kgateway"))
    assert text.count("envoy.access_loggers.http_grpc") == 1
    config.write_text(text)
    run = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report, _ = check_paths([config], Budget())
    assert {f.rule.id for f in report.findings} == CHECK_FINDINGS["kgateway"] - {"ENVOY-014"}


def test_unknown_shape_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="known: shipped"):
        shape_template("nginx")


class TestBehindTheGateway:
    @pytest.mark.parametrize(
        ("stream", "http2"),
        [(True, False), (False, False), (True, True)],
        ids=["streaming", "non-streaming", "streaming-h2c"],
    )
    async def test_large_body_arrives_intact(
        self, gw: tuple[Shape, Stack], stream: bool, http2: bool
    ) -> None:
        _, stack = gw
        body = big_body(stream)
        assert len(json.dumps(body)) > 200_000
        async with http_client.AsyncClient(timeout=20, http1=not http2, http2=http2) as client:
            if stream:
                result = await stream_one(client, stack.url, body)
                status, replica = result.status, result.replica
                assert result.ok, (result, envoy_log(stack))
            else:
                response = await client.post(stack.url + "/v1/completions", json=body)
                status, replica = response.status_code, response.headers.get(REPLICA_HEADER, "")
                assert status == 200, (response.text[:300], envoy_log(stack))
                assert response.json()["usage"]["prompt_tokens"] == math.ceil(PROMPT_CHARS / 4)
        entry = stack.sim_requests(replica)[-1]
        assert entry["stream"] is stream and entry["status"] == 200
        # every byte of the prompt arrived: one chunk lost, doubled or cut would change the count
        # (or break the JSON, which the replica answers 400)
        assert entry["prompt_tokens"] == math.ceil(PROMPT_CHARS / 4)

    async def test_served_endpoint_is_the_pickers_choice(self, gw: tuple[Shape, Stack]) -> None:
        _, stack = gw
        async with http_client.AsyncClient(timeout=10) as client:
            # One long stream holds a replica: a picker that is followed keeps new work off it.
            flowing = asyncio.Event()
            holder = asyncio.create_task(
                stream_one(client, stack.url, completion_body(120), first_event=flowing)
            )
            await asyncio.wait_for(flowing.wait(), 10)
            for _ in range(6):
                before = picks(stack)
                response = await client.post(
                    stack.url + "/v1/completions", json=completion_body(2, stream=False)
                )
                assert response.status_code == 200, (response.text[:300], envoy_log(stack))
                after = picks(stack)
                picked = [r for r in stack.replicas if after[r] == before[r] + 1]
                assert picked == [response.headers[REPLICA_HEADER]], (before, after, dict(response.headers))
            held = await holder
        assert held.ok, held

    async def test_drained_endpoint_gets_no_new_request(self, gw: tuple[Shape, Stack]) -> None:
        _, stack = gw
        drained = stack.replicas[0]
        await set_states(stack, [drained], "drain", "draining")
        try:
            seen_before = len(stack.sim_requests(drained))
            async with http_client.AsyncClient(timeout=10) as client:
                streams = [await stream_one(client, stack.url, completion_body(2)) for _ in range(5)]
                plain = [
                    await client.post(stack.url + "/v1/completions", json=completion_body(2, stream=False))
                    for _ in range(4)
                ]
            assert all(r.ok for r in streams), streams
            assert all(p.status_code == 200 for p in plain), [p.text[:200] for p in plain]
            served = {r.replica for r in streams} | {p.headers[REPLICA_HEADER] for p in plain}
            assert drained not in served and served <= set(stack.replicas[1:])
            assert len(stack.sim_requests(drained)) == seen_before
        finally:
            await set_states(stack, [drained], "undrain", "ready")

    async def test_client_disconnect_aborts_at_the_replica(self, gw: tuple[Shape, Stack]) -> None:
        _, stack = gw
        async with (
            http_client.AsyncClient(timeout=10) as client,
            client.stream("POST", stack.url + "/v1/completions", json=completion_body(2000)) as response,
        ):
            assert response.status_code == 200
            replica = response.headers[REPLICA_HEADER]
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break
            gone_at = time.time()
        await asyncio.to_thread(
            wait_until, lambda: stack.sim_requests(replica)[-1]["end"] is not None, 5, 0.02, "replica abort"
        )
        entry = stack.sim_requests(replica)[-1]
        assert entry["outcome"] == "aborted"
        assert entry["end"] - gone_at < ABORTED_WITHIN_S

    async def test_contract_replies_reach_the_client(self, gw: tuple[Shape, Stack]) -> None:
        _, stack = gw
        too_large = json.dumps({"model": "tiny-llama", "prompt": "x" * (MAX_BODY + 1000)}).encode()
        async with http_client.AsyncClient(timeout=10) as client:
            cases = [
                (b"{this is not json", 400, "bad-request"),
                (too_large, 413, "too-large"),
            ]
            for body, status, reason in cases:
                response = await client.post(
                    stack.url + "/v1/completions", content=body, headers={"content-type": "application/json"}
                )
                assert response.status_code == status, (response.text[:300], envoy_log(stack))
                assert response.headers["x-picker-dropped-reason"] == reason
                assert response.json()["error"]["code"] == status
                assert REPLICA_HEADER not in response.headers
            await set_states(stack, stack.replicas, "drain", "draining")
            try:
                refused = await stream_one(client, stack.url, completion_body(2))
            finally:
                await set_states(stack, stack.replicas, "undrain", "ready")
            assert refused.status == 503 and not refused.replica, refused
            assert refused.reason_header == "rejected-no-endpoints" and refused.retry_after
            # ... and the shape serves again
            assert (await stream_one(client, stack.url, completion_body(2))).ok

    async def test_long_stream_stays_counted_until_it_ends(self, gw: tuple[Shape, Stack]) -> None:
        """Past the 2 s after which a picker with no view of the response's end used to release the
        slot: the stream still counts against its endpoint, and stops counting once it has ended."""
        _, stack = gw

        def running() -> list[tuple[str, dict[str, object]]]:
            return [
                (r, e) for r in stack.replicas for e in stack.sim_requests(r) if e["outcome"] == "in-flight"
            ]

        async with http_client.AsyncClient(timeout=20) as client:
            task = asyncio.create_task(stream_one(client, stack.url, completion_body(160)))
            # 100 tokens at 25 ms: the stream has run 2.5 s
            await asyncio.to_thread(
                wait_until,
                lambda: any(int(e["tokens_sent"]) >= 100 for _, e in running()),  # type: ignore[call-overload]
                15,
                0.05,
                "a stream 2.5 s in",
            )
            ((replica, _),) = running()
            assert stack.picker_value("picker_endpoint_in_flight", endpoint=replica) >= 1
            result = await task
        assert result.ok, result
        await asyncio.to_thread(
            wait_until,
            lambda: stack.picker_value("picker_endpoint_in_flight", endpoint=replica) == 0,
            10,
            0.05,
            "the ended stream released",
        )

    async def test_picker_sigkill_cuts_what_the_shape_implies(self, gw: tuple[Shape, Stack]) -> None:
        """Last in the class: it kills the picker of this shape's stack."""
        shape, stack = gw
        assert stack.picker is not None
        async with http_client.AsyncClient(
            timeout=30, limits=httpx.Limits(max_connections=KILL_STREAMS + 4)
        ) as client:
            flowing = [asyncio.Event() for _ in range(KILL_STREAMS)]
            streams = [
                asyncio.create_task(stream_one(client, stack.url, completion_body(80), first_event=event))
                for event in flowing
            ]
            # every stream has its first token: routing is over, only the response is in flight
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in flowing)), 15)
            in_flight = sum(1 for task in streams if not task.done())
            stack.picker.kill()
            finished: list[Result] = await asyncio.gather(*streams)
        # (the event is also set when a request ends: every stream must have been flowing at the kill)
        assert in_flight == KILL_STREAMS, (finished, envoy_log(stack))
        assert all(r.status == 200 and r.chunks >= 1 for r in finished), finished
        cut = sum(1 for r in finished if not r.ok)
        print(f"{shape.id}: a picker SIGKILL cut {cut}/{KILL_STREAMS} in-flight streams")
        expected = KILL_STREAMS if shape.kill_resets_streams else 0
        assert cut == expected, (finished, envoy_log(stack))

    async def test_picker_down_follows_the_failure_mode(self, gw: tuple[Shape, Stack]) -> None:
        """After the SIGKILL above: fail-closed shapes answer Envoy's 500 (none sets status_on_error);
        FailOpen serves from its fallback policy once the health check has seen the picker gone."""
        shape, stack = gw
        assert stack.picker is not None and not stack.picker.alive()  # still dead
        async with http_client.AsyncClient(timeout=10) as client:
            if not shape.fail_open:
                result = await stream_one(client, stack.url, completion_body(2))
                assert result.status == 500 and not result.replica, result
                return
            results: list[Result] = []
            deadline = time.monotonic() + 10  # a 1 s health check interval; bounded in time and count
            for _ in range(100):
                results.append(await stream_one(client, stack.url, completion_body(2)))
                if results[-1].ok or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)  # pacing between probes of a condition, not synchronisation
        print(f"{shape.id}: picker down, first request served is number {len(results)}")
        assert results[-1].ok and results[-1].replica in stack.replicas, results[-5:]
