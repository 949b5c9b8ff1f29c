"""Streams that survive their replica: the rules of a resume, and the splice the client sees.

The first token is the commit point: nothing retries after it. With resume on, a stream cut after it
(its replica killed, reset, an error event, an end without `[DONE]`) is continued on another replica:
vLLM (>= 0.10.2) returns the prompt's token ids and each chunk's generated ids under
`return_token_ids`, and a completions request takes token ids as its prompt. So the rest is asked as
prompt = the prompt's ids + the ids already sent, `max_tokens` less what was sent, the same sampling
parameters. Under greedy decoding that is exactly what the first replica would have produced (the
real-vLLM tier checks it: tests/realvllm/test_resume.py); under sampling, a coherent continuation.
A chat request is continued from its chat template's ids through the completions endpoint and
re-emitted as chat chunks. The client sees one stream: the first part's `id`, `created` and
`model`, no token twice, the final usage counting the original prompt and both parts' tokens.

What cannot be continued exactly is never resumed, and `refusal()` says why; every request field's
rule is in picker/streams/resume_fields.py (the resume guide's table). What only the stream shows
(reasoning output, more ids than streams.resume_max_tokens) refuses at the cut (`Splice.refused`).
Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from picker.streams.resume_fields import CHAT, COMPLETIONS, asks_logprobs, continued_fields, flag, stops
from picker.streams.resume_fields import refusal as field_refusal
from picker.streams.resume_text import HeldText, as_chat, encode
from picker.streams.sse import SSEParser

_DONE = b"data: [DONE]\n\n"
_IDS = b'"token_ids":['
_FINISH = b'"finish_reason":'
_REASONING = ("reasoning_content", "reasoning")
COMPLETIONS_DEFAULT_MAX = 16  # vLLM 0.32's max_tokens for a completions request that sets none


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
    straddle_left: int = 0  # characters of this part in which a stop string may end that began before it


@dataclass(slots=True)
class Splice:
    """One resumable stream: what was sent to the client, and how later parts are rewritten into it.

    `feed()` takes the upstream bytes of the current part and returns the bytes for the client
    (whole SSE events only: a partial event waits for its end, so a cut never leaves half an event).

    With stop strings the text is held back here, as vLLM would (picker/streams/resume_text.py).
    """

    chat: bool  # the client's request is a chat completion
    body: dict[str, Any]  # the client's request, as sent (with return_token_ids)
    client_ids: bool  # the client asked for token ids itself: they stay in what it sees
    include_usage: bool  # the client asked for the usage chunk
    held: HeldText | None = None  # with stop strings: the text held back, as vLLM holds it
    plain: bool = True  # no stop strings, logprobs or per-chunk usage: the quick path may serve it
    max_ids: int = 0  # streams.resume_max_tokens: prompt and output ids kept at most (0: no cap)
    prompt_ids: list[int] | None = None
    sent: list[int] = field(default_factory=list)  # generated ids the client has been sent
    generated: int = 0  # how many (kept or not: streams.resume_max_tokens)
    meta: dict[str, Any] | None = None  # the first part's id, object, created, model
    prompt_tokens: int | None = None  # the original request's, from its prompt ids
    finished: str | None = None  # a finish_reason was sent
    ended_here: bool = False  # the splice found the stop string (it straddled a cut): end the part
    usage_sent: bool = False
    role_sent: bool = False  # chat: the one role chunk went out
    done: bool = False  # [DONE] was sent
    error: bool = False  # the current part was cut: the engine's error event, or [DONE] too early
    error_frame: bytes = b""  # the engine's error event (what the client sees if no resume follows)
    resumes: int = 0
    unresumable: str | None = None  # seen in the stream: why it cannot be continued (a refusal reason)
    next_offset: int = 0  # completions' logprobs: the text_offset of the next token (vLLM 0.32's count)
    _parser: SSEParser = field(default_factory=SSEParser)
    _part: Part = field(default_factory=Part)

    def feed(self, chunk: bytes) -> bytes:
        events = self._parser.feed(chunk)
        if len(events) == 1 and not (self.error or self.done or self.ended_here):  # the common chunk
            out = self._event(events[0].data, events[0].event)
            return out if not self.ended_here else out + (self.finish_locally() or b"")
        out = bytearray()
        for event in events:
            if self.error or self.done or self.ended_here:
                continue  # after an error event or the end: the part is over, whatever follows
            out += self._event(event.data, event.event)
            if self.ended_here:  # the splice found the stop string: its usage and [DONE] go now
                out += self.finish_locally() or b""
        return bytes(out)

    def _event(self, data: bytes, name: str) -> bytes:
        if data == b"[DONE]":
            if self.finished is None:
                self.error = True  # [DONE] without a finish_reason: the part was cut
                return b""
            self.done = True
            return _DONE
        if self.plain and self.resumes == 0 and self.meta is not None and not name:
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
        if at < 0 or reason_at < 0 or (self.chat and b'"reasoning' in data):
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
        self._keep(ids)
        if finished is not None:
            self.finished = finished
        if self.client_ids:
            return b"data: " + data + b"\n\n"
        if self.chat:
            return b"data: " + data[: at - 1] + b"}]}\n\n"  # vLLM's chunk without return_token_ids
        return b"data: " + data[:at] + b'"token_ids":null}]}\n\n'

    def _keep(self, ids: list[int]) -> None:
        """Keep the ids sent, up to streams.resume_max_tokens (with the prompt's): past it the
        stream stops keeping them (only their count) and can no longer be continued."""
        self.generated += len(ids)
        if self.unresumable == "too-long":
            return
        self.sent.extend(ids)
        if self.max_ids and self.generated + len(self.prompt_ids or ()) > self.max_ids:
            self.unresumable = "too-long"
            self.sent = []

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
            self._keep(ids)
        if choice.get("finish_reason") is not None:
            self.finished = choice["finish_reason"]
        if part.chat_as_completions:
            choice = as_chat(choice, self.body.get("top_logprobs"))
        if self.chat:
            delta = choice.get("delta") or {}
            if any(delta.get(key) for key in _REASONING):
                self.unresumable = "reasoning-output"  # a reasoning parser's state: not continued
            if "role" in delta:
                if self.role_sent:  # a later part's role chunk: the client had its role
                    if not delta.get("content") and choice.get("finish_reason") is None:
                        return b""
                    delta.pop("role")
                self.role_sent = True
        if self.held is not None:
            self._text(choice)
        elif not self.chat and isinstance(choice.get("logprobs"), dict):
            self._offsets(choice["logprobs"])
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
        if isinstance(usage, dict) and self.resumes:  # continuous_usage_stats: the client's figures
            out["usage"] = self._figures(usage)
        elif "usage" in frame and usage is None and self.chat:
            out.pop("usage", None)
        return encode(out)

    def _text(self, choice: dict[str, Any]) -> None:
        """Stop strings: the client's text as vLLM would send it (picker/streams/resume_text.py),
        a stop string straddling a cut found, taken out of the end where the client did not ask."""
        delta = choice.get("delta") if self.chat else None
        owner: dict[str, Any] = delta if isinstance(delta, dict) else choice
        key = "content" if self.chat else "text"
        new = owner.get(key) or ""
        part, held = self._part, self.held
        assert held is not None
        body_min = self.body.get("min_tokens")
        looks = part.straddle_left > 0 and not (isinstance(body_min, int) and self.generated <= body_min)
        before = len(held.pending)
        out, stop = held.take(new, choice.get("finish_reason"), choice.get("stop_reason"), looks)
        if part.straddle_left > 0:
            part.straddle_left -= len(new)
        if stop is not None:  # it straddled the cut: the stream ends here, as an uncut run's does
            choice["finish_reason"], choice["stop_reason"] = "stop", stop
            self.finished, self.ended_here = "stop", True
        if new or out or before:
            owner[key] = out
        if not self.chat and isinstance(choice.get("logprobs"), dict):
            self._offsets(choice["logprobs"])

    def _offsets(self, logprobs: dict[str, Any]) -> None:
        """Completions' text_offset as an uncut run counts it: vLLM 0.32 advances it by the tokens
        reported (not by the text sent, which lags them under a stop string's hold-back), so a
        continuation's offsets, counted from its own start, go on from the last part's."""
        offsets, tokens = logprobs.get("text_offset"), logprobs.get("tokens")
        if not isinstance(offsets, list) or not offsets or not all(isinstance(o, int) for o in offsets):
            return
        first = offsets[0]
        if first != self.next_offset:
            logprobs["text_offset"] = offsets = [self.next_offset + (o - first) for o in offsets]
        last = tokens[-1] if isinstance(tokens, list) and tokens and isinstance(tokens[-1], str) else ""
        self.next_offset = offsets[-1] + len(last)

    def _figures(self, usage: dict[str, Any]) -> dict[str, Any]:
        prompt = self.prompt_tokens if self.prompt_tokens is not None else usage.get("prompt_tokens", 0)
        completion = self.generated
        total = prompt + completion
        return {**usage, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}

    def _usage(self, frame: dict[str, Any], usage: dict[str, Any]) -> bytes:
        if self.prompt_tokens is None and isinstance(usage.get("prompt_tokens"), int):
            self.prompt_tokens = usage["prompt_tokens"]
        self.usage_sent = True
        if not self.include_usage:
            return b""
        return encode({**frame, **(self.meta or {}), "usage": self._figures(usage)})

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
            completion = self.generated
            usage = {
                "prompt_tokens": prompt,
                "total_tokens": prompt + completion,
                "completion_tokens": completion,
            }
            out += encode({**(self.meta or {}), "choices": [], "usage": usage})
        self.done = True
        return out + _DONE

    def refused(self) -> str | None:
        """Why the rest cannot be asked (None: it can): what the stream showed, or the ids missing."""
        if self.unresumable is not None:
            return self.unresumable
        if self.generated and self.prompt_ids is None:
            return "no-token-ids"
        return None

    def continuation(self) -> tuple[str, dict[str, Any]] | None:
        """The request for the rest of the generation: (path, body); None when it cannot be asked
        (`refused()` says why, or nothing is left to generate)."""
        body = self.body
        # vLLM reads `max_completion_tokens or max_tokens`; unset: 16 (completions), chat's the rest (null)
        key = "max_completion_tokens" if self.chat and body.get("max_completion_tokens") else "max_tokens"
        limit = body.get(key, None if self.chat else COMPLETIONS_DEFAULT_MAX)
        left = None if limit is None else limit - self.generated
        if (left is not None and left <= 0) or self.refused() is not None:
            return None
        if not self.generated:
            return (CHAT if self.chat else COMPLETIONS), dict(body)  # nothing went out: the request as it was
        assert self.prompt_ids is not None
        rest = continued_fields(body, self.chat)
        rest["prompt"] = [*self.prompt_ids, *self.sent]
        rest.pop("max_completion_tokens", None)
        rest["max_tokens"] = left  # None: the rest of the context, as the chat endpoint's default
        if isinstance(body.get("min_tokens"), int):
            rest["min_tokens"] = max(0, body["min_tokens"] - self.generated)
        rest["stream"] = True
        rest["return_token_ids"] = True
        options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        asked = ("include_usage", "continuous_usage_stats")
        wanted = {k: True for k in asked if flag(options.get(k)) is True}
        if wanted:  # else none is asked: the client's usage is not wanted
            rest["stream_options"] = wanted
        else:
            rest.pop("stream_options", None)
        return COMPLETIONS, rest

    def next_part(self, path: str) -> None:
        """A continuation was sent to `path`: what it streams is rewritten into the client's stream."""
        if self.prompt_tokens is None and self.prompt_ids is not None:
            self.prompt_tokens = len(self.prompt_ids)
        self.resumes += 1
        self.error, self.error_frame = False, b""
        self._parser = SSEParser()
        reach = self.held.reach if self.held is not None else 0
        self._part = Part(
            chat_as_completions=self.chat and path == COMPLETIONS,
            seen_prompt=True,
            straddle_left=reach if self.generated else 0,
        )


def refusal(body: dict[str, Any], path: str, mode: ResumeMode, asked: bool | None) -> str | None:
    """Why this request is not resumable (None: it is). `asked`: the request's header (True: on,
    False: off, None: none). The fields' rules: picker/streams/resume_fields.py."""
    if asked is False:
        return "refused-by-request"
    if mode is ResumeMode.OFF and not asked:
        return "off"
    if path not in (COMPLETIONS, CHAT):
        return "not-a-completion"
    return field_refusal(body, path, greedy_only=mode is not ResumeMode.ALWAYS)


def prepare(body: dict[str, Any], chat: bool, max_ids: int = 0) -> tuple[dict[str, Any], Splice]:
    """The request as sent upstream (token ids asked for; with stop strings, nothing held back by
    the engine: the splice holds it) and its splice. `max_ids`: streams.resume_max_tokens."""
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and flag(options.get("include_usage")) is True
    continuous = isinstance(options, dict) and flag(options.get("continuous_usage_stats")) is True
    client_ids = flag(body.get("return_token_ids")) is True
    sent = {**body, "return_token_ids": True}
    found = stops(body)
    if found:
        sent["include_stop_str_in_output"] = True  # the engine holds nothing back: the splice does
    splice = Splice(
        chat=chat,
        body=sent,
        client_ids=client_ids,
        include_usage=include_usage,
        held=HeldText.of(found, flag(body.get("include_stop_str_in_output")) is True) if found else None,
        plain=not (found or continuous or asks_logprobs(body, chat)),
        max_ids=max_ids,
    )
    return sent, splice
