"""Streams that survive their replica: the rules of a resume, and the splice the client sees.

The first token is the commit point: nothing retries after it. With resume on, a stream cut after it
(its replica killed, reset, an error event, an end without `[DONE]`) is continued on another replica:
vLLM (>= 0.10.2) returns the prompt's token ids and each chunk's generated ids under
`return_token_ids`, and a completions request takes token ids as its prompt. So the rest is asked as
prompt = the prompt's ids + the ids already sent, `max_tokens` less what was sent, the same sampling
parameters. Under greedy decoding that is exactly what the first replica would have produced
(measured on vLLM 0.32: 4 of 4 cut points); under sampling, a coherent continuation. A chat request
is continued from its chat template's ids through the completions endpoint and re-emitted as chat
chunks. The client sees one stream: the first part's `id`, `created` and `model`, no token twice,
the final usage counting the original prompt and both parts' tokens.

What cannot be continued exactly is never resumed, and `refusal()` says why: `n` > 1, `echo`,
`best_of`, several prompts, presence/frequency penalties (they count generated tokens, which become
prompt tokens), structured output and tool calls (an engine state a prompt cannot restore), and in
`greedy` mode any sampling. Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from picker.streams.sse import SSEParser

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
_DONE = b"data: [DONE]\n\n"
_IDS = b'"token_ids":['
_FINISH = b'"finish_reason":'
_CHAT_ONLY = (
    "messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens", "response_format",
    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "documents", "reasoning_effort", "top_logprobs", "logprobs", "add_special_tokens", "prompt",
)  # fmt: skip
_STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs", "guided_decoding_backend")  # fmt: skip


class ResumeMode(enum.Enum):
    OFF = "off"  # only requests that ask (header `x-picker-resume: on`), under greedy's rules
    GREEDY = "greedy"  # every greedy request that does not refuse (`x-picker-resume: off`)
    ALWAYS = "always"  # every request that does not refuse, sampled ones too (a coherent continuation)


class Why(enum.Enum):
    """Why a stream was resumed (the metric's `reason`)."""

    RESET = "upstream-reset"  # the connection broke in the middle of the body
    SHORT = "upstream-truncated"  # the body ended without [DONE]
    ERROR_EVENT = "upstream-error-event"  # the engine's in-stream error event
    MOVED = "drain-moved"  # its replica is draining and the drain would not wait for it
    STALLED = "stalled"  # its replica stopped sending for longer than streams.stall_after_s


@dataclass(slots=True)
class Part:
    """One replica's share of the stream as it arrives."""

    chat_as_completions: bool = False  # a chat request continued through the completions endpoint
    seen_prompt: bool = False


@dataclass(slots=True)
class Splice:
    """One resumable stream: what was sent to the client, and how later parts are rewritten into it.

    `feed()` takes the upstream bytes of the current part and returns the bytes for the client
    (whole SSE events only: a partial event waits for its end, so a cut never leaves half an event).
    """

    chat: bool  # the client's request is a chat completion
    body: dict[str, Any]  # the client's request, as sent (with return_token_ids)
    client_ids: bool  # the client asked for token ids itself: they stay in what it sees
    include_usage: bool  # the client asked for the usage chunk
    prompt_ids: list[int] | None = None
    sent: list[int] = field(default_factory=list)  # generated ids the client has been sent
    meta: dict[str, Any] | None = None  # the first part's id, object, created, model
    prompt_tokens: int | None = None  # the original request's, from its prompt ids
    finished: str | None = None  # a finish_reason was sent
    usage_sent: bool = False
    done: bool = False  # [DONE] was sent
    error: bool = False  # the current part was cut: the engine's error event, or [DONE] too early
    error_frame: bytes = b""  # the engine's error event (what the client sees if no resume follows)
    resumes: int = 0
    _parser: SSEParser = field(default_factory=SSEParser)
    _part: Part = field(default_factory=Part)

    def feed(self, chunk: bytes) -> bytes:
        events = self._parser.feed(chunk)
        if len(events) == 1 and not (self.error or self.done):  # the common chunk: one event
            return self._event(events[0].data, events[0].event)
        out = bytearray()
        for event in events:
            if self.error or self.done:
                continue  # after an error event: the part is over, whatever follows
            out += self._event(event.data, event.event)
        return bytes(out)

    def _event(self, data: bytes, name: str) -> bytes:
        if data == b"[DONE]":
            if self.finished is None:
                self.error = True  # [DONE] without a finish_reason: the part was cut
                return b""
            self.done = True
            return _DONE
        if self.resumes == 0 and self.meta is not None and not name:
            quick = self._quick(data)
            if quick is not None:
                return quick
        try:
            frame = json.loads(data)
        except ValueError:
            self.error = True
            return b""
        if name == "error" or not isinstance(frame, dict) or "error" in frame:
            self.error = True  # vLLM's in-stream error event: the engine gave up on it
            field_line = f"event: {name}\n".encode() if name else b""
            self.error_frame = field_line + b"data: " + data + b"\n\n" + _DONE
            return b""
        return self._frame(frame)

    def _quick(self, data: bytes) -> bytes | None:
        """The common events of a first part, without a JSON round trip (vLLM's layout): a content
        chunk, its ids the last field of its one choice, and the usage chunk. None: the slow path."""
        if data.endswith(b"]}]}"):
            return self._quick_content(data)
        if b'"choices":[]' in data and b'"usage":{' in data and b'"error"' not in data:
            self.usage_sent = True  # nothing was resumed: its figures are the stream's own
            return b"data: " + data + b"\n\n" if self.include_usage else b""
        return None

    def _quick_content(self, data: bytes) -> bytes | None:
        at = data.rfind(_IDS)
        reason_at = data.find(_FINISH)
        if at < 0 or reason_at < 0:
            return None
        value = data[reason_at + len(_FINISH) : reason_at + len(_FINISH) + 24]
        finished = None
        if not value.startswith(b"null"):
            end = value.find(b'"', 1)
            if not value.startswith(b'"') or end < 0:
                return None
            finished = value[1:end].decode()
        try:
            ids = [int(t) for t in data[at + len(_IDS) : -4].split(b",")]
        except ValueError:
            return None
        self.sent.extend(ids)
        if finished is not None:
            self.finished = finished
        if self.client_ids:
            return b"data: " + data + b"\n\n"
        if self.chat:
            return b"data: " + data[: at - 1] + b"}]}\n\n"  # vLLM's chunk without return_token_ids
        return b"data: " + data[:at] + b'"token_ids":null}]}\n\n'

    def _frame(self, frame: dict[str, Any]) -> bytes:
        part = self._part
        if self.meta is None:
            self.meta = {k: frame.get(k) for k in ("id", "object", "created", "model")}
        top_prompt = frame.pop("prompt_token_ids", None)
        frame.pop("prompt_text", None)
        if isinstance(top_prompt, list) and self.prompt_ids is None:
            self.prompt_ids = top_prompt  # chat: the template's ids, on the role chunk
        usage = frame.get("usage")
        choices = frame.get("choices") or []
        if not choices:
            if usage is None:
                return b""
            return self._usage(frame, usage)
        choice = choices[0]
        ids = choice.pop("token_ids", None)
        prompt = choice.pop("prompt_token_ids", None)
        if isinstance(prompt, list) and self.prompt_ids is None:
            self.prompt_ids = prompt
        if isinstance(ids, list):
            self.sent.extend(ids)
        if choice.get("finish_reason") is not None:
            self.finished = choice["finish_reason"]
        if part.chat_as_completions:
            choice = _as_chat(choice)
        if self.resumes and self.chat and "role" in (choice.get("delta") or {}):
            return b""  # a later chat part's role chunk: the client had its role
        if self.client_ids:
            choice["token_ids"] = ids
            if not part.seen_prompt and not self.chat:
                choice["prompt_token_ids"] = self.prompt_ids
        elif not self.chat:
            choice["prompt_token_ids"] = None
            choice["token_ids"] = None
        part.seen_prompt = True
        out = {**frame, **(self.meta or {}), "choices": [choice]}
        if self.chat:
            out["object"] = "chat.completion.chunk"
            if self.client_ids and self.resumes == 0 and "role" in (choice.get("delta") or {}):
                out["prompt_token_ids"] = self.prompt_ids
        if "usage" in frame and usage is None and self.chat:
            out.pop("usage", None)
        return _encode(out)

    def _usage(self, frame: dict[str, Any], usage: dict[str, Any]) -> bytes:
        if self.prompt_tokens is None and isinstance(usage.get("prompt_tokens"), int):
            self.prompt_tokens = usage["prompt_tokens"]
        self.usage_sent = True
        if not self.include_usage:
            return b""
        prompt = self.prompt_tokens if self.prompt_tokens is not None else usage.get("prompt_tokens", 0)
        completion = len(self.sent)
        fixed = {
            **usage,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        return _encode({**frame, **(self.meta or {}), "usage": fixed})

    # ---- a cut, and the next part

    def needs_more(self) -> bool:
        """The client's stream is not complete yet (something is left to send)."""
        return not self.done

    def finish_locally(self) -> bytes | None:
        """The generation finished (its finish_reason went out) but the usage or [DONE] did not:
        the end is written here, nothing is asked of another replica."""
        if self.finished is None:
            return None
        out = b""
        if self.include_usage and not self.usage_sent:
            prompt = self.prompt_tokens if self.prompt_tokens is not None else len(self.prompt_ids or [])
            completion = len(self.sent)
            usage = {
                "prompt_tokens": prompt,
                "total_tokens": prompt + completion,
                "completion_tokens": completion,
            }
            out += _encode({**(self.meta or {}), "choices": [], "usage": usage})
        self.done = True
        return out + _DONE

    def continuation(self) -> tuple[str, dict[str, Any]] | None:
        """The request for the rest of the generation: (path, body); None when it cannot be asked
        (the prompt's ids never came, or nothing is left to generate)."""
        body = self.body
        limit_key = "max_completion_tokens" if self.chat and "max_completion_tokens" in body else "max_tokens"
        limit = body.get(limit_key)
        left = None if limit is None else limit - len(self.sent)
        if left is not None and left <= 0:
            return None
        if not self.sent:
            return (CHAT if self.chat else COMPLETIONS), dict(body)  # nothing went out: the request as it was
        if self.prompt_ids is None:
            return None
        rest = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
        rest["prompt"] = [*self.prompt_ids, *self.sent]
        rest.pop("max_completion_tokens", None)
        if left is not None:
            rest["max_tokens"] = left
        if isinstance(body.get("min_tokens"), int):
            rest["min_tokens"] = max(0, body["min_tokens"] - len(self.sent))
        rest["stream"] = True
        rest["return_token_ids"] = True
        if self.include_usage:  # else none is asked: the client's usage is not wanted
            rest["stream_options"] = {"include_usage": True}
        else:
            rest.pop("stream_options", None)
        if self.chat and body.get("logprobs") and isinstance(body.get("top_logprobs"), int):
            rest["logprobs"] = body["top_logprobs"]
        return COMPLETIONS, rest

    def next_part(self, path: str) -> None:
        """A continuation was sent to `path`: what it streams is rewritten into the client's stream."""
        if self.prompt_tokens is None and self.prompt_ids is not None:
            self.prompt_tokens = len(self.prompt_ids)
        self.resumes += 1
        self.error, self.error_frame = False, b""
        self._parser = SSEParser()
        self._part = Part(chat_as_completions=self.chat and path == COMPLETIONS, seen_prompt=True)


def _as_chat(choice: dict[str, Any]) -> dict[str, Any]:
    """A completions choice re-emitted as a chat delta."""
    out: dict[str, Any] = {"index": choice.get("index", 0), "delta": {"content": choice.get("text", "")}}
    out["logprobs"] = choice.get("logprobs")
    out["finish_reason"] = choice.get("finish_reason")
    if out["finish_reason"] is not None:
        out["stop_reason"] = choice.get("stop_reason")
    return out


def _encode(frame: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(frame, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def refusal(body: dict[str, Any], path: str, mode: ResumeMode, asked: bool | None) -> str | None:
    """Why this request is not resumable (None: it is). `asked`: the request's header (True: on,
    False: off, None: none)."""
    if asked is False:
        return "refused-by-request"
    if mode is ResumeMode.OFF and not asked:
        return "off"
    if path not in (COMPLETIONS, CHAT):
        return "not-a-completion"
    if body.get("stream") is not True:
        return "not-streaming"
    if body.get("n", 1) not in (1, None) or body.get("best_of") not in (None, 1):
        return "several-choices"
    if body.get("echo"):
        return "echo"
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            if len(prompt) != 1:
                return "several-prompts"
    if any(body.get(key) for key in _STRUCTURED):
        return "structured-output"
    if body.get("tools") and body.get("tool_choice", "auto") != "none":
        return "tool-calls"
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        return "penalties"
    if mode is not ResumeMode.ALWAYS and not greedy(body):
        return "sampling"
    return None


def greedy(body: dict[str, Any]) -> bool:
    """Greedy decoding: temperature 0 (vLLM's default is 1 unless the model's config says otherwise),
    or top_k 1."""
    temperature = body.get("temperature")
    return (isinstance(temperature, int | float) and temperature == 0) or body.get("top_k") == 1


def prepare(body: dict[str, Any], chat: bool) -> tuple[dict[str, Any], Splice]:
    """The request as sent upstream (token ids asked for) and its splice."""
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    client_ids = body.get("return_token_ids") is True
    sent = {**body, "return_token_ids": True}
    return sent, Splice(chat=chat, body=sent, client_ids=client_ids, include_usage=include_usage)
