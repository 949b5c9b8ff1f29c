import json

import pytest

from picker.contract import Outcome, headers, reply_for

RETRYABLE = {
    Outcome.REJECTED_SATURATED: 429,
    Outcome.REJECTED_TTL_EXPIRED: 429,
    Outcome.REJECTED_NO_ENDPOINTS: 503,
    Outcome.REJECTED_SHUTTING_DOWN: 503,
    Outcome.PICKER_UNAVAILABLE: 503,
}


@pytest.mark.parametrize("outcome", [o for o in Outcome if o is not Outcome.DISPATCHED])
def test_every_outcome_has_one_complete_reply(outcome: Outcome) -> None:
    reply = reply_for(outcome)
    assert reply.reason == outcome.value
    body = json.loads(reply.body())
    assert body["error"]["code"] == reply.status
    assert body["error"]["message"] and body["error"]["type"]
    names = dict(reply.headers())
    assert names[headers.DROPPED_REASON] == outcome.value
    assert names[headers.CONTENT_TYPE] == "application/json"
    assert (headers.RETRY_AFTER in names) == reply.retryable


@pytest.mark.parametrize(("outcome", "status"), RETRYABLE.items())
def test_retryable_rejections_match_the_published_table(outcome: Outcome, status: int) -> None:
    reply = reply_for(outcome)
    assert (reply.status, reply.retryable) == (status, True)
    assert int(dict(reply.headers())[headers.RETRY_AFTER]) >= 1


def test_client_errors_are_not_retryable() -> None:
    assert (reply_for(Outcome.BAD_REQUEST).status, reply_for(Outcome.BAD_REQUEST).retryable) == (400, False)
    assert (reply_for(Outcome.TOO_LARGE).status, reply_for(Outcome.TOO_LARGE).retryable) == (413, False)
    assert reply_for(Outcome.INTERNAL_ERROR).status == 500


def test_dispatched_has_no_local_reply() -> None:
    with pytest.raises(ValueError):
        reply_for(Outcome.DISPATCHED)


def test_custom_message_is_used() -> None:
    assert json.loads(reply_for(Outcome.BAD_REQUEST, "no model").body())["error"]["message"] == "no model"
