"""vLLM's OpenAI wire format: request validation, error bodies, SSE frames and non-streaming bodies.

Shapes follow vLLM 0.32: completion chunks are dumped with every field (`exclude_unset=False`, so
`"usage":null` and the token-id fields appear), chat chunks only with the fields vLLM sets, usage chunks
with empty `choices`, compact JSON everywhere except the in-stream error event (vLLM writes that one with
`json.dumps`, i.e. with spaces). Per-token frames are pre-encoded once per request: the hot path writes a
cached `bytes` object and never calls `json.dumps`. A stream that asks `return_token_ids` or a sampling
field that changes its chunks (stop, stop_token_ids, logprobs, continuous usage stats: sampling.py) is
encoded chunk by chunk instead (sampled_stream.py).

Prompt tokens come from the simulator's tokenizer (sim/vllm_sim/prefix.py): a string is ceil(chars / 4)
tokens (at least 1), a token-id list is itself, a chat request is its text parts that way plus 4 tokens
per message and 2 for the assistant turn (ChatML-like overhead), after the JSON of its `tools`.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any

from vllm_sim.config import CapacityConfig
from vllm_sim.prefix import chat_tokens, completion_tokens
from vllm_sim.sampling import SamplingError, SamplingParams, check_sampling, parse_sampling

TOKEN_TEXT = " tok"  # the synthetic text of one generated token
DONE_FRAME = b"data: [DONE]\n\n"

ENGINE_ERROR_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
KV_LOAD_FAILED_MESSAGE = "Internal server error"  # GenerationError: a decode whose KV pull failed
BUSY_MESSAGE = (
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance."
)
DRAIN_MESSAGE = "cannot schedule new futures after shutdown"


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


class ApiError(Exception):
    """A request answered with a vLLM-style JSON error instead of tokens."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> bytes:
        return error_body(self.message, self.err_type, self.status, self.param)


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> bytes:
    payload = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return json.dumps(payload, separators=(",", ":")).encode()


