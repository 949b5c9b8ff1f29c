"""A P/D hand-off driven the way vLLM's own proxy example (toy_proxy_server.py) drives it: the shared
steps of the simulator's disaggregation tests and of the real-vLLM pair check."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import httpx

# What vLLM's toy proxy sends a prefill (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py).
PROXY_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# The fields vLLM's NixlConnector (pull mode) returns from a prefill, in its order (request_finished).
NIXL_PRODUCER_FIELDS = (
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
)
# ...and what a prefill's response carries: its scheduler adds the prefill's own cache hits.
NIXL_RESPONSE_FIELDS = (*NIXL_PRODUCER_FIELDS, "remote_prefill_cached_tokens")

PROMPT = "The quick brown fox jumps over the lazy dog. " * 20


def prefill_body(model: str, prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    """The proxy's prefill request: one token, no stream, kv_transfer_params asking a remote decode."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": dict(PROXY_PREFILL_PARAMS),
        **extra,
    }


def decode_body(
    model: str, params: dict[str, Any] | None, max_tokens: int, prompt: str = PROMPT
) -> dict[str, Any]:
    """The proxy's decode request: the client's request plus the prefill's kv_transfer_params."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": False}
    if params:
        body["kv_transfer_params"] = copy.deepcopy(params)
    return body


@dataclass
class Handoff:
    prefill: httpx.Response
    decode: httpx.Response

    @property
    def params(self) -> dict[str, Any] | None:
        params: dict[str, Any] | None = self.prefill.json().get("kv_transfer_params")
        return params


async def handoff(
    http: httpx.AsyncClient, prefill_url: str, decode_url: str, model: str, max_tokens: int = 8
) -> Handoff:
    """Prefill on one replica, then decode on the other with what the prefill returned."""
    first = await http.post(f"{prefill_url}/v1/completions", json=prefill_body(model))
    assert first.status_code == 200, first.text
    params = first.json().get("kv_transfer_params")
    second = await http.post(f"{decode_url}/v1/completions", json=decode_body(model, params, max_tokens))
    return Handoff(first, second)


def check_prefill_shape(body: dict[str, Any], prompt_tokens: int | None = None) -> None:
    """What a prefill answers, connector aside: one token, finish_reason length, usage, the field."""
    assert body["object"] == "text_completion"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 1
    if prompt_tokens is not None:
        assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert "kv_transfer_params" in body


def check_decode_shape(body: dict[str, Any], max_tokens: int) -> None:
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == max_tokens
    assert "kv_transfer_params" in body and body["kv_transfer_params"] is None
