"""Benchmark: greedy streams resumed across two real vLLM engines that die, freeze or drain (issue 52).

Two real vLLM 0.32 engines (CPU build, tiny model), one per core, behind `picker proxy` with
streams.resume=greedy; the shapes of 160-token greedy streams, their uncut references (from both
engines: they must agree) and the engines: loadtest/realvllm/resume_shapes.py. Rounds of `--streams`
concurrent streams, each behind fresh proxies; once every stream has read 2 content events, the engine
serving most of them is hit. Kill / stop rounds: odd rounds SIGKILL its process group (restarted, then
warmed before the next fault), even rounds SIGSTOP it with stall_after_s=3 (SIGCONT at the round's end).
Cold round: the engine last killed and started again, no fault, stall_after_s=3. Move round: two
`picker proxy` peers (one set of books, one endpoints file), the streams split over them, and
`POST /admin/endpoints/<engine>/drain?move_streams=true` through the first: its answer must count every
unfinished stream of both on that engine, whose own vllm:num_requests_running must read 0 at once.
Per round: streams equal to their reference (text, finish_reasons, usage, logprob entries), cut
(broken, error event, no [DONE], deadline), wrong; chat streams without exactly one role chunk; streams
hit and resumed; the longest silence a resumed client saw; picker_stream_resumes_total by reason. A
failing stream's proxy log lines are printed and the work directory is kept. Bounded: deadlines per
stream, per round and for the run (SIGALRM, `--budget`); every process stopped by PID (engines: their
process group). About 4 minutes on the 2-core box, mostly four vLLM starts.
Run: `python -m loadtest.bench_realvllm_resume` (needs `make real-vllm`); quicker: `--rounds 1 --streams 6`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.proxy_stack import PeeredProxies, ProxyStack
from loadtest.realvllm import launcher
from loadtest.realvllm import resume_shapes as rs
from loadtest.realvllm.resume_shapes import Engine, Gate, Read, by_address, read_stream, shape_of, verdict
from loadtest.stack import StackOptions, parse_metrics

ROUND_DEADLINE_S = 180.0
STALL_AFTER_S = 3.0
IDLE_DEADLINE_S = 10.0  # the move round's wait for the drained engine to run nothing
STEP_S = 150.0  # what a round and an engine restart may take: not started with less budget left
LEGEND = """  split: streams on the hit (cold, drained) engine / the other; hit: unfinished on the hit engine
  when hit; read at hit: content events they had read then; silence: longest gap between two events a
  client read (resumed: the streams the proxy log says it resumed, others: the rest); TTFT: the longest
  first wait; moved: the drain's moved_streams, by proxy moved/hit through it; idle: from the POST
  until the drained engine's vllm:num_requests_running read 0"""


@dataclass
class Round:
    name: str
    fault: str  # kill, stop, none or move
    stall_after_s: float
    logs: list[Path]  # the proxies' logs
    reads: list[Read] = field(default_factory=list)
    victim: str = ""  # the hit engine's address (the cold one, in the cold round)
    hit: list[Read] = field(default_factory=list)  # unfinished on the hit engine when it was hit
    resumed: list[Read] = field(default_factory=list)  # named in the proxy log's resume lines
    resumes: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0
    timed_out: bool = False
    scraped_s: float = 0.0  # from the proxy's start until it had load figures from every engine
    note: str = ""
    pickers: list[str] = field(default_factory=list)  # the move round: each proxy's peer name
    drain: dict[str, Any] = field(default_factory=dict)  # the move round: status, answer, idle_s

    def log_lines(self) -> list[str]:
        return [x for log in self.logs if log.exists() for x in log.read_text(errors="replace").splitlines()]


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A proxy's metrics page (`url`: its metrics port), by (name, labels)."""
    return parse_metrics(http_client.get(f"{url}/metrics", timeout=5).text)


def scraped(url: str) -> set[str]:
    """The engines the proxy has load figures from."""
    running = "picker_endpoint_engine_running"
    return {dict(labels)["endpoint"] for name, labels in samples(url) if name == running}


