"""The decode pod's routing sidecar, as llm-d's (connector nixlv2) does it, inside a decode replica.

In the Envoy ext_proc shape an endpoint picker sends a P/D request to the decode replica and names the
prefill replica in the header `x-prefiller-host-port`; a sidecar in front of the decode's vLLM runs the
prefill step first. With `--pd-sidecar` a simulator replica does that step itself:
1. the header's first host:port (a comma-separated list or several header lines: the first) gets the
   request with `kv_transfer_params: {"do_remote_decode": true, ...}`, `stream: false`, no
   `stream_options`, `max_tokens: 1` and a fresh `x-request-id`;
2. a prefill answer that is not 2xx is passed on as its status with an empty body (502 when the prefill
   replica cannot be reached: Go's reverse proxy);
3. the replica then serves the client's own request with the prefill's `kv_transfer_params` (null when
   the answer has none), as the decode.
Without the header the request is served as it came. A body that is not a JSON object skips the step, so
the replica's own validation answers it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import aiohttp
from aiohttp import web

PREFILLER_HEADER = "x-prefiller-host-port"
PREFILL_CONNECT_TIMEOUT_S = 5.0
PREFILL_TIMEOUT_S = 600.0  # a prefill may wait in its replica's queue
BAD_GATEWAY = 502


def prefiller(values: list[str]) -> str | None:
    """The prefill replica a request names (`values`: every line of the header), or None."""
    if not values:
        return None
    hosts = values[0].split(",") if len(values) == 1 else values
    first = hosts[0].strip()
    return first or None


def _prefill_body(request: dict[str, Any]) -> dict[str, Any]:
    body = dict(request)
    body["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    body["stream"] = False
    body.pop("stream_options", None)
    body["max_tokens"] = 1
    return body


async def prefill_first(body: bytes, host_port: str, path: str) -> bytes | int:
    """Run the prefill step; the decode's body, or the status to answer the client with."""
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return body
    if not isinstance(request, dict):
        return body
    timeout = aiohttp.ClientTimeout(total=PREFILL_TIMEOUT_S, connect=PREFILL_CONNECT_TIMEOUT_S)
    headers = {"x-request-id": str(uuid.uuid4())}
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(f"http://{host_port}{path}", json=_prefill_body(request), headers=headers) as answer,
        ):
            raw = await answer.read()
            status = answer.status
    except (aiohttp.ClientError, TimeoutError, OSError):
        return BAD_GATEWAY
    if not 200 <= status < 300:
        return status
    try:
        params = json.loads(raw).get("kv_transfer_params")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return 400
    return json.dumps({**request, "kv_transfer_params": params}).encode()


async def sidecar_step(request: web.Request) -> bytes | int | None:
    """None when the request names no prefill replica; else the decode's body or the status to answer."""
    target = prefiller(request.headers.getall(PREFILLER_HEADER, []))
    if target is None:
        return None
    return await prefill_first(await request.read(), target, request.path)
