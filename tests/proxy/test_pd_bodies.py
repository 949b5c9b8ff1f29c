"""The proxy's prefill / decode steps as data (picker/proxy/pd_steps.py): the prefill step's body, which
prefill answers a decode can pull with, and a stream's first event telling a failed pull."""

from __future__ import annotations

import json
from typing import Any

import pytest

from picker.proxy.pd_steps import REMOTE_DECODE, failed_first_event, prefill_body, usable_params

NIXL = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "p-engine",
    "remote_request_id": "cmpl-1-0-abcd1234",
    "remote_host": "127.0.0.1",
    "remote_port": 8001,
    "tp_size": 1,
}


def test_the_prefill_step_asks_one_token_not_streamed_for_a_remote_decode() -> None:
    asked = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "min_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body = prefill_body(asked)
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1 and body["stream"] is False
    assert "stream_options" not in body and "min_tokens" not in body
    assert body["kv_transfer_params"] == REMOTE_DECODE and body["messages"] == asked["messages"]
    assert asked["max_tokens"] == 50 and asked["stream"] is True  # the client's request is left as it was
    assert "max_completion_tokens" not in prefill_body({"model": "m", "prompt": "x"})


def test_params_a_decode_can_pull_with_are_kept_whole() -> None:
    assert usable_params(json.dumps({"choices": [], "kv_transfer_params": NIXL}).encode()) == NIXL


@pytest.mark.parametrize(
    "answer",
    [
        b"not json",
        b"[]",
        json.dumps({"choices": []}).encode(),  # no params at all: a prefill that kept nothing
        json.dumps({"kv_transfer_params": {**NIXL, "do_remote_prefill": False}}).encode(),
        json.dumps({"kv_transfer_params": {**NIXL, "remote_port": "8001"}}).encode(),
        json.dumps({"kv_transfer_params": {**NIXL, "remote_port": True}}).encode(),
        json.dumps({"kv_transfer_params": {**NIXL, "remote_port": 70000}}).encode(),
        json.dumps({"kv_transfer_params": {**NIXL, "remote_host": ""}}).encode(),
        json.dumps({"kv_transfer_params": {**NIXL, "remote_engine_id": None}}).encode(),
        json.dumps({"kv_transfer_params": {**NIXL, "remote_block_ids": None}}).encode(),
    ],
)
def test_anything_else_is_a_failed_prefill(answer: bytes) -> None:
    assert usable_params(answer) is None


def test_null_params_send_the_decode_as_it_came() -> None:
    """vLLM's shared-folder ExampleConnector (and LMCache) hand the KV over without params: their
    prefill answers `kv_transfer_params: null`, and the decode finds the KV by itself."""
    assert usable_params(json.dumps({"choices": [], "kv_transfer_params": None}).encode()) == {}


def _event(data: Any) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def test_a_first_error_event_is_a_failed_pull_a_first_token_is_not() -> None:
    error = {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}
    assert failed_first_event(_event(error) + b"data: [DONE]\n\n")
    assert failed_first_event(_event(error).replace(b"\n", b"\r\n"))
    assert failed_first_event(b'data: {"choices": [')  # no whole event before the end
    assert not failed_first_event(_event({"choices": [{"text": "a"}]}))
    assert not failed_first_event(b": keep-alive\n\n")
