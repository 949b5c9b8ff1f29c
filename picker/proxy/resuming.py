"""The proxy's side of a stream resume (streams.resume): HTTP in and out around the core's rules.

The rules (what may be resumed, the continuation's request, the splice the client sees) live in
picker/streams/resume.py and the choice of replica in `RequestPath.resume`; this module reads the
request's header and body into them, relays a resumable stream part by part, and opens each
continuation on the replica the core names.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import Callable
from typing import Any

from picker.contract import Outcome, Reply, headers, reply_for
from picker.proxy import translate
from picker.proxy.downstream import Downstream
from picker.proxy.exchange import Exchange, UpstreamCut
from picker.proxy.upstream import UPSTREAM_READ_ERRORS, Opened, Upstream, UpstreamUnavailable
from picker.request.pipeline import RequestPath
from picker.streams import RequestRecord
from picker.streams.resume import CHAT, COMPLETIONS, ResumeMode, Splice, Why, prepare, refusal

log = logging.getLogger(__name__)

END_READ_S = 2.0  # after [DONE], how long the rest of an engine's body may take (its framing only)

_ASKED = {"on": True, "off": False}


def read_ask(value: str | None) -> bool | Reply | None:
    """The request's `x-picker-resume` header: on, off, or none; anything else is a 400."""
    if value is None:
        return None
    asked = _ASKED.get(value.strip().lower())
    if asked is None:
        return reply_for(Outcome.BAD_REQUEST, f"{headers.RESUME} must be on or off")
    return asked


def prepared(
    mode: ResumeMode,
    asked: bool | None,
    path: str,
    body: bytes,
    data: dict[str, Any] | None,
    max_ids: int = 0,
) -> tuple[bytes, Splice | None, str | None]:
    """The body to send and the stream's splice when it may be resumed; else the body as it came,
    no splice, and why not (None when resume is simply off for it). `data` is the body's JSON
    object as the request's parse read it (None: it had none)."""
    if asked is False or (mode is ResumeMode.OFF and not asked) or path not in (COMPLETIONS, CHAT):
        return body, None, None
    if data is None:
        return body, None, "not-json"
    why = refusal(data, path, mode, asked)
    if why is not None:
        return body, None, why
    sent, splice = prepare(data, chat=path == CHAT, max_ids=max_ids)
    return json.dumps(sent, separators=(",", ":")).encode(), splice, None


async def open_continuation(
    upstream: Upstream, splice: Splice, target: str, outgoing: list[tuple[str, str]]
) -> Opened | None:
    """Ask `target` for the rest of the stream; None when it does not start a stream."""
    asked = splice.continuation()
    if asked is None:
        return None
    path, body = asked
    try:
        opened = await upstream.open([target], "POST", path, outgoing, json.dumps(body).encode())
    except UpstreamUnavailable as exc:
        log.info("resume on %s failed: %s", target, exc)
        return None
    if opened.response.status != 200 or not translate.is_event_stream(opened.response.headers):
        log.info("resume on %s answered %s", target, opened.response.status)
        opened.response.close()
        return None
    splice.next_part(path)
    return opened


class _Ended(enum.Enum):
    COMPLETE = "complete"  # the stream is complete
    MOVE = "move"  # the picker asked to move it: the part still runs, its unread bytes kept


async def relay_resumable(
    path: RequestPath,
    upstream: Upstream,
    resume_max: int,
    down: Downstream,
    exchange: Exchange,
    opened: Opened,
) -> None:
    """A resumable stream: whole events rewritten into the client's stream (so a cut of it always
    falls between two events); a cut part continued on the replica the core names
    (picker/streams/resume.py), until the stream is complete. A continuation that does not open
    is tried on the next replica; `resume_max` bounds the tries of one stream. A move the picker
    asks (a drain, a stall) ends the running part only once its continuation has opened: with
    none, the stream reads on where it was, as it would have without resume."""
    record, splice = exchange.routed.record, exchange.splice
    assert splice is not None
    current, outgoing, tries = opened, exchange.outgoing, 0
    try:
        while True:
            exchange.current = current
            why = await _part(path, down, record, splice, current, exchange)
            if why is _Ended.COMPLETE:
                exchange.current = None
                return
            if why is _Ended.MOVE and splice.finished is None and path.may_stay(record):
                moved, tries = await _move(path, upstream, resume_max, exchange, current, tries)
                if moved is not None:
                    current = moved
                continue  # on the continuation, or on the part that no replica could replace
            exchange.current = None
            if exchange.moving is not None:  # a move asked as the part broke off, or with nowhere to stay
                exchange.moving, why = None, exchange.moving
            current.response.close()  # vLLM aborts what it still had of this part
            local = splice.finish_locally()
            if local is not None:  # the generation had finished: only its end was lost
                path.body_chunk(record, local)
                await down.write(local)
                return
            failed = current.served

            def cut_target(last: str | None) -> str | None:
                nonlocal failed
                failed = last or failed  # the next replica, given the one that just failed
                return path.resume(record, failed)

            continued, tries, _ = await _continue(
                path, upstream, splice, outgoing, resume_max, tries, cut_target
            )
            exchange.exhausted = tries >= resume_max
            if continued is None:
                if splice.error_frame:
                    path.body_chunk(record, splice.error_frame)  # the engine's word on it stands
                    await down.write(splice.error_frame)
                    return
                raise UpstreamCut(f"{why.value}, not resumed")
            path.resumed(why.value)
            log.info("request_id=%s resumed on %s (%s)", record.request_id, continued.served, why.value)
            current = continued
    finally:
        current.response.close()


