"""What the picker reads of an OpenAI-style inference request, parsed once at admission."""

from __future__ import annotations

import json
from dataclasses import dataclass

from picker.contract import Outcome, Reply, reply_for

_JSON_TYPES = ("application/json",)


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    method: str
    path: str
    model: str = ""
    stream: bool = False
    max_tokens: int | None = None
    prompt_chars: int = 0
    body_bytes: int = 0


def _prompt_chars(body: dict[str, object]) -> int:
    """A cheap size signal for scheduling; no tokenizer in the picker."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) if isinstance(p, str | list) else 1 for p in prompt)
    messages = body.get("messages")
    total = 0
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(str(part)) for part in content)
    return total


def parse_request(
    method: str,
    path: str,
    content_type: str | None,
    body: bytes,
    max_body_bytes: int,
    max_model_bytes: int | None = None,
) -> InferenceRequest | Reply:
    """Parse a request body, or say (as a contract reply) why it cannot be served.

    `max_model_bytes` bounds the model name, which becomes a metric label and a log field.
    """
    if len(body) > max_body_bytes:
        return reply_for(
            Outcome.TOO_LARGE, f"request body is {len(body)} bytes; the limit is {max_body_bytes}"
        )
    if not body:
        if method in ("GET", "HEAD", "DELETE", "OPTIONS"):
            return InferenceRequest(method=method, path=path)
        return reply_for(Outcome.BAD_REQUEST, "request body is empty; expected a JSON object")
    if content_type:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type not in _JSON_TYPES:
            return reply_for(
                Outcome.BAD_REQUEST, f"content-type {media_type!r} is not supported; send application/json"
            )
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return reply_for(Outcome.BAD_REQUEST, "request body is not valid JSON")
    if not isinstance(data, dict):
        return reply_for(Outcome.BAD_REQUEST, "request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        return reply_for(Outcome.BAD_REQUEST, "missing required field 'model'")
    if max_model_bytes is not None and len(model.encode()) > max_model_bytes:
        return reply_for(Outcome.BAD_REQUEST, f"'model' is longer than {max_model_bytes} bytes")
    max_tokens = data.get("max_tokens", data.get("max_completion_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
        return reply_for(Outcome.BAD_REQUEST, "'max_tokens' must be an integer")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        return reply_for(Outcome.BAD_REQUEST, "'stream' must be a boolean")
    return InferenceRequest(
        method=method,
        path=path,
        model=model,
        stream=stream,
        max_tokens=max_tokens,
        prompt_chars=_prompt_chars(data),
        body_bytes=len(body),
    )
