# ruff: noqa: E501  (the table reads one field a line)
"""Every field a vLLM 0.32 completions or chat request may carry, and what a resume does with it.

A stream is continued from token ids (picker/streams/resume.py): the prompt's ids plus the ids
already sent, through the completions endpoint. Each request field is either continued exactly,
continued with a difference said here, or the request is not resumed and the reason is the
metric's and the `x-picker-resume-refused` header's. The resume guide's table is generated from
`FIELDS` (`python -m picker.cli.reference_pages`). Pure: no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


class Handling(enum.Enum):
    EXACT = "continued exactly"
    DIFFERS = "continued, with a difference"
    REFUSED = "not resumed"


@dataclass(frozen=True, slots=True)
class Field:
    handling: Handling
    how: str  # what the continuation does with it, or why it is refused
    reason: str = ""  # the refusal's reason (REFUSED only; a metric label)


_E, _D, _R = Handling.EXACT, Handling.DIFFERS, Handling.REFUSED

FIELDS: dict[str, Field] = {
    "model": Field(_E, "the same model (or adapter) serves the rest"),
    "prompt": Field(_E, "becomes the prompt's token ids plus the ids already sent"),
    "messages": Field(_E, "rendered once by the first replica; its template's ids are continued"),
    "max_tokens": Field(_E, "less the tokens already sent"),
    "max_completion_tokens": Field(_E, "less the tokens already sent (as max_tokens)"),
    "min_tokens": Field(_E, "less the tokens already sent"),
    "stream": Field(_E, "a resume needs a stream: a non-streaming request is never resumed"),
    "stream_options": Field(_E, "include_usage and continuous_usage_stats count the client's own prompt and every part's tokens"),
    "stop": Field(_E, "the engine's hold-back is done by the picker (it asks include_stop_str_in_output), so the held text survives a cut; a stop string straddling the cut is found at the same place"),
    "stop_token_ids": Field(_E, "kept; with stop strings too, only when include_stop_str_in_output is true"),
    "include_stop_str_in_output": Field(_E, "kept as the client asked, in what the client sees"),
    "ignore_eos": Field(_E, "kept"),
    "temperature": Field(_E, "kept; under `greedy` only 0 (or top_k 1) is resumed"),
    "top_p": Field(_E, "kept"),
    "top_k": Field(_E, "kept"),
    "min_p": Field(_E, "kept"),
    "repetition_penalty": Field(_E, "kept: it counts prompt and output tokens alike"),
    "logit_bias": Field(_E, "kept (token ids)"),
    "allowed_token_ids": Field(_E, "kept"),
    "logprobs": Field(_E, "one entry per token in the endpoint's shape (completions `logprobs: N`; chat `{content: [...]}`), text_offset going on from the last part's as an uncut run counts it"),
    "top_logprobs": Field(_E, "chat: the continuation asks completions `logprobs: N` and re-emits chat's N entries; N read as the engine reads it (an integer, or a string of digits), else not resumed (`top-logprobs`)"),
    "return_token_ids": Field(_E, "kept in what the client sees when it asked for them"),
    "return_tokens_as_token_ids": Field(_E, "kept"),
    "skip_special_tokens": Field(_E, "kept; with stop strings it must stay true (the picker cannot strip a special token's text)"),
    "spaces_between_special_tokens": Field(_E, "kept"),
    "add_special_tokens": Field(_E, "applied once, to the first part's prompt: its ids are continued"),
    "chat_template": Field(_E, "applied once, by the first replica"),
    "chat_template_kwargs": Field(_E, "applied once, by the first replica"),
    "add_generation_prompt": Field(_E, "applied once, by the first replica"),
    "continue_final_message": Field(_E, "applied once, by the first replica"),
    "documents": Field(_E, "applied once, by the first replica"),
    "reasoning_effort": Field(_E, "applied once, by the first replica's template"),
    "user": Field(_E, "kept"),
    "priority": Field(_E, "kept"),
    "cache_salt": Field(_E, "kept: the continuation shares the first part's cache isolation"),
    "request_id": Field(_E, "kept"),
    "vllm_xargs": Field(_E, "kept"),
    "seed": Field(_D, "kept; only `always` resumes sampled streams, whose rest is a coherent continuation, not the same draws"),
    "bad_words": Field(_D, "kept; a bad word whose tokens would straddle the cut is not blocked (the engine checks generated tokens only)"),
    "n": Field(_R, "several choices cannot be spliced into one", "several-choices"),
    "best_of": Field(_R, "several candidates cannot be spliced into one", "several-choices"),
    "use_beam_search": Field(_R, "a beam is engine state a prompt cannot restore", "beam-search"),
    "echo": Field(_R, "the prompt's text would be echoed again", "echo"),
    "suffix": Field(_R, "not continued from ids", "suffix"),
    "prompt_embeds": Field(_R, "embeddings are not token ids", "prompt-embeds"),
    "prompt_logprobs": Field(_R, "the continuation's prompt holds generated tokens: its prompt logprobs would differ", "prompt-logprobs"),
    "presence_penalty": Field(_R, "counts generated tokens, which become prompt tokens", "penalties"),
    "frequency_penalty": Field(_R, "counts generated tokens, which become prompt tokens", "penalties"),
    "truncate_prompt_tokens": Field(_R, "would truncate the generated tokens too", "truncate-prompt"),
    "response_format": Field(_R, "structured output is engine state a prompt cannot restore", "structured-output"),
    "structured_outputs": Field(_R, "structured output is engine state a prompt cannot restore", "structured-output"),
    "guided_json": Field(_R, "structured output", "structured-output"),
    "guided_regex": Field(_R, "structured output", "structured-output"),
    "guided_choice": Field(_R, "structured output", "structured-output"),
    "guided_grammar": Field(_R, "structured output", "structured-output"),
    "guided_decoding_backend": Field(_E, "names the backend of a constraint set elsewhere: kept"),
    "tools": Field(_R, "a tool call's parser state cannot be restored (continued when tool_choice is none)", "tool-calls"),
    "tool_choice": Field(_E, "none: continued as text"),
    "parallel_tool_calls": Field(_E, "only meaningful with tools"),
    "kv_transfer_params": Field(_R, "disaggregated prefill state is per request", "kv-transfer"),
    "mm_processor_kwargs": Field(_R, "multimodal input is not continued from ids", "multimodal"),
}  # fmt: skip

# what a stream shows only once it runs, and the limits of the picker itself
STREAM_RULES: dict[str, Field] = {
    "reasoning output": Field(_R, "a reasoning parser's state cannot be restored: a chat stream that carried reasoning is cut as without resume", "reasoning-output"),
    "multimodal messages": Field(_R, "an image or audio part's placeholders are not its content", "multimodal"),
    "streams.resume_max_tokens": Field(_R, "a stream whose prompt and output ids pass the cap stops keeping them", "too-long"),
    "sampling (mode greedy)": Field(_R, "a sampled stream's rest would differ; `always` resumes it as a coherent continuation", "sampling"),
}  # fmt: skip

_STRUCTURED = [name for name, f in FIELDS.items() if f.reason == "structured-output"]
_CHAT_ONLY = (
    "messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens", "response_format",
    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "documents", "reasoning_effort", "top_logprobs", "logprobs", "add_special_tokens", "prompt",
)  # fmt: skip


def stops(body: dict[str, Any]) -> tuple[str, ...]:
    """The request's stop strings (a string or a list of them; empty ones ignored, as vLLM does)."""
    stop = body.get("stop")
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list):
        return tuple(s for s in stop if isinstance(s, str) and s)
    return ()


