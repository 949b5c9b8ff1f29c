"""The chunks of a stream whose content depends on its tokens, built one by one (not the cached frames).

A streaming request takes this path when it asks `return_token_ids` or one of the sampling fields that
change its chunks (stop, stop_token_ids, logprobs, stream_options.continuous_usage_stats); its tokens
are the simulator's greedy ids and their text " t<id>" (sim/vllm_sim/sampling.py says how stops and
logprobs act). The chunks keep the plain path's shape (openai_format.StreamEncoder) and fill in what
vLLM 0.32 puts there:

- completions: `text` (less what the detokenizer holds back for a stop string), `logprobs`
  `{"text_offset", "token_logprobs", "tokens", "top_logprobs"}` one entry per token of the chunk
  (text offsets continue from the tokens reported before, as vLLM's do, not from the text sent), each
  top dict the sampled token first then the `logprobs` likeliest (up to N+1 keys);
  `finish_reason`/`stop_reason` on the last chunk; `prompt_token_ids` in the first chunk and
  `token_ids` in each under `return_token_ids`; `usage` (prompt, total, completion tokens so far) in
  each chunk under continuous usage stats.
- chat: `delta.content`, `logprobs` `{"content": [{"token", "logprob", "bytes", "top_logprobs": the
  first top_logprobs of that dict}]}`, `stop_reason` on the last chunk, `token_ids` under
  `return_token_ids` (the prompt's at the top level of the role chunk), and under continuous usage a
  `usage` with `"completion_tokens_details":null` in every chunk, the role chunk (0 tokens) included.
"""

from __future__ import annotations

import json
from typing import Any

from vllm_sim.openai_format import Endpoint, ParsedRequest, StreamEncoder
from vllm_sim.prefix import token_text
from vllm_sim.sampling import Sampler, Step


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class SampledEncoder(StreamEncoder):
    """One request's chunks, from its Sampler's steps."""

    __slots__ = (
        "_chat",
        "_completion_tokens",
        "_first",
        "_offset",
        "_prompt_ids",
        "_prompt_tokens",
        "sampler",
    )

    def __init__(self, parsed: ParsedRequest, response_id: str, created: int) -> None:
        super().__init__(parsed.endpoint, response_id, created, parsed.model)
        self.sampler = Sampler(parsed.sampling, parsed.token_ids)
        self._chat = parsed.endpoint is Endpoint.CHAT
        self._prompt_ids = list(parsed.token_ids) if parsed.return_token_ids else None
        self._prompt_tokens = parsed.prompt_tokens
        self._completion_tokens = 0
        self._offset = 0  # completions' next text_offset: the length of the tokens reported so far
        self._first = True

    def next(self, count: int, finish_reason: str | None) -> tuple[bytes, Step]:
        """The chunk of the next `count` tokens (fewer when a stop ends the output sooner)."""
        step = self.sampler.take(count, finish_reason)
        return self._frame(step), step

    def last(self, count: int, finish_reason: str) -> bytes:
        """As StreamEncoder.last: with no token (an abort), it sends the text held back."""
        step = self.sampler.take(count, finish_reason) if count else self.sampler.flush(finish_reason)
        return self._frame(step)

    def role(self) -> bytes:
        usage = f',"usage":{self._usage(0)}' if self.sampler.params.continuous_usage else ""
        ids = self._prompt_ids
        prompt = "" if ids is None else f',"prompt_token_ids":{_json(ids)},"prompt_text":null'
        return (
            f'data: {{{self._meta},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
            f'"logprobs":null,"finish_reason":null}}]{usage}{prompt}}}\n\n'
        ).encode()

    def _usage(self, completion: int) -> str:
        prompt = self._prompt_tokens
        details = ',"completion_tokens_details":null' if self._chat else ""
        return (
            f'{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
            f'"completion_tokens":{completion}{details}}}'
        )

    def _frame(self, step: Step) -> bytes:
        self._completion_tokens += len(step.ids)
        params = self.sampler.params
        text, finish = _json(step.text), _json(step.finish_reason)
        logprobs = "null" if params.logprobs is None else self._logprobs(step)
        ids = "null" if self._prompt_ids is None else _json(step.ids)
        if not self._chat:
            prompt = _json(self._prompt_ids) if self._first else "null"
            # vLLM 0.32 leaves `usage` out of a completions chunk unless continuous usage is asked
            usage = f',"usage":{self._usage(self._completion_tokens)}' if params.continuous_usage else ""
            body = (
                f'"choices":[{{"index":0,"text":{text},"logprobs":{logprobs},"finish_reason":{finish},'
                f'"stop_reason":{_json(step.stop_reason)},"prompt_token_ids":{prompt},"token_ids":{ids}}}]'
                f"{usage}"
            )
        else:
            stop = "" if step.finish_reason is None else f',"stop_reason":{_json(step.stop_reason)}'
            ids = "" if self._prompt_ids is None else f',"token_ids":{ids}'
            usage = f',"usage":{self._usage(self._completion_tokens)}' if params.continuous_usage else ""
            body = (
                f'"choices":[{{"index":0,"delta":{{"content":{text}}},"logprobs":{logprobs},'
                f'"finish_reason":{finish}{stop}{ids}}}]{usage}'
            )
        self._first = False
        return f"data: {{{self._meta},{body}}}\n\n".encode()

    def _logprobs(self, step: Step) -> str:
        if self._chat:
            shown = self.sampler.params.logprobs or 0
            content = [
                {
                    **_chat_entry(entry.token, entry.logprob),
                    "top_logprobs": [_chat_entry(*top) for top in entry.top[:shown]],
                }
                for entry in step.logprobs
            ]
            return _json({"content": content})
        offsets, tokens = [], []
        for entry in step.logprobs:
            tokens.append(token_text(entry.token))
            offsets.append(self._offset)
            self._offset += len(tokens[-1])
        return _json(
            {
                "text_offset": offsets,
                "token_logprobs": [entry.logprob for entry in step.logprobs],
                "tokens": tokens,
                "top_logprobs": [{token_text(t): lp for t, lp in entry.top} for entry in step.logprobs],
            }
        )


def _chat_entry(token: int, logprob: float) -> dict[str, Any]:
    text = token_text(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
