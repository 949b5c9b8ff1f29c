"""The shape of every event one picker sends another (picker/peers/books.py), checked whole before any of
it is applied: a malformed event from a peer (a faulty or hostile one) is rejected with a reason and
changes nothing, where before `["end", 7]` raised out of the request path and `["pick", "p~x",
["z"]]` was half applied.

Pure: no I/O, no state. `problem(event)` is None for a well-formed event, else the reason (a metric
label: picker_peer_events_rejected_total).

The same for the move ask (`?move_streams=true` through one picker moves every picker's streams):
`ask_problem` judges the ask a peer receives, `answer_problem` the answer the asking picker reads
(picker/peers/asks.py carries both, picker/peers/moves.py gathers the answers); and for a peer's
answer to the drains query, `drains_problem` (picker/peers/asks.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

MAX_ID = 256  # a request id: <owner>~<hex>
MAX_TEXT = 512  # an address, a connection key, a served endpoint
MAX_FLAGS = 32  # response flags in an access-log event


def _text(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_TEXT


def _text_or_none(value: Any) -> bool:
    return value is None or _text(value) or value == ""


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1_000_000


def _status(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 999


def _bool(value: Any) -> bool:
    return isinstance(value, bool)


def _bool_or_none(value: Any) -> bool:
    return value is None or isinstance(value, bool)


def _time(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _flags(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= MAX_FLAGS and all(_text(f) for f in value)


def _summary(value: Any) -> bool:
    """A stream summary (ResponseTracker.summary, or None): a small map of plain values by name."""
    if value is None:
        return True
    return (
        isinstance(value, dict)
        and len(value) <= 32
        and all(isinstance(k, str) and _plain(v) for k, v in value.items())
    )


MAX_SYNC = 100_000  # requests in flight one picker may list in a sync of its books


def _entries(value: Any) -> bool:
    """A sync's books: [[request id, address], ...]."""
    return (
        isinstance(value, list)
        and len(value) <= MAX_SYNC
        and all(
            isinstance(entry, list)
            and len(entry) == 2
            and isinstance(entry[0], str)
            and 0 < len(entry[0]) <= MAX_ID
            and _text(entry[1])
            for entry in value
        )
    )


MAX_BUDGETS = 10_000  # budgeted tenants in one view (picker/peers/budget_share.py)
MAX_TOKENS = 1e15  # a running total or a bucket's level, either sign


def _tokens(value: Any) -> bool:
    return _time(value) and abs(value) <= MAX_TOKENS


def _budget_rows(value: Any) -> bool:
    """A budgets view: [[tenant, level, running total], ...]."""
    return (
        isinstance(value, list)
        and len(value) <= MAX_BUDGETS
        and all(
            isinstance(row, list) and len(row) == 3 and _text(row[0]) and _tokens(row[1]) and _tokens(row[2])
            for row in value
        )
    )


def _plain(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, str | int | bool)
        or (isinstance(value, float) and math.isfinite(value))
    )


Check = Callable[[Any], bool]
# kind -> (the fields after the request id that it must have, those it may add)
SHAPES: dict[str, tuple[tuple[Check, ...], tuple[Check, ...]]] = {
    "pick": ((_text,), (_text,)),  # address; its client connection
    "move": ((_text,), ()),  # address
    "sync": ((_entries,), ()),  # "<sender>~": its books whole
    "end": ((), ()),
    "claim": ((), ()),
    "started": ((_status, _text_or_none, _bool_or_none), ()),  # status, served endpoint, streaming
    "first": ((), (_time,)),  # when, on the sender's clock
    "alive": ((), ()),
    "blind": ((), ()),  # its observer there sees no body: the owner's gauges end it
    "ended": ((_bool,), (_summary, _time)),  # end of stream; summary; when
    "log": ((_count, _flags, _status, _text_or_none), ()),  # attempts, flags, status, upstream
    "spent": ((_text, _text, _tokens), ()),  # "<sender>~": incarnation, tenant, its running total
    "budgets": ((_text, _budget_rows), ()),  # "<sender>~": incarnation, its view of every budget
}


