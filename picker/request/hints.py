"""What a request's headers ask of the scheduler, read once by the rule both frontends share.

The fairness id, the priority (the header, else the request's InferenceObjective), the endpoints
the data plane allows (the EPP protocol's subset hint, and with the conformance test hooks on, the
test's selection), the session (cache-aware routing's `affinity.session_header`) and the W3C trace
context. Each client-set value is bounded (`requests.max_hint_header_bytes`): a longer one, a
priority that is no integer, or an allowed set with no ready endpoint gets the contract's reply.
Frontends pass a header getter; nothing here knows how headers travel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from picker.config.model import canonical_address
from picker.contract import Outcome, Reply, headers, reply_for
from picker.request.objectives import Objectives, request_priority
from picker.streams.record import Slo

Header = Callable[[str], str | None]


@dataclass(frozen=True, slots=True)
class HintRules:
    """How a frontend reads hints (from the config: requests.*, affinity.session_header)."""

    max_bytes: int = 256
    test_hooks: bool = False
    session_header: str | None = None
    slo_headers: bool = False  # affinity.latency: read the SLO headers (headers.SLO_TTFT, SLO_TPOT)


@dataclass(frozen=True, slots=True)
class Hints:
    flow: str = ""
    priority: int = 0
    allowed: frozenset[str] | None = None
    session: str | None = None
    trace_context: dict[str, str] = field(default_factory=dict)
    slo: Slo | None = None


def endpoints(values: Iterable[str]) -> frozenset[str]:
    """Canonical addresses; entries that are not ip:port cannot match any endpoint and are dropped."""
    out = set()
    for value in values:
        try:
            out.add(canonical_address(value.strip()))
        except ValueError:
            continue
    return frozenset(out)


def read_hints(
    header: Header,
    rules: HintRules,
    objectives: Objectives | None,
    eligible: Callable[[frozenset[str]], bool],
    subset: tuple[str, ...] | None = None,
) -> Hints | Reply:
    """The request's hints, or the contract's reply refusing them. `subset`: the data plane's hint."""
    bound = rules.max_bytes
    bounded = (*headers.CLIENT_HINTS, *((rules.session_header,) if rules.session_header else ()))
    for name in bounded:
        if len((header(name) or "").encode()) > bound:
            return reply_for(Outcome.BAD_REQUEST, f"header {name} is longer than {bound} bytes")
    priority = request_priority(header(headers.PRIORITY), header(headers.OBJECTIVE), objectives)
    if priority is None:
        return reply_for(Outcome.BAD_REQUEST, f"header {headers.PRIORITY} must be an integer")
    allowed = None if subset is None else endpoints(subset)
    selection = header(headers.TEST_ENDPOINT_SELECTION) if rules.test_hooks else None
    if selection is not None:
        chosen = endpoints(selection.split(","))
        allowed = chosen if allowed is None else allowed & chosen
    if allowed is not None and not eligible(allowed):
        return reply_for(
            Outcome.REJECTED_NO_ENDPOINTS,
            f"none of the {len(allowed)} endpoints allowed for this request is ready",
        )
    session = header(rules.session_header) if rules.session_header else None
    trace_context = {name: value for name in headers.TRACE_CONTEXT if (value := header(name)) is not None}
    slo = read_slo(header) if rules.slo_headers else None
    if isinstance(slo, Reply):
        return slo
    return Hints(header(headers.FAIRNESS_ID) or "", priority, allowed, session or None, trace_context, slo)


def read_slo(header: Header) -> Slo | Reply | None:
    """The request's latency objectives (milliseconds in, seconds out); None when it sets none."""
    found: list[float | None] = []
    for names in (headers.SLO_TTFT, headers.SLO_TPOT):
        value = None
        for name in names:
            raw = header(name)
            if raw is None or not raw.strip():
                continue
            try:
                value = float(raw)
            except ValueError:
                value = -1.0
            if not 0 < value <= 3_600_000:  # NaN fails too
                return reply_for(Outcome.BAD_REQUEST, f"header {name} must be milliseconds in (0, 3600000]")
            break
        found.append(None if value is None else value / 1000.0)
    ttft, tpot = found
    return None if ttft is None and tpot is None else Slo(ttft, tpot)
