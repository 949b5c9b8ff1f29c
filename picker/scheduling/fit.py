"""Whether an endpoint can serve a request at all: its model (or adapter) and its context window
(scheduling.by_model). Pure functions over the view; the pick only ranks the endpoints that fit."""

from __future__ import annotations

import math
from collections.abc import Iterable

from picker.contract import Outcome
from picker.pool.served import Need, Served

CHARS_PER_TOKEN = 4  # a prompt's size without token ids (the reference picker estimates so too)


def need_of(model: str, prompt_chars: int, max_tokens: int | None, prompt_tokens: int | None = None) -> Need:
    """The request's need: its prompt (token ids when known, else estimated) plus max_tokens."""
    prompt = prompt_tokens if prompt_tokens is not None else math.ceil(prompt_chars / CHARS_PER_TOKEN)
    return Need(model, prompt + (max_tokens or 0))


def fits(served: Served | None, need: Need) -> bool:
    """Whether an endpoint may take the request; one whose /v1/models is not known yet may."""
    if served is None:
        return True
    if need.model and need.model not in served.models:
        return False
    return served.max_model_len is None or need.tokens <= served.max_model_len


def refusal(pool: Iterable[Served | None], need: Need) -> Outcome | None:
    """Why no endpoint of the pool could ever serve the request, or None. Judged on every endpoint,
    draining ones too (a busy or draining pool queues or refuses for that reason, not this one), and
    only once every one's /v1/models is known."""
    served = list(pool)
    if not served or any(s is None for s in served):
        return None
    serving = [s for s in served if s is not None and (not need.model or need.model in s.models)]
    if not serving:
        return Outcome.REJECTED_MODEL_NOT_SERVED
    if not any(s.max_model_len is None or need.tokens <= s.max_model_len for s in serving):
        return Outcome.REJECTED_CONTEXT_TOO_LONG
    return None
