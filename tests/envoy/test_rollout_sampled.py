"""The rollout's `--real-vllm` path through the real Envoy, with simulators standing in for vLLM.

Real vLLM needs ~2 GB and ~25 s per replica (the realvllm tier); what `--real-vllm` adds on top of the
launcher is tested here: the replica handle (start, SIGTERM, exit, stop), the lanes drawn from each
replica's own /metrics samples, and naming the replica that answered from each setup's Envoy access
log. The simulator also names itself in a header, which is the check on that access log.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.procs import Proc
from loadtest.realvllm.launcher import RealVllm
from loadtest.rollout import fleet as fleet_module
from loadtest.rollout.load import poisson_arrivals
from loadtest.rollout.rolling import RolloutOptions, run_setup
from loadtest.stack import health_ok, sim_argv
from loadtest.traffic import REPLICA_HEADER

pytestmark = pytest.mark.envoy

OPTIONS = RolloutOptions(
    replicas=2,
    rate=12.0,
    duration_s=6.0,
    tokens=(10, 40),
    rollout_at_s=1.0,
    shutdown_timeout_s=10.0,
    real_vllm=True,
)


@contextlib.contextmanager
def simulated_vllm(port: int, workdir: Path, shutdown_timeout: int | None = None) -> Iterator[RealVllm]:
    """The launcher's `real_vllm`, serving a simulator in vLLM's drain mode instead."""
    extra = ["--ttft-ms", "20", "--itl-ms", "25", "--shutdown-timeout", str(shutdown_timeout or 0)]
    proc = Proc(f"sim-{port}", sim_argv([port], extra), workdir / f"sim-{port}.log")
    try:
        proc.wait_ready(lambda: health_ok(port), 30)
        yield RealVllm(port=port, process=proc.popen, log_path=proc.log_path)
    finally:
        proc.stop()


@pytest.mark.parametrize("kind", ["round-robin", "picker"])
async def test_real_vllm_path_draws_lanes_from_metrics_and_names_replicas(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fleet_module, "real_vllm", simulated_vllm)
    arrivals = poisson_arrivals(OPTIONS.rate, OPTIONS.duration_s, OPTIONS.tokens, OPTIONS.seed)
    run = await run_setup(kind, OPTIONS, arrivals, tmp_path)

    assert len(run.load.outcomes) == len(arrivals)
    assert all(o.request_id.startswith(f"{kind}-") for o in run.load.outcomes)
    old = [a for a, name in run.lane_names.items() if name.startswith("old")]
    states = {(e.replica, e.state) for e in run.events if e.kind == "state"}
    assert all((a, "gone") in states for a in old)
    for address in run.lane_names:  # every replica was sampled; the old ones served, and left at 0
        samples = [e.value for e in run.events if e.kind == "load" and e.replica == address]
        assert samples, address
        if address in old:
            assert max(samples) > 0 and samples[-1] == 0, (address, samples)
    # Both setups' Envoy configs log the client's x-request-id beside the upstream that answered it.
    named = [o for o in run.load.outcomes if o.upstream]
    reached = [o for o in run.load.outcomes if o.result.headers.get(REPLICA_HEADER)]
    assert reached and len(named) == len(reached)
    assert all(o.upstream == o.result.headers[REPLICA_HEADER] for o in named)
    if kind == "picker":
        assert run.load.kinds() == {"completed": len(arrivals)}
