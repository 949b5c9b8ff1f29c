"""Benchmark: admission-queue dispatch latency, and what load scraping costs, at 100 endpoints.

1. Dispatch latency: 100 endpoints with 4 slots each are full and requests wait in the picker's
   queue; each time a request ends, how long until the next queued request is released (its
   waiting coroutine resumes)? Measured in-process on uvloop, p50/p99 over 2,000 releases.
2. Scrape cost: one simulator process serves 100 replicas; the picker's scraper polls all of them
   every 100 ms for a few seconds. CPU per endpoint per second, and per scrape, side by side with a
   baseline that parses the whole /metrics page with prometheus-client (what a naive scraper does).
3. Worst page: what reading one /metrics page costs the event loop, the normal page beside 4 MiB
   pages a hostile replica may send (all gauge lines; all other lines): total CPU, and the longest
   step taken without yielding to the loop.
4. Queue pop cost with 20,000 priority bands whose entries expired or were cancelled, vs none.
5. Push + pop with 20,000 queued in one flow: none with a TTFT objective (arrival order), half
   with one (earliest due first: sorted apart).

Run: `python -m loadtest.bench_flow` (about 30 s).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest import http_client
from loadtest.procs import Proc, free_port
from loadtest.stack import health_ok
from picker.config.model import LoadConfig
from picker.flow import AdmissionQueue, FlowLimits, QueuedItem
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.pool.scrapes import record_sample
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath
from picker.scheduling import LoadPolicy
from picker.sources.scraper import Scraper
from picker.sources.vllm_metrics import GaugeScanner, MetricsPageError
from picker.streams import EndReason


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def dispatch_latency(endpoints: int, slots: int, releases: int) -> None:
    pool = Pool()
    addresses = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(endpoints)]
    pool.apply(ready=addresses)
    for address in addresses:
        endpoint = pool.get(address)
        assert endpoint is not None
        record_sample(endpoint, 0, 0, 0.0, time.monotonic())
    path = RequestPath(
        pool,
        Metrics(pool="default"),
        fallback_count=2,
        load_policy=LoadPolicy(engine_slots=slots, waiting_threshold=1, staleness_s=3600),
        flow_limits=FlowLimits(max_queued=releases + 10, ttl_s=3600),
    )
    request = InferenceRequest(method="POST", path="/v1/completions", model="m", body_bytes=100)
    running = [path.admit(request) for _ in range(endpoints * (slots + 1))]
    assert all(t.done for t in running), "the pool should take slots + 1 per endpoint before queueing"
    latencies: list[float] = []
    released_at: dict[int, float] = {}

    async def waiter(index: int) -> None:
        ticket = path.admit(request)
        await ticket.wait()
        latencies.append(time.perf_counter() - released_at[index])
        running.append(ticket)

    waiters = [asyncio.create_task(waiter(i)) for i in range(releases)]
    await asyncio.sleep(0)
    assert path.flow.queued == releases
    for index in range(releases):
        ticket = running.pop(0)
        released_at[index] = time.perf_counter()
        path.finish(ticket.payload, EndReason.COMPLETED)
        await asyncio.sleep(0)  # let the released waiter run
        await asyncio.sleep(0)
    await asyncio.gather(*waiters)
    us = [v * 1e6 for v in latencies]
    print(
        f"queue dispatch latency, {endpoints} endpoints x {slots} slots, {releases} releases "
        f"(request ends -> queued request resumes): p50 {pct(us, 50):.1f} us, p99 {pct(us, 99):.1f} us, "
        f"max {max(us):.1f} us"
    )


def page_cost(name: str, page: bytes, repeats: int) -> None:
    """Scan `page` as the scraper does (64 KiB chunks as they arrive): CPU per page, longest step.

    Thread CPU time (a preempted process is not the page's cost), medians over `repeats` pages.
    """
    config = LoadConfig()
    chunk = 65536
    totals, longest, outcome = [], [], "ok"
    for _ in range(repeats):
        scanner = GaugeScanner(config.max_gauge_lines)
        started = step = time.thread_time()
        steps = []
        try:
            for offset in range(0, len(page), chunk):
                scanner.feed(page[offset : offset + chunk])
                steps.append(time.thread_time() - step)
                step = time.thread_time()
            scanner.result()
        except MetricsPageError as exc:
            outcome = f"refused ({exc})"
        steps.append(time.thread_time() - step)
        totals.append(time.thread_time() - started)
        longest.append(max(steps))
    print(
        f"{name:<44} | {len(page):>9} | {statistics.median(totals) * 1e3:>13.3f} | "
        f"{statistics.median(longest) * 1e3:>16.3f} | {outcome}"
    )


def worst_pages(normal: bytes) -> None:
    line = b'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
    flood = line * (4 * 1024 * 1024 // len(line) - 1)
    other = b'vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 4.0\n'
    filler = other * (4 * 1024 * 1024 // len(other) - 1)
    print("\nreading one /metrics page (what the event loop pays per scrape; max_page_bytes is 4 MiB)")
    header = ("page", "bytes", "ms CPU/page", "longest step ms", "outcome")  # thread CPU, medians
    print(f"{header[0]:<44} | {header[1]:>9} | {header[2]:>13} | {header[3]:>16} | {header[4]}")
    page_cost("normal page (simulator)", normal, 200)
    page_cost("4 MiB of gauge lines (hostile)", flood, 20)
    page_cost("4 MiB of other lines + the gauges", filler[: len(filler) - len(normal)] + normal, 20)


def queue_pop_cost(dead_bands: int, pops: int = 20_000) -> float:
    """Microseconds per pop (plus one push) with `dead_bands` emptied bands below the live one.

    The best of three runs (timeit's rule: slower runs measure the machine's other work)."""
    queue = AdmissionQueue(10**7, 10**12)
    for band in range(dead_bands):
        item = QueuedItem("f", -1 - band, 1, 0.0)
        queue.push(item)
        queue.remove(item)
    queue.push(QueuedItem("f", 0, 1, 0.0))
    runs = []
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(pops):
            queue.pop()
            queue.push(QueuedItem("f", 0, 1, 0.0))
        runs.append((time.perf_counter() - started) / pops * 1e6)
    return min(runs)


def objective_cost(queued: int = 20_000, share: float = 0.0) -> float:
    """Nanoseconds per push + pop with `queued` requests in one flow, `share` of them with a TTFT
    objective (due 0-1 s after its arrival, arrivals 10 ms apart). The best of three runs."""
    runs = []
    for _ in range(3):
        rng = random.Random(1)
        items = [
            QueuedItem("f", 0, 1, 0.0, deadline=i * 0.01 + rng.random(), timed=True)
            if rng.random() < share
            else QueuedItem("f", 0, 1, 0.0, deadline=30.0 + i * 0.01)
            for i in range(queued)
        ]
        queue = AdmissionQueue(10**7, 10**12)
        started = time.perf_counter()
        for item in items:
            queue.push(item)
        while queue.pop() is not None:
            pass
        runs.append((time.perf_counter() - started) / queued * 1e9)
    return min(runs)


def serve_static(page_file: str, ports: list[int]) -> None:
    """A stand-in for 100 engines: one canned /metrics page on many ports, as cheap as can be."""
    from aiohttp import web

    page = Path(page_file).read_bytes()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/plain")

    async def run() -> None:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for port in ports:
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    import uvloop

    uvloop.run(run())


async def _baseline_round(client: httpx.AsyncClient, urls: list[str]) -> None:
    async def one(url: str) -> None:
        text = (await client.get(url)).text
        for family in text_string_to_metric_families(text):
            for _sample in family.samples:
                pass

    await asyncio.gather(*(one(u) for u in urls))


async def scrape_cost(endpoints: int, seconds: float, workdir: Path) -> None:
    sim_port = free_port()
    sim = Proc("sim", [sys.executable, "-m", "vllm_sim", "--port", str(sim_port)], workdir / "sim.log")
    try:
        sim.wait_ready(lambda: health_ok(sim_port))
        page = await asyncio.to_thread(
            lambda: http_client.get(f"http://127.0.0.1:{sim_port}/metrics").content
        )
    finally:
        sim.stop()
    (workdir / "page.txt").write_bytes(page)
    worst_pages(page)
    ports = [free_port() for _ in range(endpoints)]
    server = Proc(
        "pages",
        [sys.executable, "-m", "loadtest.bench_flow", "--serve", str(workdir / "page.txt"), *map(str, ports)],
        workdir / "pages.log",
    )
    try:
        for port in ports:
            server.wait_ready(lambda p=port: health_ok(p), timeout=60)
        print(
            f"\nscraping {endpoints} endpoints every 100 ms for {seconds:.0f} s each way "
            f"(a real vLLM /metrics page from the simulator, {len(page)} B, served by a stand-in process)"
        )
        header = ("scraper", "rounds/s", "CPU % core", "ms CPU/endpoint/s", "us/scrape")
        print(f"{header[0]:<44} | {header[1]:>8} | {header[2]:>10} | {header[3]:>17} | {header[4]:>9}")

        pool = Pool()
        pool.apply(ready=[f"127.0.0.1:{p}" for p in ports])
        rounds = 0

        def count_round() -> None:
            nonlocal rounds
            rounds += 1

        scraper = Scraper(pool, LoadConfig(scrape_interval_s=0.1, scrape_timeout_s=2.0), on_round=count_round)
        await scraper.scrape_round()  # warm the connection pool
        cpu0, wall0, rounds = time.process_time(), time.perf_counter(), 0
        task = asyncio.create_task(scraper.run())
        await asyncio.sleep(seconds)
        task.cancel()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        await scraper.close()
        _row("picker (aiohttp, gauge lines only)", rounds, cpu, wall, endpoints)

        urls = [f"http://127.0.0.1:{p}/metrics" for p in ports]
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with http_client.AsyncClient(limits=limits, timeout=2.0) as client:
            await _baseline_round(client, urls)
            cpu0, wall0, rounds = time.process_time(), time.perf_counter(), 0
            stop_at = wall0 + seconds
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                await _baseline_round(client, urls)
                rounds += 1
                await asyncio.sleep(max(0.0, 0.1 - (time.perf_counter() - started)))
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        _row("baseline (httpx, whole page parsed)", rounds, cpu, wall, endpoints)
    finally:
        server.stop()


def _row(name: str, rounds: int, cpu: float, wall: float, endpoints: int) -> None:
    scrapes = max(1, rounds * endpoints)
    print(
        f"{name:<44} | {rounds / wall:>8.1f} | {cpu / wall * 100:>10.1f} | "
        f"{cpu / wall / endpoints * 1e3:>17.2f} | {cpu / scrapes * 1e6:>9.0f}"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoints", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    await dispatch_latency(args.endpoints, slots=4, releases=2000)
    print(
        f"queue pop + push: {queue_pop_cost(0):.2f} us with no emptied bands, "
        f"{queue_pop_cost(20_000):.2f} us with 20,000 emptied bands below live traffic"
    )
    print(
        f"push + pop, 20,000 queued in one flow: {objective_cost():.0f} ns without objectives, "
        f"{objective_cost(share=0.5):.0f} ns with half of them due by a TTFT objective"
    )
    with tempfile.TemporaryDirectory(prefix="bench-flow-") as tmp:
        await scrape_cost(args.endpoints, args.seconds, Path(tmp))


if __name__ == "__main__":
    if "--serve" in sys.argv:
        serve_static(
            sys.argv[sys.argv.index("--serve") + 1],
            [int(p) for p in sys.argv[sys.argv.index("--serve") + 2 :]],
        )
    else:
        import uvloop

        uvloop.run(main())
