"""drain-wait's decision logic on a fake clock: quiet intervals, allowance, deadline, bad samples."""

from __future__ import annotations

import json

import pytest

from picker.drain.wait import (
    DrainWait,
    Phase,
    Sample,
    SampleError,
    Settings,
    UsageError,
    arrived,
    main,
    parse_sample,
    parse_settings,
    run,
)

SETTINGS = Settings(quiet_interval_s=1.0, propagation_allowance_s=10.0, deadline_s=30.0, poll_interval_s=0.25)
IDLE = Sample(running=0, waiting=0, finished=5, admitted=100)
BUSY = Sample(running=2, waiting=1, finished=5, admitted=100)
REFUSED = SampleError("refused", "connection refused")
TIMEOUT = SampleError("timeout", "slow")


def feed(machine: DrainWait, samples: list[tuple[float, Sample | SampleError]]) -> Phase:
    phase = machine.phase
    for now, result in samples:
        phase = machine.advance(now)
        if phase is Phase.DONE:
            break
        phase = machine.observe(now, result)
    return phase


def test_two_quiet_intervals_end_propagation_then_idle_ends_the_drain() -> None:
    machine = DrainWait(SETTINGS, start=0.0)
    assert feed(machine, [(0.1, BUSY), (1.0, BUSY), (2.0, BUSY)]) is Phase.PROPAGATION
    assert machine.observe(2.1, BUSY) is Phase.DRAIN  # 2.0 s after the first sample at 0.1
    assert machine.propagation_ended_by == "quiet"
    assert machine.observe(5.0, BUSY) is Phase.DRAIN
    assert machine.observe(6.0, IDLE) is Phase.DONE
    summary = machine.summary(6.0)
    assert summary["outcome"] == "idle"
    assert summary["propagation"] == {"ended_by": "quiet", "seconds": 2.1}
    assert summary["drain"] == {"ended_by": "idle", "seconds": 3.9}
    assert summary["last"] == {"running": 0, "waiting": 0}


def test_an_idle_engine_still_waits_for_the_quiet_intervals() -> None:
    machine = DrainWait(SETTINGS, start=0.0)
    assert feed(machine, [(0.0, IDLE), (1.0, IDLE), (1.9, IDLE)]) is Phase.PROPAGATION
    assert machine.observe(2.0, IDLE) is Phase.DONE
    assert machine.summary(2.0)["outcome"] == "idle"


def test_each_arrival_restarts_the_quiet_clock_until_the_allowance_ends() -> None:
    machine = DrainWait(SETTINGS, start=0.0)
    samples = [(t * 0.5, Sample(1, 0, 0, admitted=t)) for t in range(22)]  # a new request every 0.5 s
    assert feed(machine, samples) is Phase.DRAIN
    assert machine.propagation_ended_by == "allowance"
    assert machine.propagation_end == pytest.approx(10.0)
    assert machine.arrivals >= 18


def test_arrival_after_quiet_is_too_late_to_matter_once_draining() -> None:
    machine = DrainWait(SETTINGS, start=0.0)
    feed(machine, [(0.0, BUSY), (2.0, BUSY)])
    assert machine.phase is Phase.DRAIN
    assert machine.observe(2.5, Sample(3, 1, 5, admitted=130)) is Phase.DRAIN  # counted, but no way back
    assert machine.observe(3.0, IDLE) is Phase.DONE


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        (Sample(1, 0, 0, 10), Sample(1, 0, 0, 10), False),  # streams running, nothing new
        (Sample(2, 0, 0, 10), Sample(1, 0, 1, 10), False),  # one finished
        (Sample(2, 0, 0, 10), Sample(1, 0, 0, 10), False),  # one aborted by its client (not counted)
        (Sample(1, 0, 0, 10), Sample(1, 0, 0, 14), True),  # a prefill: a request started
        (Sample(1, 0, 0, 10), Sample(1, 0, 0, 3), True),  # counters went down: engine restarted
        (Sample(1, 0, 0, None), Sample(1, 1, 0, None), True),  # queued before its prefill
        (Sample(1, 0, 0, None), Sample(1, 0, 1, None), True),  # one finished, one arrived: gauge flat
        (Sample(1, 0, 5, None), Sample(1, 0, 2, None), True),  # success counter reset
        (Sample(1, 0, None, None), Sample(2, 0, None, None), True),  # gauges only
        (Sample(2, 0, None, None), Sample(1, 0, None, None), False),
    ],
)
def test_arrived(before: Sample, after: Sample, expected: bool) -> None:
    assert arrived(before, after) is expected


