"""Every route of a replica except the completion endpoints: vLLM's info routes and the /sim/* admin API.

Admin API (simulator only):
- POST /sim/shutdown   {"timeout": N?, "on_drain_timeout": "hang"|"abort"?, "force": bool?} -> 202;
                       shuts this replica down like SIGTERM (timeout defaults to --shutdown-timeout);
                       409 when already shutting down unless "force" (= the second SIGTERM: stop now).
- GET|POST|DELETE /sim/faults  the server-wide fault: POST {"status": 503, "count": 2} etc. (faults.py)
- GET|DELETE /sim/requests     the request log (GET ?request_id=X filters)
- GET /sim/state               running / waiting / kv usage / in flight / draining, as JSON
- POST /sim/health     {"status": 503} makes GET /health answer that status (200 restores)
- POST /sim/kv/pull    a decode replica's pull of a prefill's KV blocks (sim/vllm_sim/disagg.py):
                       {"remote_engine_id", "remote_request_id", "transfer_ms"} -> 200 after the transfer
                       time, then the blocks are freed; 404 when they are not held here (any more)
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vllm_sim.config import DrainTimeoutAction
from vllm_sim.disagg import MAX_TRANSFER_S, PULL_PATH
from vllm_sim.faults import parse_fault_mapping
from vllm_sim.handlers import STATE_KEY, chat_completions, completions
from vllm_sim.openai_format import ApiError, bad_request, invalid_body, models_body
from vllm_sim.prefix import chat_tokens, completion_tokens

REPLICA_HEADER = "x-sim-replica"


class Controls(Protocol):
    """What the admin API needs from the replica that owns it."""

    def begin_shutdown(
        self, timeout_s: float | None = None, on_drain_timeout: DrainTimeoutAction | None = None
    ) -> bool: ...

    def request_stop(self) -> None: ...


CONTROLS_KEY = web.AppKey("sim_controls", Controls)


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(
        status=status, text=json.dumps(payload, separators=(",", ":")), content_type="application/json"
    )


def _api_error(err: ApiError) -> web.Response:
    return web.Response(status=err.status, body=err.body(), content_type="application/json")


async def _read_json_object(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"JSON decode error: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("expected a JSON object")
    return data


async def health(request: web.Request) -> web.Response:
    return web.Response(status=request.app[STATE_KEY].health_status)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    config = state.config
    body = models_body(
        config.model, config.capacity.max_model_len, int(state.stats.created), config.cache.lora_modules
    )
    return web.Response(body=body, content_type="application/json")


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's `POST /tokenize`: `{"tokens": [...], "count": n, "max_model_len": m}` for a completions
    `prompt` or chat `messages` (with `tools`), as the simulator's tokenizer reads them."""
    state = request.app[STATE_KEY]
    data = await _read_json_object(request)
    if "messages" in data:
        messages = data["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise invalid_body("messages: Input should be a list of messages", "messages")
        tokens = chat_tokens(messages, data.get("tools"))
    elif "prompt" in data:
        tokens = completion_tokens(data["prompt"])
        if not tokens:
            raise invalid_body("prompt: Input should be a string or a list of token ids", "prompt")
    else:
        raise invalid_body("prompt or messages: Field required", "prompt")
    body = {"count": len(tokens), "max_model_len": state.config.capacity.max_model_len, "tokens": tokens}
    return web.json_response(body)


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's `POST /reset_prefix_cache` (VLLM_SERVER_DEV_MODE): every block goes; AllBlocksCleared."""
    request.app[STATE_KEY].engine.clear_prefix_cache()
    return web.Response(status=200)


async def skip_kv_events(request: web.Request) -> web.Response:
    """A fault: lose the next `count` KV-event batches' sequence numbers (a subscriber sees a gap)."""
    data = await _read_json_object(request)
    count = data.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise bad_request("count must be an integer >= 1", "count")
    publisher = request.app[STATE_KEY].engine.publisher
    if publisher is None:
        raise bad_request("this replica publishes no KV events (--kv-events-port)")
    publisher.skip(count)
    return web.json_response({"sequence": publisher.sequence})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE_KEY].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def shutdown(request: web.Request) -> web.Response:
    try:
        data = await _read_json_object(request)
        timeout = data.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
            raise bad_request("timeout must be a number of seconds", "timeout")
        if timeout is not None and timeout < 0:
            raise bad_request("timeout must be >= 0", "timeout")
        action_name = data.get("on_drain_timeout")
        try:
            action = DrainTimeoutAction(action_name) if action_name is not None else None
        except ValueError:
            raise bad_request("on_drain_timeout must be 'hang' or 'abort'", "on_drain_timeout") from None
    except ApiError as err:
        return _api_error(err)
    controls = request.app[CONTROLS_KEY]
    if data.get("force"):
        controls.request_stop()
        return _json({"status": "stopping"}, 202)
    if not controls.begin_shutdown(timeout, action):
        return _api_error(ApiError(409, "already shutting down", "Conflict"))
    return _json({"status": "shutting-down", "timeout": timeout}, 202)