async def _continue(
    path: RequestPath,
    upstream: Upstream,
    splice: Splice,
    outgoing: list[tuple[str, str]],
    resume_max: int,
    tries: int,
    target_of: Callable[[str | None], str | None],
) -> tuple[Opened | None, int, str | None]:
    """The rest of a stream opened on another replica, for a cut or a move alike: the splice's own
    refusal counted first, then replica after replica (`target_of`, given the one that just failed,
    None at first) until one opens, none is left or `resume_max` tries are spent. The continuation
    (None: none opened), the tries spent so far, and the splice's refusal, if any."""
    continued = None
    refused = splice.refused()
    if refused is None and splice.continuation() is None:
        refused = "nothing-left"  # every token was sent, its finish_reason was not
    if refused is not None:
        path.resume_refused(refused)
    target: str | None = None
    while continued is None and refused is None:
        if tries >= resume_max:
            path.resume_refused("limit" if splice.resumes >= resume_max else "failed")
            break
        target = target_of(target)
        if target is None:
            break  # counted: no-replica
        tries += 1
        continued = await open_continuation(upstream, splice, target, outgoing)
    return continued, tries, refused


async def _move(
    path: RequestPath, upstream: Upstream, resume_max: int, exchange: Exchange, current: Opened, tries: int
) -> tuple[Opened | None, int]:
    """The move the picker asked, with the part still running: the rest opened on another replica,
    and only then the part ended (vLLM aborts it). With no continuation opened, the part runs on
    (a stalled one is kept). The opened continuation (None: none) and the tries spent so far."""
    record, splice = exchange.routed.record, exchange.splice
    why = exchange.moving
    assert splice is not None and why is not None
    tried = [current.served]

    def move_target(last: str | None) -> str | None:
        if last is not None:
            tried.append(last)  # every replica tried stays out of this move
        return path.move_target(record, tried)

    continued, tries, refused = await _continue(
        path, upstream, splice, exchange.outgoing, resume_max, tries, move_target
    )
    exchange.moving, exchange.exhausted = None, tries >= resume_max or refused is not None
    if continued is None:
        path.kept(record)
        log.info(
            "request_id=%s not moved (%s): it goes on from %s", record.request_id, why.value, current.served
        )
        return None, tries
    current.response.close()  # the continuation is open: vLLM aborts the part it replaces
    if current.served not in record.cut_on:
        record.cut_on = (*record.cut_on, current.served)
    path.moved(record, continued.served)
    path.resumed(why.value)
    log.info("request_id=%s resumed on %s (%s)", record.request_id, continued.served, why.value)
    return continued, tries


async def _part(
    path: RequestPath,
    down: Downstream,
    record: RequestRecord,
    splice: Splice,
    opened: Opened,
    exchange: Exchange,
) -> Why | _Ended:
    """One replica's part of a resumable stream: why it was cut, or that it ended (the stream is
    complete) or the picker asked to move it (the part still running, nothing of it lost)."""
    reader = opened.response.content
    pending = [opened.head] if opened.head is not None else []
    opened.head = None  # read once, should a move that finds no taker return to this part
    while True:
        if pending:
            chunk = pending.pop()
        elif exchange.moving is not None:
            return _Ended.MOVE  # asked while the relay wrote: taken before its next read
        else:
            exchange.reading = True
            try:
                chunk = await reader.readany()
            except UPSTREAM_READ_ERRORS:
                return Why.RESET
            except asyncio.CancelledError:
                if not exchange.interrupted():
                    raise  # the client left, or a cut: not (only) the move
                return _Ended.MOVE
            finally:
                exchange.reading = False
        if not chunk:
            return _Ended.COMPLETE if splice.done else Why.SHORT
        out = splice.feed(chunk)
        if out:
            path.body_chunk(record, out)
            await down.write(out)
        if splice.error:
            return Why.ERROR_EVENT
        if splice.ended_here:  # a stop string straddled the cut: the rest is not wanted
            return _Ended.COMPLETE  # the caller closes the part: vLLM aborts what it still generates
        if splice.done:
            await _read_to_end(reader)  # the body's own end: its connection goes back to the pool
            return _Ended.COMPLETE


async def _read_to_end(reader: Any, limit: int = 64 * 1024, within_s: float = END_READ_S) -> None:
    """After [DONE] only the body's framing is left: read it, so the response is complete and its
    keep-alive connection is reused (closing it early costs a new connection per request). Bounded
    in bytes and in time: an engine that never ends its body cannot hold the stream's slot."""
    left = limit
    try:
        async with asyncio.timeout(within_s):
            while left > 0 and (chunk := await reader.readany()):
                left -= len(chunk)
    except (TimeoutError, *UPSTREAM_READ_ERRORS):
        pass