def test_errors_do_not_reset_the_quiet_clock_and_an_arrival_across_them_is_seen() -> None:
    machine = DrainWait(SETTINGS, start=0.0)
    feed(machine, [(0.0, BUSY), (0.5, TIMEOUT), (1.0, SampleError("malformed", "html"))])
    assert machine.phase is Phase.PROPAGATION
    machine.observe(1.5, Sample(2, 1, 5, admitted=120))  # compared with the last good sample
    assert machine.arrivals == 1
    still = Sample(2, 1, 5, admitted=120)
    assert machine.observe(3.4, still) is Phase.PROPAGATION
    assert machine.observe(3.5, still) is Phase.DRAIN


def test_unreadable_metrics_sleep_the_allowance_then_give_up() -> None:
    machine = DrainWait(SETTINGS, start=0.0)
    samples = [(t * 0.25, REFUSED) for t in range(80)]
    assert feed(machine, samples) is Phase.DONE
    summary = machine.summary(machine.end or 0.0)
    assert summary["propagation"]["ended_by"] == "allowance"
    assert summary["outcome"] == "unobservable"
    assert machine.end == pytest.approx(10.0)  # failing for 2 quiet intervals already, at drain start
    assert summary["errors"] == {"refused": machine.errors["refused"]}
    assert "refused" in summary["last_error"]


def test_timeouts_keep_waiting_until_the_deadline() -> None:
    machine = DrainWait(SETTINGS, start=0.0)
    feed(machine, [(0.0, BUSY), (2.0, BUSY)])
    samples = [(2.0 + t, TIMEOUT) for t in range(40)]
    assert feed(machine, samples) is Phase.DONE
    assert machine.outcome == "deadline"
    assert machine.end == pytest.approx(30.0)


def test_deadline_during_propagation_skips_the_drain() -> None:
    settings = Settings(quiet_interval_s=5.0, propagation_allowance_s=60.0, deadline_s=3.0)
    machine = DrainWait(settings, start=100.0)
    assert machine.advance(102.9) is Phase.PROPAGATION
    assert machine.advance(103.0) is Phase.DONE
    summary = machine.summary(103.0)
    assert summary["outcome"] == "deadline"
    assert summary["propagation"]["ended_by"] == "deadline"
    assert summary["drain"] is None


def test_busy_engine_at_the_deadline() -> None:
    machine = DrainWait(SETTINGS, start=0.0)
    assert feed(machine, [(float(t), BUSY) for t in range(31)]) is Phase.DONE
    assert machine.outcome == "deadline"
    assert machine.summary(30.0)["last"] == {"running": 2, "waiting": 1}


def test_poll_budget_and_pause_never_reach_past_the_deadline() -> None:
    machine = DrainWait(Settings(deadline_s=5.0, request_timeout_s=2.0, poll_interval_s=1.0), start=0.0)
    assert machine.fetch_budget(0.0) == 2.0
    assert machine.fetch_budget(4.5) == pytest.approx(0.5)
    assert machine.pause(4.7) == pytest.approx(0.3)
    assert machine.pause(6.0) == 0.0


