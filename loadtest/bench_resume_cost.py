"""What resume costs when nothing fails: `picker proxy` with streams.resume off and on, rounds interleaved.

Two proxies over the same three simulated replicas (one simulator process), one with resume off and
one with streams.resume=always (every stream's events rewritten). Each round runs, on each proxy in
turn, 200 concurrent streams x 50 tokens, then 500 one-token requests (32 at a time), and reads each
proxy's CPU time from /proc: CPU per chunk and per request. Rounds alternate which proxy goes first,
and the medians are printed side by side (this 2-core VM's run-to-run noise is as large as the
difference in one round). `--token-ids`: every client asks for token ids itself, so the simulator
does the same work for both proxies. Run: `python -m loadtest.bench_resume_cost` (about 2 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from loadtest.proxy_stack import ProxyStack
from loadtest.rawclient import ITL_S, cpu_seconds, one_stream
from loadtest.stack import StackOptions

SIM_ARGS = ("--ttft-ms", "5", "--itl-ms", str(ITL_S * 1000))


async def streams(port: int, pid: int, count: int, tokens: int, token_ids: bool) -> float:
    """CPU microseconds per chunk of `count` concurrent streams of `tokens` tokens."""
    before = cpu_seconds(pid)
    tasks = []
    for _ in range(count):
        tasks.append(asyncio.create_task(one_stream(port, tokens, token_ids=token_ids)))
        await asyncio.sleep(1.0 / count)  # spread the streams' phases over a second
    results = await asyncio.gather(*tasks)
    chunks = sum(len(r.arrivals) for r in results)
    return (cpu_seconds(pid) - before) / max(1, chunks) * 1e6


async def requests(port: int, pid: int, count: int, token_ids: bool) -> float:
    """CPU microseconds per one-token request, 32 at a time."""
    before, issued = cpu_seconds(pid), 0

    async def worker() -> None:
        nonlocal issued
        while issued < count:
            issued += 1
            await one_stream(port, 1, token_ids=token_ids)

    await asyncio.gather(*(worker() for _ in range(32)))
    return (cpu_seconds(pid) - before) / count * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--token-ids", action="store_true", help="every request asks for token ids itself")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-resume-cost-") as tmp:
        workdir = Path(tmp)
        options = StackOptions(replicas=3, sim_args=SIM_ARGS, picker_args=("--no-scrape",))
        off = ProxyStack(workdir, options)
        (workdir / "on").mkdir()
        on = ProxyStack(workdir / "on", replace(options, picker_env={"PICKER_STREAMS__RESUME": "always"}))
        on.replica_ports = off.replica_ports  # the same simulators
        try:
            await asyncio.to_thread(off.start)
            await asyncio.to_thread(on.start_picker)
            assert off.picker is not None and on.picker is not None
            rows = {"off": (off.listen_port, off.picker.pid), "on": (on.listen_port, on.picker.pid)}
            figures: dict[str, dict[str, list[float]]] = {k: {"chunk": [], "request": []} for k in rows}
            print(f"{args.rounds} rounds, 200 streams x 50 tokens + 500 one-token requests per proxy")
            for index in range(args.rounds):
                order = ["off", "on"] if index % 2 == 0 else ["on", "off"]
                for name in order:
                    port, pid = rows[name]
                    figures[name]["chunk"].append(await streams(port, pid, 200, 50, args.token_ids))
                    figures[name]["request"].append(await requests(port, pid, 500, args.token_ids))
                last = {k: (v["chunk"][-1], v["request"][-1]) for k, v in figures.items()}
                print(
                    f"  round {index + 1}: per chunk {last['off'][0]:.0f} -> {last['on'][0]:.0f} us,"
                    f" per request {last['off'][1]:.0f} -> {last['on'][1]:.0f} us",
                    flush=True,
                )
            for what in ("chunk", "request"):
                a, b = statistics.median(figures["off"][what]), statistics.median(figures["on"][what])
                print(
                    f"median CPU per {what}: resume off {a:.0f} us, on {b:.0f} us"
                    f" ({100 * (b / a - 1):+.0f} %)"
                )
        finally:
            on.picker and on.picker.stop()
            off.stop()


if __name__ == "__main__":
    asyncio.run(main())
