"""Active-passive, as the reference picker's `--ha-enable-leader-election` (issue 23, item 2): two
pickers behind the real Envoy campaign for one Lease on the fake API server; only the holder is
ready, so Envoy's health checks send every stream to it. Failover measured under 20 new requests a
second: (a) the leader SIGKILLed: the standby leads once the Lease expires; (b) the leader cut off
from the API server: it stands down at its renew deadline, the standby leads when the Lease expires.
Timings scaled down (2 s lease, 1.5 s renew deadline, 0.2 s retry; client-go's are 15 s, 10 s, 2 s).
Every failure in the gap is the contract's retryable 503, and no stream already flowing is cut."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from loadtest.procs import async_wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import completion_body, stream_one
from tests.envoy.test_picker_ha import Sent, client, failed, open_loop, picker_health
from tests.kube.fake_apiserver import FakeApiServer

pytestmark = pytest.mark.envoy

LEASE_S, RENEW_S, RETRY_S = 2.0, 1.5, 0.2
LONG_STREAMS = 20
LONG_TOKENS = 240  # 25 ms apart: ~6 s, across the failover


def leader_stack(tmp_path: Path, fake: FakeApiServer) -> tuple[Stack, list[str]]:
    tokens = [fake.add_token(f"picker-{i}-token") for i in range(2)]
    args_at = tuple(
        (
            "--kubeconfig",
            str(fake.write_kubeconfig(tmp_path / f"kc-{i}", token=token)),
            "--ha-enable-leader-election",
            f"--leader-lease-duration={LEASE_S}",
            f"--leader-renew-deadline={RENEW_S}",
            f"--leader-retry-period={RETRY_S}",
        )
        for i, token in enumerate(tokens)
    )
    options = StackOptions(
        replicas=3,
        pickers=2,
        envoy_picker_tls=False,
        picker_args=("--quiet-interval", "0.3"),
        args_at=args_at,
    )
    return Stack(tmp_path, options), tokens


def healthy(stack: Stack) -> list[int]:
    """The pickers Envoy sees healthy, by index."""
    flags = picker_health(stack)
    return [i for i, (grpc_port, _, _) in enumerate(stack.picker_ports) if flags.get(grpc_port) == "healthy"]


async def failover(tmp_path: Path, fake: FakeApiServer, how: str) -> dict[str, object]:
    stack, tokens = leader_stack(tmp_path, fake)
    await asyncio.to_thread(stack.start)
    try:
        await async_wait_until(lambda: len(healthy(stack)) == 1, 15, 0.02, "one leader healthy in Envoy")
        leader = healthy(stack)[0]
        standby = 1 - leader
        async with client() as http:
            flowing = [asyncio.Event() for _ in range(LONG_STREAMS)]
            streams = [
                asyncio.create_task(stream_one(http, stack.url, completion_body(LONG_TOKENS), first_event=e))
                for e in flowing
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in flowing)), 20)
            stop = asyncio.Event()
            sent: list[Sent] = []
            load = asyncio.create_task(open_loop(http, stack.url, stop, 4, sent))
            await async_wait_until(lambda: len(sent) >= 20, 20, what="new requests flowing")
            at = time.time()
            if how == "sigkill":
                victim = stack.pickers[leader]
                assert victim is not None
                victim.kill()
            else:
                fake.partition(tokens[leader])
            await async_wait_until(lambda: leader not in healthy(stack), 10, 0.01, "the leader out of Envoy")
            leader_out_s = time.time() - at
            await async_wait_until(lambda: healthy(stack) == [standby], 10, 0.01, "the standby in Envoy")
            standby_in_s = time.time() - at
            await async_wait_until(
                lambda: sum(s.at > at + standby_in_s for s in sent) >= 40, 20, what="after"
            )
            stop.set()
            await asyncio.wait_for(load, 60)
            long_results = await asyncio.wait_for(asyncio.gather(*streams), 60)
        bad = failed(sent)
        figures = {
            "how": how,
            "leader_out_of_envoy_s": round(leader_out_s, 2),
            "standby_in_envoy_s": round(standby_in_s, 2),
            "new_requests": len(sent),
            "failed": len(bad),
            "failed_reasons": sorted({(s.result.status, s.result.reason_header) for s in bad}),
            "failures_from_s": round(min((s.at - at for s in bad), default=0), 2),
            # when the first failure came back: a request sent just before the stand-down may reach
            # Envoy after it, so the send time alone cannot tell a failure too early
            "failures_answered_from_s": round(min((s.answered - at for s in bad), default=0), 2),
            "failures_until_s": round(max((s.at - at for s in bad), default=0), 2),
            "streams_cut": sum(1 for r in long_results if r.status != 200 or not r.done),
        }
        print("leader failover:", json.dumps(figures))
        for s in bad:  # only in the gap with no ready picker, each the contract's retryable 503
            assert s.result.status == 503 and s.result.reason_header == "picker-unavailable", figures
            assert s.result.retry_after, figures
        # and it ends: Envoy's load balancer takes the new leader up to ~1 s after its health check
        # passes (measured: its /clusters says healthy first), then nothing more fails
        assert figures["failures_until_s"] < standby_in_s + 3.0, figures
        return figures
    finally:
        fake.heal(tokens[0])
        fake.heal(tokens[1])
        await asyncio.to_thread(stack.stop)


async def test_a_killed_leader_is_replaced_once_its_lease_expires(
    tmp_path: Path, fake: FakeApiServer
) -> None:
    figures = await failover(tmp_path, fake, "sigkill")
    assert figures["streams_cut"] == 0, figures  # the standby routed none; the dead one's streams run on
    # the standby takes the Lease only once it has seen it unrenewed for its duration
    standby_in = figures["standby_in_envoy_s"]
    assert isinstance(standby_in, float)
    assert LEASE_S - RETRY_S <= standby_in <= LEASE_S + 5.0, figures  # (a busy machine gets seconds)


async def test_a_leader_cut_off_from_the_api_server_stands_down(tmp_path: Path, fake: FakeApiServer) -> None:
    figures = await failover(tmp_path, fake, "partition")
    assert figures["streams_cut"] == 0, figures  # standing down is readiness only: its streams run on
    out, standby_in = figures["leader_out_of_envoy_s"], figures["standby_in_envoy_s"]
    assert isinstance(out, float) and isinstance(standby_in, float)
    assert RENEW_S - RETRY_S <= out <= RENEW_S + 5.0, figures  # at its renew deadline
    assert standby_in >= LEASE_S - RETRY_S, figures  # the Lease had to expire first
    # nothing failed before it could have stood down
    assert figures["failures_answered_from_s"] >= RENEW_S - RETRY_S, figures
