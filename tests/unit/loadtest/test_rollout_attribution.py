"""The rollout's `--real-vllm` pure parts: naming the replica that answered from Envoy's access log,
reading a replica's own request count from vLLM's /metrics, lanes drawn from those samples, and the
vLLM replica handle's stop-before-started race."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.rollout import __main__ as rollout_main
from loadtest.rollout import fleet as fleet_module
from loadtest.rollout.attribution import engine_requests, request_id, upstreams_from_access_log
from loadtest.rollout.load import LoadReport, Outcome
from loadtest.rollout.rolling import REAL_VLLM_DEFAULTS
from loadtest.rollout.timeline import in_flight_series, load_event, stream_event
from loadtest.sse_client import SseEvent, StreamResult

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="capacity"} 1.0
vllm:num_requests_running{engine="1",model_name="tiny-llama"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.25
"""


def test_access_log_names_the_upstream_of_each_request_id() -> None:
    lines = [
        json.dumps({"request_id": "round-robin-0", "upstream_host": "127.0.0.1:9001", "code": 200}),
        json.dumps({"request_id": "round-robin-1", "upstream_host": "127.0.0.1:9002", "code": 500}),
        json.dumps({"request_id": "round-robin-2", "upstream_host": "-", "code": 503}),  # local reply
        json.dumps({"request_id": "-", "upstream_host": "127.0.0.1:9001"}),  # a request without an id
        '{"request_id": "round-robin-3", "upstr',  # a line still being written
        "[1, 2]",
        "",
    ]
    assert upstreams_from_access_log(lines) == {
        "round-robin-0": "127.0.0.1:9001",
        "round-robin-1": "127.0.0.1:9002",
    }
    assert request_id("round-robin", 7) == "round-robin-7"


def test_engine_requests_sums_running_and_waiting_only() -> None:
    assert engine_requests(VLLM_METRICS) == 6  # 2 + 1 + 3; not the by-reason gauge, not KV usage
    assert engine_requests("vllm:num_requests_running 4\n") == 4
    assert engine_requests("picker_requests_in_flight 3\n# HELP vllm:num_requests_running x\n") is None
    assert engine_requests('vllm:num_requests_running{engine="0"} NaNx\n') is None


def test_lanes_follow_the_replicas_own_samples_when_there_are_any() -> None:
    events = [
        *(stream_event(0.0, 5.0, "r1", 0.01) for _ in range(9)),  # the clients' view, overridden
        load_event(1.0, "r1", 2),
        load_event(2.0, "r1", 5),
        load_event(3.0, "r1", 0),
        stream_event(0.0, 1.0, "r2", 0.01),  # r2 has no samples: counted from streams as before
    ]
    times, values = in_flight_series(events, "r1", 4.0)
    assert values[times.index(0.5)] == 0 and values[times.index(1.5)] == 2
    assert values[times.index(2.5)] == 5 and values[-1] == 0
    assert max(in_flight_series(events, "r2", 4.0)[1]) == 1


def _completed(headers: dict[str, str] | None = None) -> StreamResult:
    events = [
        SseEvent('{"choices": [{"text": "a", "finish_reason": "length"}]}', 0.1),
        SseEvent("[DONE]", 0.2),
    ]
    return StreamResult(
        status=200, headers=headers or {}, events=events, end="done", t_headers=0.05, t_end=0.3
    )


def test_attribution_fills_only_what_the_replica_did_not_say() -> None:
    report = LoadReport(
        [
            Outcome(0.0, _completed({"x-sim-replica": "127.0.0.1:9009"}), "t-0"),
            Outcome(1.0, _completed(), "t-1"),
            Outcome(2.0, StreamResult(status=500, t_end=0.01), "t-2"),
            Outcome(3.0, _completed(), "t-3"),  # not in the log: no lane, still in the TTFT bars
        ]
    )
    assert report.attribute({"t-0": "127.0.0.1:9001", "t-1": "127.0.0.1:9001", "t-2": "127.0.0.1:9002"}) == 3
    assert [o.replica for o in report.outcomes] == ["127.0.0.1:9009", "127.0.0.1:9001", "127.0.0.1:9002", ""]
    events = report.timeline_events()
    assert [e.replica for e in events if e.kind == "stream"] == ["127.0.0.1:9009", "127.0.0.1:9001", ""]
    assert [(e.replica, e.label) for e in events if e.kind == "error"] == [("127.0.0.1:9002", "HTTP 500")]


class _FakeServer:
    pid = 0
    closed = False


def test_a_vllm_stopped_while_starting_is_closed_when_its_start_returns(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    release, server = threading.Event(), _FakeServer()

    @contextlib.contextmanager
    def fake_real_vllm(port: int, workdir: Path, shutdown_timeout: int | None = None) -> Iterator[Any]:
        assert release.wait(10), "the test never released the start"
        try:
            yield server
        finally:
            server.closed = True

    monkeypatch.setattr(fleet_module, "real_vllm", fake_real_vllm)
    replica = fleet_module.VllmReplica(1234, tmp_path, 30.0)
    starter = threading.Thread(target=replica.start)
    starter.start()
    replica.stop()  # the run gave up while the server was still starting
    assert not server.closed
    release.set()
    starter.join(10)
    assert server.closed and not starter.is_alive()


def test_real_vllm_has_small_defaults_and_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = rollout_main.build_parser(real_vllm=True).parse_args(["--real-vllm"])
    assert (args.replicas, args.rate, args.max_tokens) == (2, REAL_VLLM_DEFAULTS["rate"], (30, 150))
    assert rollout_main.build_parser().parse_args([]).replicas == 3  # the simulator's default is kept
    monkeypatch.setattr(rollout_main.launcher, "skip_reason", lambda: "real vLLM not installed: run it")
    assert rollout_main.main(["--real-vllm"]) == 2
    assert "run it" in capsys.readouterr().err