async def drain_moving(client: httpx.AsyncClient, admin: str, engine: Engine, out: Round) -> None:
    """The move round's fault: the drain with ?move_streams=true, then the engine polled until idle."""
    posted = time.monotonic()
    try:
        url = f"{admin}/admin/endpoints/{engine.address}/drain?move_streams=true"
        response = await client.post(url, timeout=10.0)
        out.drain.update(status=response.status_code, answer_s=round(time.monotonic() - posted, 3))
        answer = response.json()  # the endpoint's description, and what the move adds (every moved_*)
        out.drain.update({k: v for k, v in answer.items() if k.startswith("moved_")} or {"answer": answer})
        out.drain["state"] = (answer.get("endpoint") or {}).get("state")
        trace: list[tuple[float, float]] = out.drain.setdefault("running", [])  # (s, count) as it changed
        while time.monotonic() - posted < IDLE_DEADLINE_S:
            running, read_s = await engine.running(client), round(time.monotonic() - posted, 3)
            trace += [(read_s, running)] if not trace or trace[-1][1] != running else []
            if running == 0:
                out.drain["idle_s"] = read_s
                return
            await asyncio.sleep(0.02)
        out.drain["idle_s"] = f">{IDLE_DEADLINE_S:g} (running {trace[-1][1]})"
    except (httpx.HTTPError, ValueError) as exc:
        out.note = f"drain: {type(exc).__name__}: {exc}"


