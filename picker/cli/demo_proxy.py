"""`picker demo --proxy`: the same drain as `picker demo`, with `picker proxy` and no Envoy; then the
proxy's own shutdown deadline, which ends each stream it must cut with an error event and [DONE].

Reuses `picker demo`'s narration (picker/cli/demo.py) so both demos say the same things the same way.
"""

from __future__ import annotations

import asyncio
import json
import signal
import tempfile
import time
from pathlib import Path

import httpx

from loadtest.procs import wait_until
from loadtest.proxy_stack import ProxyStack
from loadtest.sse_client import StreamResult, stream_request
from loadtest.stack import StackOptions
from loadtest.traffic import completion_body, run_closed_loop
from picker.cli.demo import (
    _SIM_ARGS,
    _arrivals_after,
    _FileDrain,
    _print_record,
    _print_report,
    _write_endpoints,
    print_drain_outcome,
)

_DEADLINE_S = 2.0  # the proxy's shutdown budget in the second part


def _describe_cut(result: StreamResult) -> str:
    tokens = len(result.content_chunks)
    last = result.events[-2].json if len(result.events) >= 2 else None
    if isinstance(last, dict) and "error" in last:
        reason = last["error"].get("reason")
        return f"{tokens} tokens, then an error event (reason {reason}) and [DONE]"
    return f"{tokens} tokens, done={result.done}, end={result.end}"


async def _deadline_part(stack: ProxyStack) -> bool:
    """Long streams in flight, then SIGTERM: what each client receives when the budget runs out."""
    assert stack.picker is not None
    print(f"\npart 2: the proxy's own shutdown, budget {_DEADLINE_S:.0f} s, with 4 streams of 60 s in flight")
    async with httpx.AsyncClient(timeout=30) as client:
        flowing = [asyncio.Event() for _ in range(4)]
        streams = [
            asyncio.create_task(
                stream_request(
                    client, stack.url + "/v1/completions", completion_body(4000), first_event=event
                )
            )
            for event in flowing
        ]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in flowing)), 10)
        started = time.monotonic()
        print("  SIGTERM to the proxy")
        stack.picker.signal(signal.SIGTERM)
        results = await asyncio.wait_for(asyncio.gather(*streams), 30)
        print(f"  the streams ended {time.monotonic() - started:.1f} s later:")
        for result in results:
            print(f"    {_describe_cut(result)}")
    code = await asyncio.to_thread(stack.picker.wait_exit, 15)
    summary = next((line for line in stack.picker.log_text().splitlines() if "shutdown done" in line), "")
    print(f"  proxy exit code {code}; its summary: {summary[summary.find('picker shutdown') :]}")
    return code == 0 and all(r.done for r in results)


async def run_demo_proxy(seconds: float = 8.0) -> int:
    """3 simulated replicas and `picker proxy`; stream through it; drain one; then stop the proxy."""
    with tempfile.TemporaryDirectory(prefix="picker-demo-proxy-") as tmp:
        workdir = Path(tmp)
        endpoints_file = workdir / "endpoints.yaml"
        config = workdir / "picker.yaml"
        config.write_text(
            json.dumps({"pool": {"endpoints_file": str(endpoints_file), "endpoints_file_poll_s": 0.1}})
        )
        args = ("--config", str(config), "--drain-timeout", str(_DEADLINE_S), "--propagation", "0.5")
        options = StackOptions(replicas=3, sim_args=_SIM_ARGS, static_endpoints=False, picker_args=args)
        stack = ProxyStack(workdir, options)
        _write_endpoints(endpoints_file, [{"address": a} for a in stack.replicas])
        print("starting 3 simulated vLLM replicas and `picker proxy` (no Envoy; all on 127.0.0.1) ...")
        await asyncio.to_thread(stack.start)
        try:
            print(f"  picker proxy    {stack.url}  (clients talk to it directly)")
            print(f"  metrics/admin   http://127.0.0.1:{stack.metrics_port}/metrics")
            print(f"  status page     http://127.0.0.1:{stack.metrics_port}/status (live during the demo)")
            print(f"  replicas        {', '.join(stack.replicas)}")
            print(f"part 1: streaming completions through the proxy for {seconds:.0f} s (12 at a time) ...")
            drain = _FileDrain(stack, endpoints_file, time.monotonic())
            report, _ = await asyncio.gather(
                run_closed_loop(
                    stack.url, concurrency=12, max_requests=100_000, deadline_s=seconds, max_tokens=40
                ),
                drain.run(after_s=seconds * 0.3),
            )
            drained = stack.replicas[-1]
            _print_report(report, stack.replicas, drained)
            arrivals = None
            if drain.began_at is not None:
                arrivals = await asyncio.to_thread(_arrivals_after, stack, drain.began_at)
            print_drain_outcome(report, drained, arrivals)
            await asyncio.to_thread(wait_until, lambda: stack.picker_value("picker_in_flight") == 0, 10)
            print("  proxy in-flight after the run: 0")
            if drain.record is not None:
                _print_record(drain.record)
            cut_cleanly = await _deadline_part(stack)
            clean = drain.record is not None and drain.record["picks_after_start"] == 0
            return 0 if clean and cut_cleanly and not report.failures() else 1
        finally:
            await asyncio.to_thread(stack.stop)
