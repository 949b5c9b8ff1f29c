"""vLLM 0.32's sampling fields on the simulator's greedy tokens: stop strings, stop token ids, min_tokens,
logprobs (and prompt_logprobs' validation), per request.

Token model: greedy decoding over a fake distribution that is a function of the context (prompt ids +
ids generated so far; in fact its last 8 tokens, prefix.context_key). `ranked(context)` lists the next
tokens likeliest first with their logprobs: rank 1 is `prefix.next_token(context)` (the token the
simulator always generated), the others further CRC draws, each logprob lower than the one before.
The sampled token is rank 1, unless `min_tokens` masks it: before that many tokens, vLLM's min-tokens
logits processor forbids the stop token ids, and the best allowed token is sampled instead. Logprobs
are the raw ones (vLLM's default `logprobs_mode`), so a masked rank-1 token still shows in the top list.
A token's text is prefix.token_text: " t<id>".

Detokenizer (`Sampler.take`): vLLM's incremental detokenizer, one engine step (one token) at a time.
A stop token id ends the output (`stop_reason` = the id) and its text is left out unless
`include_stop_str_in_output`; a stop string is looked for, once more than `min_tokens` tokens were
generated, in the text that ends in the new token's characters, the one that completes earliest
(then the first listed) wins, and the text is cut before it (after it, with `include_stop_str_in_output`).
While the output is not finished, the last max(len(stop)) - 1 characters are held back (unless
`include_stop_str_in_output`); the finishing chunk sends them, less the stop string.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_sim.prefix import VOCAB_SIZE, context_key, next_token, token_text

MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
MAX_STOP_STRINGS = 4  # VLLM_MAX_STOP_STRINGS default
_TEXT_VOCAB = VOCAB_SIZE - 100
_FIELDS = frozenset(  # the request fields parse_sampling reads (besides stream_options)
    "stop stop_token_ids include_stop_str_in_output min_tokens logprobs top_logprobs prompt_logprobs".split()
)
_TRUE = frozenset(("1", "true", "t", "yes", "y", "on"))
_FALSE = frozenset(("0", "false", "f", "no", "n", "off"))


class SamplingError(ValueError):
    """A 400: from vLLM's request models (`engine` False, type "Bad Request") or its SamplingParams
    checks (`engine` True, type "BadRequestError")."""

    def __init__(self, message: str, param: str | None = None, engine: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.engine = engine


def _invalid_body(message: str, param: str | None = None) -> SamplingError:
    """As vLLM's request models refuse a body (openai_format.invalid_body)."""
    return SamplingError(message, param)


def _bad_request(message: str, param: str | None = None) -> SamplingError:
    """As vLLM's SamplingParams checks refuse a request (openai_format.bad_request)."""
    return SamplingError(message, param, engine=True)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One request's sampling fields (ParsedRequest.sampling is None when all are at their defaults)."""

    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # alternatives per token: completions' `logprobs`, chat's `top_logprobs`
    prompt_logprobs: int | None = None  # streaming: only 0 (vLLM refuses more), which shows nothing
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)

    @property
    def shapes_stream(self) -> bool:
        """Whether a stream's chunks differ from those of a plain request."""
        return bool(self.stop or self.stop_token_ids or self.logprobs is not None or self.continuous_usage)


def _lax_int(value: Any, name: str) -> int:
    """An integer as pydantic reads one in lax mode (a bool, an integral float or a numeric string)."""
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        fraction = "got a number with a fractional part"
        raise _invalid_body(f"{name}: Input should be a valid integer, {fraction}", name)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise _invalid_body(f"{name}: Input should be a valid integer", name)


def _lax_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise _invalid_body(f"{name}: Input should be a valid boolean", name)


def _number(data: dict[str, Any], name: str) -> float | None:
    """vLLM's before-validator of the logprob counts: a number, >= 0 or -1."""
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float):
        raise _invalid_body(f"`{name}` must be an integer.", name)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _invalid_body("stop: Input should be a valid string or a list of strings", "stop")
    if len(value) > MAX_STOP_STRINGS:
        limit = f"at most {MAX_STOP_STRINGS} items after validation, not {len(value)}"
        raise _invalid_body(f"stop: List should have {limit}", "stop")
    return tuple(value)