def problem(event: Any) -> str | None:
    """None when `event` may be applied whole; else why not."""
    if not isinstance(event, list) or len(event) < 2:
        return "not-an-event"
    kind, request_id = event[0], event[1]
    shape = SHAPES.get(kind) if isinstance(kind, str) else None
    if shape is None:
        return "unknown-kind"
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_ID:
        return "bad-request-id"
    required, optional = shape
    rest = event[2:]
    if not len(required) <= len(rest) <= len(required) + len(optional):
        return "bad-arity"
    checks = (*required, *optional)
    if not all(check(value) for check, value in zip(checks, rest, strict=False)):
        return "bad-field"
    return None


# A move ask: one picker asks a peer to move that peer's streams off an address at once (its drain
# with `?move_streams=true`). The ask is `["move-streams", address]`; the answer `["moved", n]` (n
# streams began to move), `["cannot", why]` (this picker cannot move streams: not a `picker proxy`),
# or the channel's refusal `["error", why]`.
MOVE_ASK = "move-streams"
MOVED, CANNOT, REFUSED = "moved", "cannot", "error"
MAX_WHY = 64  # a reason in an answer


def ask_problem(ask: Any) -> str | None:
    """None when `ask` is a well-formed move ask; else why not (a metric label)."""
    if not isinstance(ask, list) or not ask:
        return "not-an-ask"
    if ask[0] != MOVE_ASK:
        return "unknown-ask"
    if len(ask) != 2:
        return "bad-ask-arity"
    if not _text(ask[1]):
        return "bad-ask-address"
    return None


def answer_problem(answer: Any) -> str | None:
    """None when `answer` is a well-formed answer to a move ask; else why not (a metric label)."""
    if not isinstance(answer, list) or len(answer) != 2:
        return "not-an-answer"
    kind, value = answer
    if kind == MOVED:
        return None if _count(value) else "bad-count"
    if kind in (CANNOT, REFUSED):
        return None if isinstance(value, str) and 0 < len(value) <= MAX_WHY else "bad-reason"
    return "unknown-answer"


# A peer's drain records, its answer to the drains query (`GET /admin/drains?scope=pool` merges every
# picker's, picker/pool/drain.py `merge_summaries`): a list of `DrainRecord.summary` maps. Judged whole:
# one that does not pass is dropped and counted, and that peer's records are left out of the view.
MAX_DRAINS = 10_000  # records in one answer (open drains and the recently closed ones)
MAX_EXTRA = 8  # fields a newer picker may add to a record: plain values, carried as they are
_WORD = 64


def _word(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= _WORD


def _ends(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and len(value) <= MAX_FLAGS
        and all(_word(k) and _count(v) for k, v in value.items())
    )


DRAIN_FIELDS: dict[str, Check] = {
    "address": _text,
    "cause": _word,
    "source": lambda v: isinstance(v, str) and len(v) <= MAX_TEXT,
    "started_wall": _time,
    "open": _bool,
    "duration_s": _time,
    "in_flight_at_start": _count,
    "failed_before_start": _count,
    "ended": _ends,
    "moved_away": _count,
    "moved_in": _count,
    "picks_after_start": _count,
    "time_to_zero_s": lambda v: v is None or _time(v),
    "exit": lambda v: v is None or _word(v),
}


# fields a picker of an earlier version does not send: checked when present
DRAIN_FIELDS_OPTIONAL: dict[str, Check] = {"pulls_at_start": _count}


def _drain_record(record: dict[Any, Any]) -> bool:
    if not all(name in record and check(record[name]) for name, check in DRAIN_FIELDS.items()):
        return False
    if not all(check(record[name]) for name, check in DRAIN_FIELDS_OPTIONAL.items() if name in record):
        return False
    extra = [k for k in record if k not in DRAIN_FIELDS and k not in DRAIN_FIELDS_OPTIONAL]
    return len(extra) <= MAX_EXTRA and all(_word(k) and _plain(record[k]) for k in extra)


def drains_problem(answer: Any) -> str | None:
    """None when `answer` is a well-formed list of drain records; else why not (a metric label)."""
    if not isinstance(answer, list):
        return "not-a-list"
    if len(answer) > MAX_DRAINS:
        return "too-many"
    if not all(isinstance(record, dict) for record in answer):
        return "not-a-record"
    if not all(_drain_record(record) for record in answer):
        return "bad-field"
    return None
