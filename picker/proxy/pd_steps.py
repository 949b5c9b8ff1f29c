"""`picker proxy`'s own prefill / decode steps (`proxy.pd_steps: proxy`), as vLLM's P/D proxy examples
and vllm-router drive a NixlConnector pair (pull mode).

When the core names a prefill replica for a request (`record.prefill_on`):
1. the prefill step: the request's body with `max_tokens: 1` (and `max_completion_tokens: 1` when it
   has one), `stream: false`, no `stream_options`, and `kv_transfer_params` asking for a remote decode,
   sent to the prefill replica under a request id of its own; its answer is read whole (bounded in
   bytes and time) and its `kv_transfer_params` validated;
2. the decode: the request as it came plus those params, one attempt on the destination. A stream's
   first event is read before anything reaches the client: vLLM reports a failed pull (its default
   `kv_load_failure_policy`, fail) as a 500, or as the first event of a stream it already started.
Any failure up to there gives the hand-off up: the prefill replica's lease ends, the recompute is
counted by why, and the caller sends the request as it came, without params, along the ordinary path
(the decode replica computes the prompt): a pair never fails a request a pool without pairs would
serve, and nothing is sent twice once a byte reached the client. The prefill step's own token is never
the client's: the commit point and the first token are the decode's.

A client that leaves during the prefill step cancels it (its connection closes, so the engine aborts
it) and no decode is sent. Continuations of a resumed stream (resuming.py) are built from the
client's request, so they carry no params and take no prefill step.
"""

from __future__ import annotations

import enum
import json
import logging
import uuid
from typing import Any

from picker.contract import headers as names
from picker.pool import DrainEnd
from picker.proxy import translate
from picker.proxy.upstream import UPSTREAM_READ_ERRORS, Opened, Upstream, UpstreamUnavailable
from picker.request.pipeline import RequestPath
from picker.streams import RequestRecord

log = logging.getLogger(__name__)

PREFILL_MAX_BYTES = 4 * 1024 * 1024  # a one-token answer and its params (a block id per 16 prompt tokens)
_FIRST_EVENT_MAX_BYTES = 64 * 1024  # a stream's first event, read before the client sees any byte
_BOM = b"\xef\xbb\xbf"
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")
# the step's own id and body type; a plain (not compressed) JSON answer
_NOT_FORWARDED = frozenset({names.REQUEST_ID, names.CONTENT_TYPE, "accept-encoding"})
# What vLLM's proxies ask of the prefill: hold the prompt's KV for a decode elsewhere.
REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class Recompute(enum.Enum):
    """Why a pair's decode replica computes the prompt itself (closed set; the metric's `why`)."""

    PREFILL_UNREACHABLE = "prefill-unreachable"  # refused, reset, closed before its answer
    PREFILL_STATUS = "prefill-status"  # answered, not 2xx
    PREFILL_TIMEOUT = "prefill-timeout"  # no whole answer within proxy.pd_prefill_timeout_s
    PREFILL_BAD_PARAMS = "prefill-bad-params"  # no usable kv_transfer_params in its answer
    PULL_FAILED = "pull-failed"  # the decode failed before its first token (a 5xx, an error event)