def stream_error_frame(message: str = ENGINE_ERROR_MESSAGE, err_type: str = "InternalServerError") -> bytes:
    payload = {"error": {"message": message, "type": err_type, "param": None, "code": 500}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def bad_request(message: str, param: str | None = None) -> ApiError:
    """A 400 from vLLM's engine-side checks (type "BadRequestError")."""
    return ApiError(400, message, "BadRequestError", param)


def invalid_body(message: str, param: str | None = None) -> ApiError:
    """A 400 from request-model validation in FastAPI (vLLM's type is then "Bad Request")."""
    return ApiError(400, message, "Bad Request", param)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: Endpoint
    model: str  # the served name when the body names none (vLLM accepts a missing model)
    stream: bool
    include_usage: bool
    max_tokens: int
    ignore_eos: bool
    prompt_tokens: int
    token_ids: tuple[int, ...] = ()  # the prompt as the simulator's tokenizer reads it
    cache_salt: str | None = None  # vLLM's per-request prefix-cache isolation key
    lora: str | None = None  # the LoRA adapter the request names as its model
    return_token_ids: bool = False  # vLLM >= 0.10.2: prompt and generated token ids in the response
    sampling: SamplingParams | None = None  # stop, stop_token_ids, min_tokens, logprobs... (None: defaults)
    kv_transfer_params: dict[str, Any] | None = None  # disaggregated serving (sim/vllm_sim/disagg.py)

    @property
    def sampled_stream(self) -> bool:
        """Its chunks depend on its tokens (sim/vllm_sim/sampled_stream.py), not cached frames."""
        return self.return_token_ids or (self.sampling is not None and self.sampling.shapes_stream)


def _checked_salt(data: dict[str, Any]) -> str | None:
    salt = data.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise invalid_body("cache_salt: Input should be a non-empty string", "cache_salt")
    return salt


def parse_request(
    endpoint: Endpoint,
    body: bytes,
    served_model: str,
    default_max_tokens: int,
    adapters: tuple[str, ...] = (),
    force_usage: bool = False,
) -> ParsedRequest:
    """Validate a completion request the way vLLM does (400), then the model name (404): the served
    model, or one of its LoRA `adapters`."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid_body(f"JSON decode error: {exc}") from None
    if not isinstance(data, dict):
        raise invalid_body("Input should be a valid dictionary or object to extract fields from")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid_body("model: Input should be a valid string", "model")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid_body("stream: Input should be a valid boolean", "stream")
    stream_options = data.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise invalid_body("stream_options: Input should be a valid dictionary", "stream_options")
    if stream_options and not stream:
        raise invalid_body("Stream options can only be defined when `stream=True`.", "stream_options")
    include_usage = bool(stream_options and stream_options.get("include_usage")) or (force_usage and stream)
    key = (
        "max_completion_tokens"
        if endpoint is Endpoint.CHAT and "max_completion_tokens" in data
        else "max_tokens"
    )
    max_tokens = data.get(key)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise invalid_body(f"{key}: Input should be a valid integer", key)
    if max_tokens < 1:
        raise bad_request(f"{key} must be at least 1, got {max_tokens}.", key)
    ignore_eos = data.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise invalid_body("ignore_eos: Input should be a valid boolean", "ignore_eos")
    n = data.get("n", 1)
    if n not in (1, None):
        raise bad_request("n: the simulator supports only n=1", "n")
    if endpoint is Endpoint.COMPLETIONS:
        prompt_tokens = _completion_prompt_tokens(data.get("prompt"))
        token_ids = completion_tokens(data.get("prompt"))
    else:
        prompt_tokens = _chat_prompt_tokens(data.get("messages"))
        token_ids = chat_tokens(data["messages"], data.get("tools"))
        prompt_tokens = len(token_ids)
    salt = _checked_salt(data)
    kv_transfer_params = data.get("kv_transfer_params")
    if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
        raise invalid_body("kv_transfer_params: Input should be a valid dictionary", "kv_transfer_params")
    return_token_ids = data.get("return_token_ids", False)
    if return_token_ids is None:
        return_token_ids = False
    if not isinstance(return_token_ids, bool):
        raise invalid_body("return_token_ids: Input should be a valid boolean", "return_token_ids")
    try:
        sampling = parse_sampling(endpoint is Endpoint.CHAT, data, stream, force_usage)
    except SamplingError as exc:
        raise _sampling_error(exc) from None
    if model is not None and model != served_model and model not in adapters:
        names = ", ".join((served_model, *adapters))
        raise ApiError(
            404,
            f"The model `{model}` does not exist. Valid aliases: {names}.",
            "NotFoundError",
            "model",
        )
    lora = model if model is not None and model in adapters else None
    if sampling is not None:
        try:
            check_sampling(sampling, max_tokens)
        except SamplingError as exc:
            raise _sampling_error(exc) from None
    return ParsedRequest(
        endpoint=endpoint,
        model=lora or served_model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        prompt_tokens=prompt_tokens,
        token_ids=tuple(token_ids),
        cache_salt=salt,
        lora=lora,
        return_token_ids=return_token_ids,
        sampling=sampling,
        kv_transfer_params=kv_transfer_params,
    )


def _sampling_error(exc: SamplingError) -> ApiError:
    return (bad_request if exc.engine else invalid_body)(exc.message, exc.param)


def check_length(request: ParsedRequest, capacity: CapacityConfig) -> None:
    """vLLM rejects prompt + max_tokens beyond max_model_len at tokenization time."""
    total = request.prompt_tokens + request.max_tokens
    if total > capacity.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {capacity.max_model_len} tokens. However, you "
            f"requested {total} tokens ({request.prompt_tokens} in the messages, {request.max_tokens} "
            "in the completion). Please reduce the length of the messages or completion.",
            "max_tokens",
        )


def _text_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / 4))


def _completion_prompt_tokens(prompt: Any) -> int:
    if prompt is None or prompt == "" or prompt == []:
        raise invalid_body("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    if isinstance(prompt, list):
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        if len(prompt) != 1:
            raise bad_request("prompt: the simulator supports one prompt per request", "prompt")
        only = prompt[0]
        if isinstance(only, str) and only:
            return _text_tokens(only)
        if isinstance(only, list) and only and all(isinstance(t, int) for t in only):
            return len(only)
    raise invalid_body("prompt: Input should be a string, a list of strings or of token ids", "prompt")


def _chat_prompt_tokens(messages: Any) -> int:
    if messages is None:
        raise invalid_body("messages: Field required", "messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_body("messages: Input should be a non-empty list", "messages")
    total = 2
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid_body("messages: each message needs a string role", "messages")
        content = message.get("content")
        total += 4
        if isinstance(content, str):
            total += _text_tokens(content) if content else 0
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += _text_tokens(part["text"])
        elif content is not None:
            raise invalid_body("messages: content should be a string or a list of parts", "messages")
    return total


class StreamEncoder:
    """Pre-encoded SSE frames for one streaming request."""

    __slots__ = ("_cache", "_final_post", "_final_pre", "_head", "_meta", "_tail", "endpoint")

    def __init__(self, endpoint: Endpoint, response_id: str, created: int, model: str) -> None:
        self.endpoint = endpoint
        obj = "text_completion" if endpoint is Endpoint.COMPLETIONS else "chat.completion.chunk"
        self._meta = f'"id":"{response_id}","object":"{obj}","created":{created},"model":{json.dumps(model)}'
        if endpoint is Endpoint.COMPLETIONS:
            self._head = f'data: {{{self._meta},"choices":[{{"index":0,"text":"'.encode()
            rest = b',"stop_reason":null,"prompt_token_ids":null,"token_ids":null}],"usage":null}\n\n'
            self._tail = b'","logprobs":null,"finish_reason":null' + rest
            self._final_pre = b'","logprobs":null,"finish_reason":"'
            self._final_post = b'"' + rest
        else:
            self._head = f'data: {{{self._meta},"choices":[{{"index":0,"delta":{{"content":"'.encode()
            self._tail = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
            self._final_pre = b'"},"logprobs":null,"finish_reason":"'
            self._final_post = b'","stop_reason":null}]}\n\n'
        self._cache: dict[int, bytes] = {}

    def tokens(self, count: int) -> bytes:
        """A content chunk carrying `count` tokens (cached: the hot path)."""
        frame = self._cache.get(count)
        if frame is None:
            frame = self._head + (TOKEN_TEXT * count).encode() + self._tail
            self._cache[count] = frame
        return frame

    def last(self, count: int, finish_reason: str) -> bytes:
        """The last content chunk: its tokens plus finish_reason (count may be 0, e.g. on abort)."""
        text = (TOKEN_TEXT * count).encode()
        return self._head + text + self._final_pre + finish_reason.encode() + self._final_post

    def role(self) -> bytes:
        """Chat's first chunk, sent with the first token."""
        return (
            f'data: {{{self._meta},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
            '"logprobs":null,"finish_reason":null}]}\n\n'
        ).encode()

    def usage(self, prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> bytes:
        total = prompt_tokens + completion_tokens
        details = "" if cached is None else f',"prompt_tokens_details":{{"cached_tokens":{cached}}}'
        return (
            f'data: {{{self._meta},"choices":[],"usage":{{"prompt_tokens":{prompt_tokens},'
            f'"total_tokens":{total},"completion_tokens":{completion_tokens}{details}}}}}\n\n'
        ).encode()


def completion_body(
    endpoint: Endpoint,
    response_id: str,
    created: int,
    model: str,
    prompt_tokens: int,
    completion_tokens: int,
    finish_reason: str,
    cached: int | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> bytes:
    """A non-streaming response body in vLLM's field order (`cached`: prompt_tokens_details;
    `kv_transfer_params`: a prefill's hand-off to its decode)."""
    text = TOKEN_TEXT * completion_tokens
    usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
    }
    if endpoint is Endpoint.COMPLETIONS:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None}
        extra: dict[str, Any] = {}
    else:
        message = {"role": "assistant", "content": text, "refusal": None, "tool_calls": [], "reasoning": None}
        choice = {"index": 0, "message": message, "logprobs": None}
        extra = {"prompt_logprobs": None, "prompt_token_ids": None}
    choice.update(finish_reason=finish_reason, stop_reason=None, token_ids=None)
    if endpoint is Endpoint.COMPLETIONS:
        choice.update(prompt_logprobs=None, prompt_token_ids=None)
    body = {
        "id": response_id,
        "object": "text_completion" if endpoint is Endpoint.COMPLETIONS else "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
        **extra,
        "kv_transfer_params": kv_transfer_params,
    }
    return json.dumps(body, separators=(",", ":")).encode()


def models_body(model: str, max_model_len: int, created: int, adapters: tuple[str, ...] = ()) -> bytes:
    """The base model's card, then one per LoRA adapter (vLLM: `parent` names the base)."""

    def card(name: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": name,
            "parent": parent,
            "max_model_len": max_model_len,
            "permission": [],
        }

    cards = [card(model, None), *(card(adapter, model) for adapter in adapters)]
    return json.dumps({"object": "list", "data": cards}, separators=(",", ":")).encode()
