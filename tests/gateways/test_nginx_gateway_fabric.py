"""NGINX Gateway Fabric in front of the picker (issue 21): its endpoint-picker shim asks over a new gRPC
connection per request (TLS with no verification, or plaintext) and never reports a response; nginx
then proxies to the endpoint named in the headers answer. Here `ShimClient` asks exactly so and the
test proxies as nginx would; `picker serve` and the simulators are real processes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest import http_client
from loadtest.ngf_client import ShimClient
from loadtest.procs import Proc, free_port, wait_until
from loadtest.stack import health_ok, parse_metrics, serve_argv, sim_argv
from loadtest.traffic import completion_body

REPLICAS = 3


class Deployment:
    """Simulated replicas and one `picker serve`, asked the way NGF asks it."""

    def __init__(self, workdir: Path, tls: bool) -> None:
        self.replica_ports = [free_port() for _ in range(REPLICAS)]
        self.ports = free_port(), free_port(), free_port()
        self.sims = Proc(
            "sim", sim_argv(self.replica_ports, ("--ttft-ms", "5", "--itl-ms", "5")), workdir / "sim.log"
        )
        for port in self.replica_ports:
            self.sims.wait_ready(lambda p=port: health_ok(p))
        argv = serve_argv(
            *self.ports,
            "--endpoints",
            ",".join(self.replicas),
            "--queue-ttl",
            "0.5",
            *(() if tls else ("--secure-serving=false",)),
        )
        self.picker = Proc("picker", argv, workdir / "picker.log")
        self.picker.wait_ready(lambda: "picker ready" in self.picker.log_text())
        self.client = ShimClient(f"127.0.0.1:{self.ports[0]}", tls=tls)

    @property
    def replicas(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.replica_ports]

    def metric(self, name: str) -> float:
        text = http_client.get(f"http://127.0.0.1:{self.ports[2]}/metrics", timeout=5).text
        return parse_metrics(text).get((name, ()), 0.0)

    def admin(self, address: str, verb: str) -> None:
        force = "?force=true" if verb == "drain" else ""  # every replica drained on purpose
        url = f"http://127.0.0.1:{self.ports[2]}/admin/endpoints/{address}/{verb}{force}"
        http_client.post(url, timeout=5).raise_for_status()

    def stop(self) -> None:
        self.picker.stop()
        self.sims.stop()


@pytest.fixture(scope="module", params=["tls", "plaintext"])
def ngf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path_factory.mktemp(str(request.param)), tls=request.param == "tls")
    try:
        yield deployment
    finally:
        deployment.stop()


def body(max_tokens: int = 8) -> bytes:
    return json.dumps(completion_body(max_tokens, stream=False)).encode()


def test_every_request_gets_one_member_and_the_books_return_to_zero(ngf: Deployment) -> None:
    chosen: list[str] = []
    with http_client.Client(timeout=20) as nginx:
        for _ in range(20):
            answer = ngf.client.ask(body())
            assert answer.status is None and answer.endpoint in ngf.replicas  # one member, not a list
            assert answer.kinds[0] == "request_headers"  # the answer NGF reads comes first
            chosen.append(answer.endpoint)
            # nginx's proxy_pass to the chosen member; the picker never hears of the response
            response = nginx.post(f"http://{answer.endpoint}/v1/completions", content=body())
            assert response.status_code == 200
    assert set(chosen) == set(ngf.replicas)  # spread over the pool
    # no response phase: the engines' own gauges (scraped every 100 ms) end each request
    wait_until(lambda: ngf.metric("picker_in_flight") == 0, 10, what="in flight back to 0")


def test_a_drained_member_is_never_chosen(ngf: Deployment) -> None:
    drained = ngf.replicas[0]
    ngf.admin(drained, "drain")
    try:
        for _ in range(15):
            answer = ngf.client.ask(body(1))
            assert answer.endpoint in ngf.replicas[1:]
    finally:
        ngf.admin(drained, "undrain")
    wait_until(lambda: ngf.metric("picker_in_flight") == 0, 10, what="in flight back to 0")


def test_refusals_arrive_as_immediate_responses(ngf: Deployment) -> None:
    bad = ngf.client.ask(b"{not json")
    assert bad.status == 400 and bad.reason == "bad-request" and bad.endpoint is None
    assert bad.kinds == ("immediate_response",)
    for replica in ngf.replicas:
        ngf.admin(replica, "drain")
    try:
        waited = ngf.client.ask(body())  # queued, with no ready endpoint, until its TTL (0.5 s)
        assert waited.status == 503 and waited.reason == "rejected-no-endpoints"
        assert waited.kinds == ("immediate_response",)  # no message-timeout override first
    finally:
        for replica in ngf.replicas:
            ngf.admin(replica, "undrain")