def _logprobs(chat: bool, data: dict[str, Any]) -> int | None:
    if not chat:
        logprobs = _number(data, "logprobs")
        if logprobs is not None and logprobs < 0 and logprobs != -1:
            raise _invalid_body("`logprobs` must be a positive value or -1.", "logprobs")
        return None if logprobs is None else _lax_int(logprobs, "logprobs")
    top = _number(data, "top_logprobs")
    if top is not None:
        if top < 0 and top != -1:
            raise _invalid_body("`top_logprobs` must be a positive value or -1.", "top_logprobs")
        if (top == -1 or top > 0) and not data.get("logprobs"):
            raise _invalid_body("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    wanted = data.get("logprobs")
    if wanted is None or not _lax_bool(wanted, "logprobs"):
        return None
    return 0 if top is None else _lax_int(top, "top_logprobs")


def parse_sampling(
    chat: bool, data: dict[str, Any], stream: bool, force_usage: bool = False
) -> SamplingParams | None:
    """The request's sampling fields, validated as vLLM's request models do; None when all are at
    their defaults."""
    options = data.get("stream_options") or {}
    if _FIELDS.isdisjoint(data) and "continuous_usage_stats" not in options:
        return None  # the plain request's way: none of them named
    logprobs = _logprobs(chat, data)
    asked = _number(data, "prompt_logprobs")
    prompt_logprobs = None
    if asked is not None:
        if stream and (asked > 0 or asked == -1):
            raise _invalid_body("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if asked < 0 and asked != -1:
            raise _invalid_body("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
        prompt_logprobs = _lax_int(asked, "prompt_logprobs")
        if not stream:  # vLLM would return them in the body: the simulator does not compute them
            raise _bad_request("prompt_logprobs: not supported by the simulator", "prompt_logprobs")
    stop = _stop(data.get("stop"))
    raw_ids = data.get("stop_token_ids")
    if raw_ids is not None and not isinstance(raw_ids, list):
        raise _invalid_body("stop_token_ids: Input should be a valid list", "stop_token_ids")
    stop_ids = tuple(dict.fromkeys(_lax_int(t, "stop_token_ids") for t in raw_ids or ()))
    include = _lax_bool(data.get("include_stop_str_in_output", False), "include_stop_str_in_output")
    min_tokens = _lax_int(data.get("min_tokens", 0), "min_tokens")
    continuous = options.get("continuous_usage_stats")
    continuous = continuous is not None and _lax_bool(continuous, "stream_options.continuous_usage_stats")
    asked_usage = bool(options.get("include_usage")) or force_usage
    params = SamplingParams(
        stop=stop,
        stop_token_ids=stop_ids,
        include_stop_str_in_output=include,
        min_tokens=min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        continuous_usage=continuous and asked_usage and stream,
    )
    return None if params == SamplingParams() else params


def check_sampling(params: SamplingParams, max_tokens: int) -> None:
    """vLLM's SamplingParams checks, made after the model's name was checked."""
    if params.min_tokens < 0:
        raise _bad_request(f"min_tokens must be greater than or equal to 0, got {params.min_tokens}.")
    if params.min_tokens > max_tokens:
        raise _bad_request(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {params.min_tokens}."
        )
    if any(not s for s in params.stop):
        raise _bad_request("stop cannot contain an empty string.")
    wanted = VOCAB_SIZE if params.logprobs == -1 else params.logprobs
    if wanted is not None and wanted > MAX_LOGPROBS:
        raise _bad_request(
            f"Requested sample logprobs of {wanted}, which is greater than max allowed: {MAX_LOGPROBS} "
            f"(parameter=logprobs, value={wanted})",
            "logprobs",
        )
    invalid = [t for t in params.stop_token_ids if not 0 <= t < VOCAB_SIZE]
    if invalid:
        raise _bad_request(
            f"token_id(s) {invalid} in stop_token_ids contain out-of-vocab token ids. Vocabulary size: "
            f"{VOCAB_SIZE} (parameter=stop_token_ids, value={invalid})",
            "stop_token_ids",
        )


def ranked(context: Sequence[int]) -> Iterator[tuple[int, float]]:
    """The next token's candidates for `context`, likeliest first, with their logprobs: rank 1 is
    prefix.next_token(context). Each logprob is lower than the one before, a multiple of 1/4096 (so a
    float32, as vLLM's are, that JSON writes exactly): rank 1's in (-0.25, 0), each next one 1/16 to
    17/16 lower."""
    key = context_key(context)
    ticks = -1 - zlib.crc32(key + b"logprob") % 1023
    first = next_token(context)
    yield first, ticks / 4096
    seen = {first}
    for rank in range(1, 1 << 16):
        draw = zlib.crc32(key + rank.to_bytes(2, "little"))
        ticks -= 256 + (draw >> 16) % 4096
        token = 100 + draw % _TEXT_VOCAB
        if token not in seen:
            seen.add(token)
            yield token, ticks / 4096


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated token's logprob entry: vLLM's dict, the sampled token first, then the top
    `logprobs` tokens by rank (the sampled one not twice)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True)
class Step:
    """What one chunk carries: the tokens of one or more engine steps, merged as vLLM's output
    collector merges the outputs a slow reader has not taken yet."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class Sampler:
    """One request's generation: its context, output text and what of it was sent."""

    __slots__ = ("_context", "_holdback", "_longest", "_sent", "_text", "finished", "generated", "params")

    def __init__(self, params: SamplingParams | None, prompt_ids: Sequence[int]) -> None:
        self.params = params or SamplingParams()
        self._context = list(prompt_ids)
        self._longest = max(map(len, self.params.stop), default=0)
        self._holdback = max(0, self._longest - 1) if not self.params.include_stop_str_in_output else 0
        self._text = ""  # the end of the output text (cut at a stop string): what is unsent or may match
        self._sent = 0  # characters of it already sent
        self.generated = 0
        self.finished = False

    def take(self, count: int, finish_reason: str | None) -> Step:
        """The next `count` tokens, one engine step each; the last ends the output with `finish_reason`
        (the plan's: "length", or "stop" for an EOS) when not None. A stop ends it sooner."""
        step = Step()
        params = self.params
        for index in range(count):
            token = self._sample(step)
            step.ids.append(token)
            self.generated += 1
            if token in params.stop_token_ids:
                step.finish_reason, step.stop_reason = "stop", token
            elif index == count - 1:
                step.finish_reason = finish_reason
            if step.stop_reason is None or params.include_stop_str_in_output:
                piece = token_text(token)
                self._text += piece
                if params.stop and self.generated > params.min_tokens:
                    matched = self._stop_string(len(piece))
                    if matched is not None:
                        step.finish_reason, step.stop_reason = "stop", matched
            if step.finish_reason is not None:
                break
        self.finished = step.finish_reason is not None
        step.text = self._delta()
        drop = min(self._sent, len(self._text) - self._longest)
        if drop > 1024:  # sent, and too far back to be part of a stop string: forgotten
            self._text, self._sent = self._text[drop:], self._sent - drop
        return step

    def flush(self, finish_reason: str) -> Step:
        """A last chunk without a token (an abort): the text held back so far."""
        self.finished = True
        return Step(text=self._delta(), finish_reason=finish_reason)

    def _sample(self, step: Step) -> int:
        params, context = self.params, self._context
        masked = params.stop_token_ids if self.generated < params.min_tokens else ()
        wanted = params.logprobs
        if not masked and wanted is None:
            token = next_token(context)
        else:
            top: list[tuple[int, float]] = []
            sampled: tuple[int, float] | None = None
            for candidate in ranked(context):
                if wanted is not None and len(top) < wanted:
                    top.append(candidate)
                if sampled is None and candidate[0] not in masked:
                    sampled = candidate
                if sampled is not None and (wanted is None or len(top) >= wanted):
                    break
            assert sampled is not None
            token = sampled[0]
            if wanted is not None:
                entries = (sampled, *(t for t in top if t[0] != token))
                step.logprobs.append(TokenLogprobs(token, sampled[1], entries))
        context.append(token)
        if len(context) > 4096:  # the next token depends on the last 8 only
            del context[:-8]
        return token

    def _stop_string(self, new_chars: int) -> str | None:
        """The stop string that ends in the last `new_chars` characters soonest; the text is cut."""
        text = self._text
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self.params.stop:
            start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if start != -1 and (best is None or start + len(stop) < best[0]):
                best = (start + len(stop), start, stop)
        if best is None:
            return None
        end, start, stop = best
        self._text = text[:end] if self.params.include_stop_str_in_output else text[:start]
        return stop

    def _delta(self) -> str:
        end = len(self._text) - (0 if self.finished else self._holdback)
        if end <= self._sent:
            return ""
        delta = self._text[self._sent : end]
        self._sent = end
        return delta
