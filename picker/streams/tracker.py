"""What flowed in one response: chunks, tokens, timing, usage, and how the body itself ended.

Decodes only the JSON it must (the usage chunk, error events, a chunk that carries a
finish_reason); every other token chunk is counted from its bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from picker.streams.sse import SSEParser

_NULL_FINISH = (b'"finish_reason":null', b'"finish_reason": null')
_NORMAL_FINISH = frozenset({"stop", "length", "tool_calls", "function_call", "content_filter"})
_BODY_CAP = 1 << 20  # non-streaming bodies larger than this are not decoded (counted only)
_decode = msgspec.json.Decoder().decode  # a few times json's speed (picker/request/inference.py)


def decode_json(data: bytes) -> Any:
    """An engine's JSON. Python's own json.dumps writes NaN and Infinity, which msgspec refuses: an
    engine that does is read by json instead (rare, off the hot path). ValueError or RecursionError."""
    try:
        return _decode(data)
    except msgspec.DecodeError:
        return json.loads(data)


@dataclass(slots=True)
class ResponseTracker:
    streaming: bool
    first_byte_at: float | None = None
    last_chunk_at: float | None = None
    bytes: int = 0
    events: int = 0
    token_chunks: int = 0
    done: bool = False  # saw data: [DONE]
    finish_reason: str | None = None
    error_event: bool = False
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported
    _parser: SSEParser | None = None
    _body: bytearray | None = None

    def __post_init__(self) -> None:
        if self.streaming:
            self._parser = SSEParser()
        else:
            self._body = bytearray()

    @property
    def usage(self) -> tuple[int | None, int | None]:
        """(prompt, completion) tokens as the server reported them; None where it did not."""
        return self.usage_prompt_tokens, self.usage_completion_tokens

    @property
    def tokens(self) -> int:
        """Usage when the server reported it, else token chunks seen."""
        return self.usage_completion_tokens if self.usage_completion_tokens is not None else self.token_chunks

    @property
    def completed(self) -> bool:
        """The body says the generation finished normally (not aborted, not an error)."""
        if self.error_event or self.finish_reason == "abort":
            return False
        if self.streaming:
            return self.done or self.finish_reason in _NORMAL_FINISH
        return self.finish_reason in _NORMAL_FINISH or self.finish_reason is None

    def feed(self, chunk: bytes, now: float) -> float | None:
        """Take one body chunk; returns the gap since the previous chunk of a stream (for ITL)."""
        if not chunk:
            return None
        gap = None
        if self.first_byte_at is None:
            self.first_byte_at = now
        elif self.last_chunk_at is not None and self.streaming:
            gap = now - self.last_chunk_at
        self.last_chunk_at = now
        self.bytes += len(chunk)
        if self._parser is not None:
            for event in self._parser.feed(chunk):
                self._on_event(event.data)
        elif self._body is not None and len(self._body) + len(chunk) <= _BODY_CAP:
            self._body += chunk
        else:
            self._body = None
        return gap

    def end(self) -> None:
        """The body ended: decode a non-streaming answer once."""
        if self._body is None:
            return
        try:
            data = decode_json(self._body)
        except (ValueError, RecursionError):
            data = None
        self._body = None
        if isinstance(data, dict):
            self._read(data, count_tokens=False)

    def summary(self) -> dict[str, Any]:
        """What a picker that routed the request needs of its stream, seen by another picker, to
        settle it as if it had seen it itself (classify.from_body; picker/peers/books.py)."""
        return {
            "streaming": self.streaming,
            "first": self.first_byte_at is not None,
            "done": self.done,
            "finish": self.finish_reason,
            "error": self.error_event,
            "chunks": self.token_chunks,
            "tokens": self.usage_completion_tokens,
            "prompt": self.usage_prompt_tokens,
            "cached": self.usage_cached_tokens,
        }

    def apply(self, summary: dict[str, Any], now: float) -> None:
        """The routing picker's side of `summary`: this tracker as the other picker saw the stream."""
        if summary.get("first") and self.first_byte_at is None:
            self.first_byte_at = now
        self.done = bool(summary.get("done"))
        finish = summary.get("finish")
        self.finish_reason = finish if isinstance(finish, str) else None
        self.error_event = bool(summary.get("error"))
        chunks = summary.get("chunks")
        self.token_chunks = chunks if isinstance(chunks, int) else self.token_chunks
        for attribute, key in (
            ("usage_completion_tokens", "tokens"),
            ("usage_prompt_tokens", "prompt"),
            ("usage_cached_tokens", "cached"),
        ):
            value = summary.get(key)
            if isinstance(value, int):
                setattr(self, attribute, value)

    def _on_event(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        self.events += 1
        if (_NULL_FINISH[0] in data or _NULL_FINISH[1] in data) and b'"error"' not in data[:16]:
            self.token_chunks += 1  # the common case: an ordinary token chunk
            return
        try:
            event = decode_json(data)
        except (ValueError, RecursionError):
            return
        if isinstance(event, dict):
            self._read(event, count_tokens=True)

    def _read(self, event: dict[str, object], *, count_tokens: bool) -> None:
        if "error" in event:
            self.error_event = True
        choices = event.get("choices")
        if isinstance(choices, list) and choices:
            if count_tokens:
                self.token_chunks += 1
            for choice in choices:
                reason = choice.get("finish_reason") if isinstance(choice, dict) else None
                if isinstance(reason, str):
                    self.finish_reason = reason
        usage = event.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.usage_completion_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.usage_prompt_tokens = usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.usage_cached_tokens = details["cached_tokens"]