_TRUE = frozenset({"true", "1", "yes", "on", "t", "y"})
_FALSE = frozenset({"false", "0", "no", "off", "f", "n"})


def flag(value: Any) -> bool | None:
    """A boolean field as the engine reads it (vLLM's request models are lax pydantic): 0 and 1,
    and strings such as "true" or "off", are booleans there, so `is True` or truthiness would
    misread them. None: unset, or no boolean (the engine refuses the request)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.lower()
        return True if lowered in _TRUE else False if lowered in _FALSE else None
    return None


def top_logprobs(value: Any) -> int | None:
    """Chat's `top_logprobs` as the engine reads it (lax pydantic): an integer, a whole float or a
    string of digits; unset, 0. None: no count the picker reads as the engine would (not resumed)."""
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


def asks_logprobs(body: dict[str, Any], chat: bool) -> bool:
    """The engine sends logprobs: chat's `logprobs` is a boolean, completions' a count (0 asks for
    the chosen token's alone, and false is read as 0)."""
    value = body.get("logprobs")
    return value is not None and (not chat or flag(value) is not False)


def refusal(body: dict[str, Any], path: str, greedy_only: bool) -> str | None:
    """Why this request's fields cannot be continued (None: they can). `greedy_only`: mode greedy."""
    if body.get("stream") is not True:
        return "not-streaming"
    if body.get("n", 1) not in (1, None) or body.get("best_of") not in (None, 1):
        return "several-choices"
    for name in ("use_beam_search", "echo"):
        if body.get(name) is not None and flag(body.get(name)) is not False:
            return FIELDS[name].reason
    for name in ("suffix", "prompt_embeds", "truncate_prompt_tokens"):
        if body.get(name):
            return FIELDS[name].reason
    if body.get("prompt_logprobs") is not None:
        return "prompt-logprobs"
    if path == CHAT and top_logprobs(body.get("top_logprobs")) is None:
        return "top-logprobs"
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            if len(prompt) != 1:
                return "several-prompts"
    if any(_structured(key, body.get(key)) for key in _STRUCTURED):
        return "structured-output"
    if body.get("tools") and body.get("tool_choice", "auto") != "none":
        return "tool-calls"
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        return "penalties"
    if body.get("kv_transfer_params"):
        return "kv-transfer"
    if body.get("mm_processor_kwargs") or (path == CHAT and _multimodal(body.get("messages"))):
        return "multimodal"
    if stops(body) and flag(body.get("include_stop_str_in_output")) is not True:
        if body.get("stop_token_ids") or flag(body.get("skip_special_tokens")) is False:
            return "stop-strings-with-stop-tokens"  # a stop token's text the picker could not strip
    if greedy_only and not greedy(body):
        return "sampling"
    return None


def _structured(key: str, value: Any) -> bool:
    """A structured-output constraint is set (an empty JSON schema is one: any JSON value)."""
    if value is None or value is False:
        return False
    if key == "response_format":
        return not (isinstance(value, dict) and value.get("type") == "text")
    return key != "guided_decoding_backend"  # only the backend for a constraint set elsewhere


def _multimodal(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type", "text") != "text":
                    return True
    return False


def greedy(body: dict[str, Any]) -> bool:
    """Greedy decoding: temperature 0 (vLLM's default is 1 unless the model's config says otherwise),
    or top_k 1."""
    temperature = body.get("temperature")
    return (isinstance(temperature, int | float) and temperature == 0) or body.get("top_k") == 1


def continued_fields(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The client's fields a completions continuation keeps (the prompt and limits are the caller's)."""
    if chat:
        rest = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
        if flag(body.get("logprobs")) is True:  # chat's logprobs, asked of the completions endpoint
            rest["logprobs"] = top_logprobs(body.get("top_logprobs")) or 0
        return rest
    return {k: v for k, v in body.items() if k != "prompt"}


def table() -> str:
    """The resume guide's table (Markdown), from `FIELDS` and `STREAM_RULES`."""
    rows = ["| field | what a resume does | why | refusal reason |", "|---|---|---|---|"]
    for name, f in [*FIELDS.items(), *STREAM_RULES.items()]:
        label = f"`{name}`" if " " not in name else name
        rows.append(f"| {label} | {f.handling.value} | {f.how} | {f.reason and f'`{f.reason}`'} |")
    return "\n".join(rows) + "\n"
