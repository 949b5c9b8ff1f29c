"""The text a resumed stream's client sees: stop strings held back as vLLM holds them, and a
completions continuation re-emitted in chat's shape.

vLLM holds back the last characters of a stream with stop strings (the longest less one) while one
could still match, yet sends their tokens' ids; a continuation after those ids would lose that text.
So for a resumable request the engine is asked for `include_stop_str_in_output` (it holds nothing
back) and `HeldText` holds back what vLLM would: the held text is the picker's own when a cut comes,
and a stop string that began before the cut and ends after it (the continuation's engine never sees
its first half) is found here, where an uncut run finds it. Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from picker.streams.resume_fields import top_logprobs


@dataclass(slots=True)
class HeldText:
    """One stream's stop strings and the text held back for them."""

    stops: tuple[str, ...]
    hold: int  # characters held back while a stop string may still match (vLLM's rule)
    include_stop: bool  # the client asked include_stop_str_in_output
    pending: str = ""  # held back, not yet sent
    context: str = ""  # the last characters sent, where a straddling stop string may begin

    @classmethod
    def of(cls, stops: tuple[str, ...], include_stop: bool) -> HeldText:
        return cls(stops, 0 if include_stop else max(len(s) for s in stops) - 1, include_stop)

    @property
    def reach(self) -> int:
        """How far into a new part a stop string that began before it can end."""
        return max(len(s) for s in self.stops) - 1

    def take(self, new: str, finish: Any, stop_reason: Any, straddle: bool) -> tuple[str, str | None]:
        """This chunk's text for the client, and the stop string found straddling a cut (None: none;
        `straddle`: look for one). At the engine's own stop the stop string is taken out of the end
        unless the client asked for it."""
        text = self.pending + new
        found = None
        if straddle and finish != "stop" and new:
            hit = self._straddle(new)
            if hit is not None:
                found, end = hit
                text, finish = text[:end], "stop"
        if finish is not None:
            if (
                finish == "stop"
                and isinstance(stop_reason, str)
                and not self.include_stop
                and text.endswith(stop_reason)
            ):
                text = text[: len(text) - len(stop_reason)]
            out, self.pending = text, ""
        elif self.hold and len(text) > self.hold:
            out, self.pending = text[: -self.hold], text[-self.hold :]
        elif self.hold:
            out, self.pending = "", text
        else:
            out = text
        self.context = (self.context + out)[-max(1, self.reach + 1) :]
        return out, found

    def _straddle(self, new: str) -> tuple[str, int] | None:
        """A stop string that began before this part and ends in `new`: (the stop, where the
        client's text ends, counted in pending + new). vLLM's order: the first of the list."""
        window = self.context + self.pending + new
        base = len(self.context)
        seen = len(window) - len(new)
        for stop in self.stops:
            at = window.find(stop, max(0, seen - len(stop) + 1))
            if at >= 0:
                end = at + len(stop) if self.include_stop else at
                return stop, max(0, end - base)
        return None


def as_chat(choice: dict[str, Any], top: Any) -> dict[str, Any]:
    """A completions choice re-emitted as a chat delta (its logprobs in chat's shape)."""
    out: dict[str, Any] = {"index": choice.get("index", 0), "delta": {"content": choice.get("text", "")}}
    out["logprobs"] = chat_logprobs(choice.get("logprobs"), top_logprobs(top) or 0)
    out["finish_reason"] = choice.get("finish_reason")
    if out["finish_reason"] is not None:
        out["stop_reason"] = choice.get("stop_reason")
    return out


def chat_logprobs(logprobs: Any, top: int) -> dict[str, Any] | None:
    """Completions' logprobs as chat's: one entry per token, its first `top` alternatives (vLLM's
    chat takes the first N of the same ranked list completions keys by token text)."""
    if not isinstance(logprobs, dict):
        return None
    tokens, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
    alternatives = logprobs.get("top_logprobs") or []
    content = []
    for i, token in enumerate(tokens):
        if not isinstance(token, str):
            continue
        ranked = alternatives[i] if i < len(alternatives) and isinstance(alternatives[i], dict) else {}
        content.append(
            {
                "token": token,
                "logprob": values[i] if i < len(values) and values[i] is not None else -9999.0,
                "bytes": list(token.encode("utf-8", errors="replace")),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", errors="replace"))}
                    for t, v in list(ranked.items())[:top]
                ],
            }
        )
    return {"content": content}


def encode(frame: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(frame, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