async def run_streams(urls: list[str], count: int, engines: list[Engine], out: Round, admin: str) -> None:
    """`count` streams (the shapes in turn), split in order over `urls`; the round's fault at the gate."""
    out.reads = [Read(shape_of(i), via=i * len(urls) // count) for i in range(count)]
    drains: list[asyncio.Task[None]] = []

    def hit() -> None:
        serving = Counter(r.served for r in out.reads if not r.ended and r.served)
        if not serving:
            out.note = "not hit: every stream had ended when the last one had read enough"
            return
        out.victim = serving.most_common(1)[0][0]
        out.hit = [r for r in out.reads if r.served == out.victim and not r.ended]
        for read in out.hit:
            read.at_hit = read.events
        engine = by_address(engines, out.victim)
        if out.fault == "move":
            drains.append(asyncio.get_running_loop().create_task(drain_moving(client, admin, engine, out)))
        else:
            engine.signal(signal.SIGKILL if out.fault == "kill" else signal.SIGSTOP)

    gate = Gate(count, hit) if out.fault != "none" else None
    async with http_client.AsyncClient(timeout=rs.STREAM_DEADLINE_S) as client:
        tasks = [asyncio.create_task(read_stream(client, urls[r.via], r, gate)) for r in out.reads]
        try:
            async with asyncio.timeout(ROUND_DEADLINE_S):
                await asyncio.gather(*tasks)
                await asyncio.gather(*drains)
        except TimeoutError:
            out.timed_out = True
        finally:
            for task in (*tasks, *drains):
                task.cancel()
            await asyncio.gather(*tasks, *drains, return_exceptions=True)
            if out.victim and out.fault == "stop":
                by_address(engines, out.victim).signal(signal.SIGCONT)


def play(out: Round, urls: list[str], metrics: list[str], engines: list[Engine], count: int) -> None:
    """One round on started proxies (`metrics`: their metrics URLs, the first one's taking the drain)."""
    started, expected = time.monotonic(), {e.address for e in engines}
    # an engine without load figures yet counts as saturated: every stream would go to the other
    wait_until(lambda: all(scraped(m) >= expected for m in metrics), 60.0, 0.1, "each proxy's first scrapes")
    out.scraped_s, started = time.monotonic() - started, time.monotonic()
    asyncio.run(run_streams(urls, count, engines, out, metrics[0]))
    out.wall_s = time.monotonic() - started
    for url in metrics:
        out.resumes.update({dict(labels).get("reason", "?"): int(value)
                            for (name, labels), value in samples(url).items()
                            if name == "picker_stream_resumes_total" and value})  # fmt: skip


def judged(out: Round) -> Round:
    """The resumed streams (from the proxy logs), a note on hit streams not cut, the round's line."""
    log = "\n".join(out.log_lines())
    out.resumed = [r for r in out.reads if r.request_id and f"request_id={r.request_id} resumed on" in log]
    whole = [r for r in out.hit if r not in out.resumed and verdict(r) == "equal"]
    if whole:  # not cut: the proxy had read them to their end before the fault
        note = f"{len(whole)} hit streams had been sent whole (the client reads behind the engine)"
        out.note = "; ".join(x for x in (out.note, note) if x)
    report_round(out)
    return out


def scenario(name: str, fault: str, stall: float | None, engines: list[Engine], workdir: Path, count: int,
             cold: Engine | None = None) -> Round:  # fmt: skip
    """One round behind a fresh proxy; then the hit engine back: restarted (kill) or healthy (stop).
    `cold`: no fault, and the split counts the streams on that engine first."""
    env = {"PICKER_STREAMS__RESUME": "greedy"}
    env.update({"PICKER_STREAMS__STALL_AFTER_S": str(stall)} if stall is not None else {})
    options = StackOptions(replicas=0, picker_endpoints=[e.address for e in engines], picker_env=env)
    stack = ProxyStack(workdir / name, options)
    out = Round(name, fault, stall or 30.0, [stack.workdir / "picker-proxy.log"])  # 30: the default
    out.victim = cold.address if cold else ""
    stack.start()
    try:
        play(out, [stack.url], [f"http://127.0.0.1:{stack.metrics_port}"], engines, count)
    finally:
        stack.stop()
    if cold is not None:
        out.note = f"the proxy's first scrapes of both engines took {out.scraped_s:.1f} s"
    judged(out)
    for engine in engines:
        engine.cold = False
    victim = by_address(engines, out.victim) if out.victim else None
    if victim is not None and fault == "kill":
        victim.stop()
        victim.start()
    elif victim is not None and fault == "stop":
        wait_until(victim.healthy, 60.0, interval=0.2, what=f"vLLM {victim.index} healthy after SIGCONT")
    return out


def move_scenario(engines: list[Engine], workdir: Path, count: int) -> Round:
    """The move round: the streams split over two peered proxies, the drain POSTed through the first."""
    options = StackOptions(replicas=0, picker_env={"PICKER_STREAMS__RESUME": "greedy"})
    stack = PeeredProxies(workdir / "move", options, [e.address for e in engines])
    out = Round("move", "move", 30.0, [stack.workdir / f"picker-proxy-{i}.log" for i in range(2)])
    out.pickers = [f"127.0.0.1:{port}" for port in stack.peer_ports]
    stack.start()
    try:
        urls = [f"http://127.0.0.1:{port}" for port in stack.proxy_ports]
        play(out, urls, [stack.admin_url(i) for i in range(2)], engines, count)
    finally:
        stack.stop()
    return judged(out)


def moved(r: Round) -> tuple[str, dict[str, Any]]:
    """The move round's table cell and JSON figures (nothing for the others)."""
    if r.fault != "move":
        return "-", {}
    by_picker = r.drain.get("moved_streams_by_picker") or {}
    hit = [sum(read.via == i for read in r.hit) for i in range(len(r.pickers))]
    each = [f"p{i} {by_picker.get(name, '?')}/{hit[i]}" for i, name in enumerate(r.pickers)]
    cell_text = f"{r.drain.get('moved_streams', r.drain.get('status', 'no answer'))} ({', '.join(each)})"
    return cell_text, {"hit_by_proxy": hit, "pickers": r.pickers, **r.drain}


def figures(r: Round) -> dict[str, Any]:
    verdicts, split = Counter(verdict(read) for read in r.reads), Counter(read.served for read in r.reads)
    others, at = [read for read in r.reads if read not in r.resumed], [read.at_hit for read in r.hit]
    moved_cell, drain = moved(r)
    return {
        "name": r.name, "fault": r.fault, "stall_after_s": r.stall_after_s, "streams": len(r.reads),
        "split": f"{split[r.victim]}/{len(r.reads) - split[r.victim]}",
        "hit": len(r.hit), "read_at_hit": f"{min(at)}-{max(at)}" if at else "-", "resumed": len(r.resumed),
        "equal": verdicts["equal"], "cut": verdicts["cut"], "wrong": verdicts["wrong"],
        "roles_not_1": sum(read.roles != 1 for read in r.reads if "chat" in read.shape),
        "max_silence_resumed_s": round(max((read.silence_s for read in r.resumed), default=0), 2),
        "max_silence_others_s": round(max((read.silence_s for read in others), default=0), 2),
        "max_ttft_s": round(max((read.ttft_s for read in r.reads), default=0), 2),
        "resumes": dict(r.resumes), "moved": moved_cell, "idle_s": drain.get("idle_s", "-"),
        "wall_s": round(r.wall_s, 1), "timed_out": r.timed_out, "scraped_s": round(r.scraped_s, 1),
        "note": r.note, **({"drain": drain} if drain else {}),
    }  # fmt: skip


COLUMNS = {"scenario": "name", "fault": "fault", "stall s": "stall_after_s", "streams": "streams",
           "split": "split", "hit": "hit", "read at hit": "read_at_hit", "resumed": "resumed",
           "equal": "equal", "cut": "cut", "wrong": "wrong", "roles!=1": "roles_not_1",
           "silence resumed s": "max_silence_resumed_s", "others s": "max_silence_others_s",
           "TTFT max s": "max_ttft_s", "resumes by reason": "resumes", "moved": "moved",
           "idle s": "idle_s", "wall s": "wall_s"}  # fmt: skip


def cell(value: Any) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in sorted(value.items())) or "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def report_round(r: Round) -> None:
    f = figures(r)
    keys = ("equal", "cut", "wrong", "hit", "resumes") + (("moved", "idle_s") if r.fault == "move" else ())
    print(f"  {r.name}: " + ", ".join(f"{k} {cell(f[k])}" for k in keys))
    if r.fault == "move":
        print(f"    drain: {json.dumps(r.drain)}")
    lines = r.log_lines()
    for read in (read for read in r.reads if verdict(read) != "equal"):
        print(f"    {rs.difference(read)}{' (hit)' if read in r.hit else ''}")
        for line in [x for x in lines if read.request_id and read.request_id in x][:10]:
            print(f"      proxy: {line[:300]}")


def report(rounds: list[Round], wall_s: float, engines: list[Engine]) -> None:
    shapes = ", ".join(rs.SHAPES)
    print(f"\n{rs.TOKENS}-token greedy streams, shapes {shapes}; hit after {rs.FAULT_AFTER} events read")
    rows = [list(COLUMNS)] + [[cell(figures(r)[key]) for key in COLUMNS.values()] for r in rounds]
    widths = [max(len(x) for x in col) for col in zip(*rows, strict=True)]
    for row in rows:
        print(" | ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip())
    print("".join(f"  {r.name}: {r.note}\n" for r in rounds if r.note) + LEGEND)
    starts = [round(s, 1) for e in engines for s in e.starts_s]
    out = {"rounds": [figures(r) for r in rounds], "vllm_starts_s": starts, "wall_s": round(wall_s, 1)}
    print(json.dumps(out), flush=True)


def _out_of_time(signum: int, frame: FrameType | None) -> None:
    raise TimeoutError("bench_realvllm_resume: over its --budget")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="kill / stop rounds (odd: kill, even: stop)")
    parser.add_argument("--streams", type=int, default=12, help="concurrent streams per round")
    parser.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True, help="the cold round")
    parser.add_argument("--move", action=argparse.BooleanOptionalAction, default=True, help="the move round")
    parser.add_argument("--cores", default="0,1", help="VLLM_CPU_OMP_THREADS_BIND of each vLLM")
    parser.add_argument("--budget", type=int, default=840, help="seconds for the whole run, at most")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args()
    if reason := launcher.skip_reason():
        raise SystemExit(f"bench_realvllm_resume: {reason}")
    began = time.monotonic()
    signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(args.budget)
    workdir = Path(tempfile.mkdtemp(prefix="bench-realvllm-resume-"))
    engines = [Engine(i, core, workdir) for i, core in enumerate(args.cores.split(","))]
    rounds: list[Round] = []
    completed = False

    def time_left() -> bool:
        return args.budget - (time.monotonic() - began) > STEP_S

    print(f"bench_realvllm_resume on {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    try:
        for engine in engines:
            engine.start()
        rs.REFS.update(asyncio.run(rs.references(engines)))
        print(f"  references: {len(rs.REFS)} shapes, the engines agree", flush=True)
        for i in range(1, args.rounds + 1):
            if not time_left():
                print(f"  round{i} and after: skipped, out of budget", flush=True)
                break
            for engine in (e for e in engines if e.cold):
                asyncio.run(engine.warm())
            fault = "kill" if i % 2 else "stop"
            stall = STALL_AFTER_S if fault == "stop" else None
            rounds.append(scenario(f"round{i}", fault, stall, engines, workdir, args.streams))
        if args.cold and time_left():
            cold = next((e for e in engines if e.cold), None)
            note = f"vLLM {cold.index} cold: restarted after the last kill round" if cold else ""
            if cold is None:
                cold = engines[0]
                cold.stop()
                cold.start()
                note = f"vLLM {cold.index} killed and started again for this round"
            rounds.append(scenario("cold", "none", STALL_AFTER_S, engines, workdir, args.streams, cold))
            rounds[-1].note = "; ".join(x for x in (note, rounds[-1].note) if x)
            cold.cold = True  # its streams may have stalled away before its first batches ran: warm it
        if args.move and time_left():
            for engine in (e for e in engines if e.cold):
                asyncio.run(engine.warm())
            rounds.append(move_scenario(engines, workdir, args.streams))
        completed = True
    finally:
        signal.alarm(0)
        for engine in engines:
            engine.stop()
        report(rounds, time.monotonic() - began, engines)  # what was measured, also after a failure
        if args.keep or not completed or any(verdict(read) != "equal" for r in rounds for read in r.reads):
            print(f"  work directory kept: {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