async def get_faults(request: web.Request) -> web.Response:
    return _json(request.app[STATE_KEY].faults.describe())


async def set_faults(request: web.Request) -> web.Response:
    board = request.app[STATE_KEY].faults
    try:
        data = await _read_json_object(request)
        count = data.pop("count", None)
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise bad_request("count must be an integer >= 1", "count")
        try:
            spec = parse_fault_mapping(data)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
    except ApiError as err:
        return _api_error(err)
    board.set(spec, count)
    return _json(board.describe())


async def get_speed(request: web.Request) -> web.Response:
    return _json({"slowdown": request.app[STATE_KEY].engine.slowdown})


async def set_speed(request: web.Request) -> web.Response:
    """POST {"slowdown": F}: from now on every duration on this replica is F times longer (F >= 0.01)."""
    try:
        data = await _read_json_object(request)
        slowdown = data.get("slowdown")
        if isinstance(slowdown, bool) or not isinstance(slowdown, int | float) or not 0.01 <= slowdown <= 100:
            raise bad_request("slowdown must be a number in [0.01, 100]", "slowdown")
    except ApiError as err:
        return _api_error(err)
    request.app[STATE_KEY].engine.slowdown = float(slowdown)
    return _json({"slowdown": float(slowdown)})


async def clear_faults(request: web.Request) -> web.Response:
    board = request.app[STATE_KEY].faults
    board.clear()
    return _json(board.describe())


async def get_requests(request: web.Request) -> web.Response:
    return _json(request.app[STATE_KEY].log.snapshot(request.query.get("request_id")))


async def clear_requests(request: web.Request) -> web.Response:
    request.app[STATE_KEY].log.clear()
    return _json([])


async def get_state(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    engine = state.engine
    return _json(
        {
            "replica": state.address,
            "running": len(engine.running),
            "waiting": len(engine.waiting),
            "tokens_held": engine.tokens_held,
            "kv_usage": engine.kv_usage,
            "in_flight": len(state.active),
            "draining": state.draining,
            "health_status": state.health_status,
            "kv_transfer": state.kv.snapshot(),
        }
    )


async def kv_pull(request: web.Request) -> web.Response:
    """Serve a decode's pull: hold the connection for the transfer time, then free the blocks. The
    blocks are freed too when the pull is cut (the decode went away), as vLLM frees them on its notice."""
    kv = request.app[STATE_KEY].kv
    try:
        data = await _read_json_object(request)
    except ApiError as err:
        return _api_error(err)
    engine_id, request_id = data.get("remote_engine_id"), data.get("remote_request_id")
    transfer_ms = data.get("transfer_ms", 0)
    if not isinstance(engine_id, str) or not isinstance(request_id, str):
        return _api_error(bad_request("remote_engine_id and remote_request_id must be strings"))
    if isinstance(transfer_ms, bool) or not isinstance(transfer_ms, int | float) or transfer_ms < 0:
        return _api_error(bad_request("transfer_ms must be a number >= 0", "transfer_ms"))
    held = kv.take(engine_id, request_id)
    if held is None:
        return _api_error(ApiError(404, f"no KV blocks held for {request_id}", "NotFoundError"))
    try:
        # Deliberate delay, not synchronisation: the transfer keeps the connection busy this long.
        await asyncio.sleep(min(transfer_ms / 1000, MAX_TRANSFER_S))
        kv.pulled += 1
    finally:
        kv.release(request_id)
    return _json({"tokens": held.tokens, "blocks": len(held.block_ids)})


async def set_health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    try:
        data = await _read_json_object(request)
    except ApiError as err:
        return _api_error(err)
    status = data.get("status")
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
        return _api_error(bad_request("status must be an HTTP status between 200 and 599", "status"))
    state.health_status = status
    return _json({"health_status": status})


@web.middleware
async def fastapi_style_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown routes and methods answer like vLLM's FastAPI app, in JSON."""
    try:
        response: web.StreamResponse = await handler(request)
    except web.HTTPNotFound:
        return _json({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return _json({"detail": "Method Not Allowed"}, 405)
    except web.HTTPRequestEntityTooLarge:
        return _api_error(ApiError(413, "Request body too large", "RequestEntityTooLarge"))
    return response


async def _add_replica_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[REPLICA_HEADER] = request.app[STATE_KEY].address


def add_routes(app: web.Application) -> None:
    app.middlewares.append(fastapi_style_errors)
    app.on_response_prepare.append(_add_replica_header)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/sim/kv-events/skip", skip_kv_events)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/sim/shutdown", shutdown)
    app.router.add_get("/sim/faults", get_faults)
    app.router.add_post("/sim/faults", set_faults)
    app.router.add_delete("/sim/faults", clear_faults)
    app.router.add_get("/sim/speed", get_speed)
    app.router.add_post("/sim/speed", set_speed)
    app.router.add_get("/sim/requests", get_requests)
    app.router.add_delete("/sim/requests", clear_requests)
    app.router.add_get("/sim/state", get_state)
    app.router.add_post("/sim/health", set_health)
    app.router.add_post(PULL_PATH, kv_pull)
