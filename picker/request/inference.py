"""What the picker reads of an OpenAI-style inference request, parsed once at admission.

Besides model, stream and sizes, the prompt's material for prefix affinity: the bytes a cache-aware
pick hashes (completions: the prompt text, or its token ids; chat: the JSON of `tools`, then each
message's role and content text, as the reference picker reads them, no template applied), and the
part of the body an engine's `/tokenize` takes, for precise affinity. Never logged.
"""

from __future__ import annotations

import array
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from picker.contract import Outcome, Reply, reply_for

_JSON_TYPES = ("application/json",)
# Bodies are UTF-8 JSON (RFC 8259), read by msgspec at a few times json's speed (README). It refuses
# what json let through to the engine: NaN and Infinity, numbers out of a double's range, unpaired
# surrogate escapes (json's then failed here with a 500), other encodings. Its DecodeError is a
# ValueError; nesting too deep, a RecursionError, as json's.
_decode_json = msgspec.json.Decoder().decode
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, which json accepted: skipped


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    method: str
    path: str
    model: str = ""
    stream: bool = False
    max_tokens: int | None = None
    prompt_chars: int = 0
    body_bytes: int = 0
    prompt: bytes = field(default=b"", repr=False)  # what prefix affinity hashes (never logged)
    cache_salt: str | None = field(default=None, repr=False)  # vLLM's cache isolation key
    # what an engine's /tokenize takes: {"prompt": ...} or {"messages": ..., "tools": ...}
    tokenize: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)
    # the body's JSON object as parsed (`keep_fields`), for a frontend that rewrites it (resume)
    fields: dict[str, Any] | None = field(default=None, repr=False, compare=False)


def _text(value: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(p["text"] for p in value if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _prompt_material(body: dict[str, Any]) -> tuple[bytes, Mapping[str, Any] | None]:
    """(the bytes prefix affinity hashes, what /tokenize takes) of a completions or chat request."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt.encode(), {"prompt": prompt}
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        try:
            return array.array("I", prompt).tobytes(), {"prompt": prompt}
        except OverflowError:
            return b"", None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return b"", None
    parts: list[str] = []
    tools = body.get("tools")
    if tools:
        parts.append(json.dumps(tools, separators=(",", ":"), sort_keys=True))
    for message in messages:
        if isinstance(message, dict):
            parts.append(str(message.get("role", "")))
            parts.append(_text(message.get("content")))
    tokenize: dict[str, Any] = {"messages": messages}
    if tools:
        tokenize["tools"] = tools
    return "\x1e".join(parts).encode(), tokenize


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
    keep_fields: bool = False,
) -> InferenceRequest | Reply:
    """Parse a request body, or say (as a contract reply) why it cannot be served.

    `max_model_bytes` bounds the model name, which becomes a metric label and a log field.
    `keep_fields`: the result carries the parsed JSON object (for a frontend that rewrites the
    body); else it is let go with the parse, so a long stream does not hold its prompt twice.
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
        data = _decode_json(body[3:] if body.startswith(_BOM) else body)
    except (ValueError, RecursionError):
        return reply_for(Outcome.BAD_REQUEST, "request body is not valid JSON")
    if not isinstance(data, dict):
        return reply_for(Outcome.BAD_REQUEST, "request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        return reply_for(Outcome.BAD_REQUEST, "missing required field 'model'")
    if max_model_bytes is not None and len(model.encode()) > max_model_bytes:
        return reply_for(Outcome.BAD_REQUEST, f"'model' is longer than {max_model_bytes} bytes")
    for key in ("max_tokens", "max_completion_tokens"):  # each: a resume counts down the one it reads
        limit = data.get(key)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            return reply_for(Outcome.BAD_REQUEST, f"'{key}' must be an integer")
    # the limit the engine reads: max_completion_tokens over the older max_tokens, as vLLM does
    max_tokens = data.get("max_completion_tokens") or data.get("max_tokens")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        return reply_for(Outcome.BAD_REQUEST, "'stream' must be a boolean")
    salt = data.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        return reply_for(Outcome.BAD_REQUEST, "'cache_salt' must be a non-empty string")
    prompt, tokenize = _prompt_material(data)
    return InferenceRequest(
        method=method,
        path=path,
        model=model,
        stream=stream,
        max_tokens=max_tokens,
        prompt_chars=_prompt_chars(data),
        body_bytes=len(body),
        prompt=prompt,
        cache_salt=salt,
        tokenize=tokenize,
        fields=data if keep_fields else None,
    )
