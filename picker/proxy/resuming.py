"""The proxy's side of a stream resume (streams.resume): HTTP in and out around the core's rules.

The rules (what may be resumed, the continuation's request, the splice the client sees) live in
picker/streams/resume.py and the choice of replica in `RequestPath.resume`; this module reads the
request's header and body into them and opens the continuation on the replica the core names.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from picker import headers
from picker.contract import Outcome, Reply, reply_for
from picker.proxy import translate
from picker.proxy.upstream import Opened, Upstream, UpstreamUnavailable
from picker.streams.resume import CHAT, COMPLETIONS, ResumeMode, Splice, prepare, refusal

log = logging.getLogger(__name__)

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
    mode: ResumeMode, asked: bool | None, path: str, body: bytes
) -> tuple[bytes, Splice | None, str | None]:
    """The body to send and the stream's splice when it may be resumed; else the body as it came,
    no splice, and why not (None when resume is simply off for it)."""
    if asked is False or (mode is ResumeMode.OFF and not asked) or path not in (COMPLETIONS, CHAT):
        return body, None, None
    try:
        data: Any = json.loads(body)
    except ValueError:
        return body, None, "not-json"
    if not isinstance(data, dict):
        return body, None, "not-json"
    why = refusal(data, path, mode, asked)
    if why is not None:
        return body, None, why
    sent, splice = prepare(data, chat=path == CHAT)
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
