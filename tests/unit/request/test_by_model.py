"""Version-aware routing (issue 24, item 1; scheduling.by_model): a request goes only to endpoints
whose /v1/models serves its model (or adapter) with a context window its prompt + max_tokens fits;
when none of the pool ever could, the contract's refusal, not a replica's 404 or 400."""

from __future__ import annotations

import pytest

from picker.contract import Outcome
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.pool.served import Need, Served, parse_models
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath
from picker.scheduling.fit import fits, need_of, refusal
from picker.streams import EndReason

SHORT, LONG, BASE = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def test_vllm_model_cards_give_names_and_the_smallest_window() -> None:
    body = {
        "object": "list",
        "data": [
            {"id": "llama", "max_model_len": 8192, "parent": None},
            {"id": "sql-adapter", "max_model_len": 8192, "parent": "llama"},
        ],
    }
    assert parse_models(body) == Served(frozenset({"llama", "sql-adapter"}), 8192)
    assert parse_models({"data": [{"id": "m"}]}) == Served(frozenset({"m"}), None)
    for bad in (None, [], {"data": "x"}, {"data": [{"id": ""}, 3]}, {"error": {}}):
        assert parse_models(bad) is None


def test_a_request_fits_where_its_model_is_served_and_its_window_holds() -> None:
    served = Served(frozenset({"m"}), 2048)
    assert fits(served, Need("m", 2048)) and not fits(served, Need("m", 2049))
    assert not fits(served, Need("other", 10))
    assert fits(None, Need("anything", 10**9))  # not known yet: may take it
    assert need_of("m", prompt_chars=4000, max_tokens=100) == Need("m", 1100)
    assert need_of("m", prompt_chars=4000, max_tokens=None, prompt_tokens=321) == Need("m", 321)


def test_the_pool_refuses_only_what_no_endpoint_could_ever_take() -> None:
    pool = [Served(frozenset({"m"}), 2048), Served(frozenset({"m", "ad"}), 8192)]
    assert refusal(pool, Need("m", 8000)) is None
    assert refusal(pool, Need("nope", 10)) is Outcome.REJECTED_MODEL_NOT_SERVED
    assert refusal(pool, Need("m", 9000)) is Outcome.REJECTED_CONTEXT_TOO_LONG
    assert refusal([*pool, None], Need("nope", 10)) is None  # one endpoint not read yet: it might


def path_with_cards() -> tuple[RequestPath, Pool]:
    pool = Pool()
    pool.apply(ready=[SHORT, LONG, BASE])
    cards = {
        SHORT: Served(frozenset({"m"}), 1024),
        LONG: Served(frozenset({"m"}), 8192),
        BASE: Served(frozenset({"other", "ad"}), 4096),
    }
    for address, served in cards.items():
        endpoint = pool.get(address)
        assert endpoint is not None
        endpoint.served = served
    path = RequestPath(
        pool, Metrics(pool="default"), fallback_count=2, schedule=lambda d, f: lambda: None, by_model=True
    )
    return path, pool


def request(model: str, prompt_chars: int, max_tokens: int = 16) -> InferenceRequest:
    return InferenceRequest(
        method="POST", path="/v1/completions", model=model, prompt_chars=prompt_chars, max_tokens=max_tokens
    )


@pytest.mark.parametrize(
    ("model", "chars", "where"),
    [("m", 400, {SHORT, LONG}), ("m", 8000, {LONG}), ("ad", 100, {BASE}), ("other", 100, {BASE})],
)
def test_picks_and_fallbacks_are_only_endpoints_that_fit(model: str, chars: int, where: set[str]) -> None:
    path, _ = path_with_cards()
    for _ in range(20):
        ticket = path.admit(request(model, chars))
        assert ticket.outcome is Outcome.DISPATCHED
        assert set(ticket.payload.picked) <= where
        path.finish(ticket.payload, EndReason.COMPLETED)


def test_what_no_endpoint_serves_is_the_contracts_refusal() -> None:
    path, _ = path_with_cards()
    assert path.admit(request("missing", 100)).outcome is Outcome.REJECTED_MODEL_NOT_SERVED
    assert path.admit(request("m", 40_000)).outcome is Outcome.REJECTED_CONTEXT_TOO_LONG


async def test_a_request_whose_only_fitting_endpoint_is_draining_waits_not_refused() -> None:
    path, pool = path_with_cards()
    pool.apply(ready=[SHORT, BASE], draining=[LONG])
    ticket = path.admit(request("m", 8000))
    assert not ticket.done  # queued (its TTL bounds the wait): a drain is not "never served"
    path.cancel(ticket)