def prefill_body(request: dict[str, Any]) -> dict[str, Any]:
    """The prefill step's body: one token, not streamed, its KV kept for a remote decode."""
    body = {**request, "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body.pop("stream_options", None)
    body.pop("min_tokens", None)  # above max_tokens vLLM refuses the request
    return body


def usable_params(answer: bytes) -> dict[str, Any] | None:
    """The prefill answer's `kv_transfer_params` when a decode can pull with them (NixlConnector's
    fields, typed); {} when the answer says `null` (a connector that hands the KV over without
    params, as vLLM's shared-folder ExampleConnector or LMCache do: the decode goes as it came);
    None for anything else."""
    try:
        data = json.loads(answer)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if isinstance(data, dict) and "kv_transfer_params" in data and data["kv_transfer_params"] is None:
        return {}
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    port, blocks = params.get("remote_port"), params.get("remote_block_ids")
    texts = (params.get(k) for k in ("remote_engine_id", "remote_request_id", "remote_host"))
    if not all(isinstance(t, str) and t for t in texts):
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return None
    if not isinstance(blocks, list):
        return None
    return params


def failed_first_event(head: bytes) -> bool:
    """Whether a stream's first event is an error (a failed pull), or no whole event came."""
    end = min((i for i in (head.find(e) for e in _EVENT_ENDS) if i >= 0), default=-1)
    if end < 0:
        return True
    for line in head[:end].replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n"):
        if line.startswith(b"data:"):
            try:
                data = json.loads(line[5:])
            except (UnicodeDecodeError, json.JSONDecodeError):
                return False  # not an error object: the client's to read
            return isinstance(data, dict) and "error" in data
    return False


class PdSteps:
    """The two steps of one paired request, over the proxy's upstream client."""

    def __init__(self, upstream: Upstream, path: RequestPath, prefill_timeout_s: float) -> None:
        self._upstream = upstream
        self._path = path
        self._timeout_s = prefill_timeout_s

    async def open(
        self,
        record: RequestRecord,
        destination: str,
        target: str,
        outgoing: list[tuple[str, str]],
        body: bytes,
    ) -> Opened | None:
        """The decode's response, opened with the prefill's params and worth streaming (the first
        event of a stream read into `head`); None: the hand-off was given up, counted, and the
        request is to be sent as it came."""
        prefill_on = record.prefill_on
        assert prefill_on is not None
        try:
            request = json.loads(body[3:] if body.startswith(_BOM) else body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            request = None
        if not isinstance(request, dict):  # parse_request admits JSON objects only: not reached
            self._path.recomputed(record, None, DrainEnd.UNKNOWN)
            return None
        params = await self._prefill(record, prefill_on, target, outgoing, request)
        if params is None:
            return None
        decode = (
            json.dumps({**request, "kv_transfer_params": params}, separators=(",", ":")).encode()
            if params
            else body  # the connector needs no params: the decode goes as it came
        )
        try:
            opened = await self._upstream.open([destination], "POST", target, outgoing, decode)
        except UpstreamUnavailable as exc:
            log.info("request_id=%s decode with params failed: %s", record.request_id, exc)
            self._path.recomputed(record, Recompute.PULL_FAILED.value, DrainEnd.PULL_ABANDONED)
            return None
        try:
            failed = opened.response.status >= 500 or not await self._first_event_ok(opened)
        except BaseException:  # the client left while the first event was awaited
            opened.response.close()
            raise
        if failed:
            log.info("request_id=%s decode failed its pull on %s", record.request_id, opened.served)
            opened.response.close()  # vLLM aborts whatever it still had of it
            self._path.recomputed(record, Recompute.PULL_FAILED.value, DrainEnd.PULL_ABANDONED)
            return None
        return opened

    async def _prefill(
        self,
        record: RequestRecord,
        prefill_on: str,
        target: str,
        outgoing: list[tuple[str, str]],
        request: dict[str, Any],
    ) -> dict[str, Any] | None:
        """Run the prefill step; its params, or None once the hand-off is given up."""
        sent = [(k, v) for k, v in outgoing if k.lower() not in _NOT_FORWARDED]
        sent.append((names.REQUEST_ID, uuid.uuid4().hex))
        sent.append((names.CONTENT_TYPE, "application/json"))
        body = json.dumps(prefill_body(request), separators=(",", ":")).encode()
        why: Recompute | None = None
        try:
            status, answer = await self._upstream.call(
                prefill_on, target, sent, body, PREFILL_MAX_BYTES, self._timeout_s
            )
        except UpstreamUnavailable:
            why = Recompute.PREFILL_UNREACHABLE
        except TimeoutError:
            why = Recompute.PREFILL_TIMEOUT
        else:
            if not 200 <= status < 300:
                why = Recompute.PREFILL_STATUS
            elif answer is None or (params := usable_params(answer)) is None:
                why = Recompute.PREFILL_BAD_PARAMS
            else:
                return params
        log.info("request_id=%s prefill step on %s failed (%s)", record.request_id, prefill_on, why.value)
        self._path.recomputed(record, why.value, DrainEnd.UPSTREAM_ERROR)
        return None

    async def _first_event_ok(self, opened: Opened) -> bool:
        """A streamed decode's first event read into `opened.head`: False when it is an error event,
        or the stream broke off or ended before it."""
        if not translate.is_event_stream(opened.response.headers):
            return True
        head = bytearray()
        reader = opened.response.content
        try:
            while not any(e in head for e in _EVENT_ENDS) and len(head) < _FIRST_EVENT_MAX_BYTES:
                chunk = await reader.readany()
                if not chunk:
                    return False
                head += chunk
        except UPSTREAM_READ_ERRORS:
            return False
        if failed_first_event(bytes(head)):
            return False
        opened.head, opened.complete = bytes(head), False
        return True