class FakeTime:
    """A clock that only moves when the loop sleeps or a poll takes time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def test_run_loop_on_a_fake_clock_stops_within_one_poll_of_idle() -> None:
    fake = FakeTime()
    idle_at = fake.now + 7.0

    def fetch(budget: float) -> Sample | SampleError:
        fake.now += min(0.05, budget)  # each poll costs 50 ms
        return IDLE if fake.now >= idle_at else BUSY

    summary = run(SETTINGS, fetch, fake.clock, fake.sleep)
    assert summary["outcome"] == "idle"
    assert 7.0 <= summary["total_s"] <= 7.0 + SETTINGS.poll_interval_s + 0.05


def test_run_loop_with_polls_that_use_their_whole_budget_ends_at_the_deadline() -> None:
    fake = FakeTime()
    start = fake.now

    def fetch(budget: float) -> Sample | SampleError:
        fake.now += budget  # a server that never answers
        return TIMEOUT

    summary = run(
        Settings(deadline_s=4.0, request_timeout_s=1.5, poll_interval_s=0.5), fetch, fake.clock, fake.sleep
    )
    assert summary["outcome"] == "deadline"
    assert fake.now - start == pytest.approx(4.0)


def test_the_deadline_counts_from_when_the_hook_started_not_from_the_loop() -> None:
    """Time spent starting the process (imports) is part of the preStop budget the kubelet enforces."""
    fake = FakeTime()
    started = fake.now
    fake.now += 1.5  # the command took 1.5 s to get to its loop

    def fetch(budget: float) -> Sample | SampleError:
        fake.now += budget
        return TIMEOUT

    summary = run(Settings(deadline_s=4.0), fetch, fake.clock, fake.sleep, started=started)
    assert summary["outcome"] == "deadline"
    assert fake.now - started == pytest.approx(4.0)
    assert summary["total_s"] == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            'vllm:num_requests_running{engine="0",model_name="a"} 2\n'
            'vllm:num_requests_running{engine="1",model_name="a"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="a"} 1 1712345678000\n'
            'vllm:num_requests_waiting{engine="1",model_name="a"} 0\n'
            'vllm:request_success_total{engine="0",finished_reason="stop"} 7\n'
            'vllm:request_success_total{engine="0",finished_reason="abort"} 1\n'
            'vllm:request_success_created{engine="0",finished_reason="stop"} 1.7e9\n'
            'vllm:prompt_tokens_total{engine="0"} 40\n'
            'vllm:time_to_first_token_seconds_count{engine="0"} 8\n'
            'vllm:time_to_first_token_seconds_sum{engine="0"} 0.4\n'
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9\n',
            Sample(running=5, waiting=1, finished=8, admitted=48),
        ),
        (  # label values holding braces, spaces, escaped quotes; CRLF line ends
            'vllm:num_requests_running{model_name="a} b \\"c\\"",engine="0"} 4\r\n'
            "vllm:num_requests_waiting 2\r\n",
            Sample(running=4, waiting=2),
        ),
    ],
)
def test_parse_sample(text: str, expected: Sample) -> None:
    assert parse_sample(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<html><body>502 Bad Gateway</body></html>",
        "\x00\x01\x02 garbage \xff",
        'vllm:num_requests_running{engine="0"} NaN\nvllm:num_requests_waiting 0\n',
        "vllm:num_requests_running +Inf\nvllm:num_requests_waiting 0\n",
        "vllm:num_requests_running -1\nvllm:num_requests_waiting 0\n",
        "vllm:num_requests_running zero\nvllm:num_requests_waiting 0\n",
        "vllm:num_requests_running 0\n",  # waiting missing
        'vllm:num_requests_running{engine="0 0\nvllm:num_requests_waiting 0\n',  # unclosed labels
    ],
)
def test_parse_sample_rejects_unusable_pages(text: str) -> None:
    result = parse_sample(text)
    assert isinstance(result, SampleError)
    assert result.kind == "malformed"


@pytest.mark.parametrize(
    "argv",
    [
        ["--deadline", "soon"],
        ["--deadline", "-1"],
        ["--quiet-interval", "0"],
        ["--metrics-url", "ftp://x/metrics"],
        ["--metrics-url", "https://127.0.0.1:8000/metrics"],
        ["--metrics-url", "http://127.0.0.1:99999/metrics"],
        ["--metrics-url", "not a url"],
        ["--unknown-flag"],
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(UsageError):
        parse_settings(argv)


def test_settings_from_arguments() -> None:
    settings = parse_settings(
        ["--url", "http://127.0.0.1:8001/metrics", "--quiet-interval=3", "--propagation-allowance", "15"]
    )
    assert settings.metrics_url == "http://127.0.0.1:8001/metrics"
    assert (settings.quiet_interval_s, settings.propagation_allowance_s, settings.deadline_s) == (
        3.0,
        15.0,
        60.0,
    )


def test_main_exits_zero_and_says_why_on_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--deadline", "soon"]) == 0
    record = json.loads(capsys.readouterr().err.strip())
    assert record["outcome"] == "bad-arguments"
    assert "--deadline" in record["error"]


async def test_the_hooks_drain_is_a_prestop_drain() -> None:
    """Issue 53, item 5: the drain drain-wait asks for (--move-streams-url) says it is the preStop
    hook's (`cause=prestop`), so a rollout's `resume` never lifts it; a URL naming a cause keeps it."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from picker.admin.api import admin_app
    from picker.drain.wait import ask_move, prestop_url
    from picker.observability.metrics import Metrics
    from picker.pool import EndpointState, Pool

    assert prestop_url(
        "http://p:9090/admin/endpoints/[::1]:8000/drain?move_streams=true&cause=operator"
    ).endswith("move_streams=true&cause=operator")
    pool = Pool()
    pool.reconcile({"10.0.0.1:8000": EndpointState.READY, "10.0.0.2:8000": EndpointState.READY}, "kube")
    client = TestClient(
        TestServer(admin_app(pool, Metrics(pool="default"), move_streams=lambda _: 2), host="127.0.0.1")
    )
    await client.start_server()
    try:
        url = str(client.make_url("/admin/endpoints/10.0.0.1:8000/drain?move_streams=true"))
        answer = await asyncio.to_thread(ask_move, Settings(move_streams_url=url))
        assert answer == {"status": 200, "moved": 2}
        shown = await (await client.get("/admin/endpoints/10.0.0.1:8000")).json()
        assert shown["endpoint"]["drained_by"] == [{"cause": "prestop"}]
    finally:
        await client.close()
