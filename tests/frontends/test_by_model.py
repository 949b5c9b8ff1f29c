"""Version-aware routing through each frontend (issue 24, item 1): a mixed pool of three model servers
(one model with a 1,024-token window, the same model with 8,192, another model with a LoRA adapter
and 4,096), 2,000 requests of every kind: none reaches a replica that does not serve its model or
adapter or whose window it overflows (a simulator answers such a request 404 / 400, as vLLM does),
and what no replica could serve gets the contract's refusal from the picker itself."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from loadtest import http_client
from loadtest.procs import Proc, async_wait_until, free_port
from loadtest.stack import Stack, StackOptions, health_ok, sim_argv
from tests.frontends.conftest import FAST, FRONTENDS, start_stack

pytestmark = pytest.mark.envoy

REQUESTS = 2000
CONCURRENCY = 32
SHORT_ALONE, ALONE_WORKERS = 40, 4  # short requests sent alone at the end, so many at a time
SERVERS = {  # name: simulator arguments
    "short": ("--model", "m", "--max-model-len", "1024"),
    "long": ("--model", "m", "--max-model-len", "8192"),
    "other": ("--model", "other", "--lora-modules", "ad", "--max-model-len", "4096"),
}
# (model, prompt chars, max_tokens): where it may go; None: refused with that reason
KINDS = [
    (("m", 400, 16), {"short", "long"}),
    (("m", 12_000, 16), {"long"}),  # ~3,000 tokens: only the 8,192 window holds it
    (("ad", 400, 16), {"other"}),
    (("other", 8_000, 16), {"other"}),
    (("missing", 40, 4), "rejected-model-not-served"),
    (("m", 40_000, 16), "rejected-context-too-long"),  # ~10,000 tokens: no window holds it
]


def servers(workdir: Path) -> tuple[list[Proc], dict[str, str]]:
    procs, where = [], {}
    for name, args in SERVERS.items():
        port = free_port()
        proc = Proc(f"sim-{name}", sim_argv([port], (*FAST, *args)), workdir / f"sim-{name}.log")
        proc.wait_ready(lambda p=port: health_ok(p))
        procs.append(proc)
        where[f"127.0.0.1:{port}"] = name
    return procs, where


def body(model: str, chars: int, max_tokens: int) -> bytes:
    return json.dumps({"model": model, "prompt": "x" * chars, "max_tokens": max_tokens}).encode()


@pytest.mark.parametrize("frontend", FRONTENDS)
async def test_nothing_reaches_a_replica_that_cannot_serve_it(tmp_path: Path, frontend: str) -> None:
    procs, where = servers(tmp_path)
    options = StackOptions(
        replicas=0, picker_endpoints=list(where), picker_args=("--route-by-model",), sim_args=FAST
    )
    stack: Stack | None = None
    try:
        stack = await asyncio.to_thread(start_stack, frontend, tmp_path / frontend, options)
        admin = f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints"

        def all_read() -> bool:
            return all(e["served"] for e in http_client.get(admin, timeout=5).json()["endpoints"])

        await async_wait_until(all_read, 15, 0.05, "the picker to read every /v1/models")
        seen: Counter[tuple[int, str, str]] = Counter()  # (kind index, status, replica or reason)
        queue = list(range(REQUESTS))
        async with http_client.AsyncClient(timeout=30) as client:

            async def worker() -> None:
                while queue:
                    index = queue.pop()
                    kind = index % len(KINDS)
                    (model, chars, max_tokens), _ = KINDS[kind]
                    response = await client.post(
                        f"{stack.url}/v1/completions",  # type: ignore[union-attr]
                        content=body(model, chars, max_tokens),
                        headers={"content-type": "application/json"},
                    )
                    replica = response.headers.get("x-sim-replica")
                    label = where.get(replica or "", "") or response.headers.get(
                        "x-picker-dropped-reason", ""
                    )
                    seen[(kind, str(response.status_code), label)] += 1

            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(CONCURRENCY))), 120)
            # Short requests alone: in the mixed load above the long window is nearly always the
            # busier (only it takes the long prompts), so whether a short one ever went there was
            # chance (2 of 334 in one run, 0 in another). Alone, both windows must take some. Each
            # its own prompt: one prompt shared by all would rightly stay where it is cached.
            alone: Counter[str] = Counter()
            (model, chars, max_tokens), _ = KINDS[0]
            sent = iter(range(SHORT_ALONE))

            async def short_only() -> None:
                for _ in range(SHORT_ALONE // ALONE_WORKERS):
                    prompt = f"question {next(sent)}: " + "x" * chars
                    response = await client.post(
                        f"{stack.url}/v1/completions",  # type: ignore[union-attr]
                        json={"model": model, "prompt": prompt[:chars], "max_tokens": max_tokens},
                        headers={"content-type": "application/json"},
                    )
                    alone[
                        f"{response.status_code} {where.get(response.headers.get('x-sim-replica', ''), '')}"
                    ] += 1

            await asyncio.wait_for(asyncio.gather(*(short_only() for _ in range(ALONE_WORKERS))), 60)
        print(f"{frontend}:", dict(sorted(seen.items())), "short alone:", dict(alone))
        assert sum(seen.values()) == REQUESTS
        for (kind, status, label), _ in seen.items():
            _, allowed = KINDS[kind]
            if isinstance(allowed, str):
                assert (status, label) == ("404" if "model" in allowed else "400", allowed), seen
            else:
                assert status == "200" and label in allowed, seen
        assert set(alone) == {"200 short", "200 long"}, alone  # short requests spread over both windows
    finally:
        if stack is not None:
            await asyncio.to_thread(stack.stop)
        for proc in procs:
            proc.stop()
