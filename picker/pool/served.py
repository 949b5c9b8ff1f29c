"""What an endpoint's model server serves, as its `GET /v1/models` says: the model names it answers
to (the base model and each LoRA adapter) and its context window (scheduling.by_model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Served:
    models: frozenset[str]
    max_model_len: int | None  # the smallest window among its model cards; None: not published


@dataclass(frozen=True, slots=True)
class Need:
    """What a request needs of an endpoint."""

    model: str
    tokens: int  # prompt + max_tokens


def parse_models(body: Any) -> Served | None:
    """vLLM's answer (`{"data": [{"id", "max_model_len", "parent"}, ...]}`), or None when it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        return None
    names: set[str] = set()
    windows: list[int] = []
    for card in body["data"]:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str) or not card["id"]:
            continue
        names.add(card["id"])
        window = card.get("max_model_len")
        if isinstance(window, int) and not isinstance(window, bool) and window > 0:
            windows.append(window)
    if not names:
        return None
    return Served(frozenset(names), min(windows) if windows else None)
