"""Outside inputs parsed whole or refused with the parser's own error (issue 40, item 3 of what to
build): arbitrary and mutated valid inputs never raise anything else. Hypothesis, bounded in examples
so the suite stays quick. The peer channel's events: tests/unit/peers/test_peer_events.py; KV events:
tests/sources/test_kv_events.py."""

from __future__ import annotations

import random

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from picker.pool.cache import KvBlocks
from picker.sources.kv_events import apply_batch
from picker.sources.static_file import EndpointsFileError, read_endpoints
from picker.sources.vllm_metrics import MetricsPageError, parse_engine_gauges

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

VALID_FILE = """\
endpoints:
- 10.0.0.1:8000
- {address: 10.0.0.2:8000, draining: true}
- {address: "[fd00::1]:8000", labels: {app.kubernetes.io/version: v2}}
"""

VALID_PAGE = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="4096"} 1.0
"""


def mutate(data: bytes, rng: random.Random, edits: int) -> bytes:
    """A few byte flips, deletions and insertions: what a faulty writer or a hostile one sends."""
    out = bytearray(data)
    for _ in range(edits):
        at = rng.randrange(len(out) + 1)
        match rng.randrange(3):
            case 0 if out:
                out[min(at, len(out) - 1)] = rng.randrange(256)
            case 1 if out:
                del out[min(at, len(out) - 1)]
            case _:
                out[at:at] = bytes([rng.randrange(256)])
    return bytes(out)


def test_the_valid_inputs_parse() -> None:
    states, labels = read_endpoints(VALID_FILE)
    assert len(states) == 3 and labels
    gauges = parse_engine_gauges(VALID_PAGE)
    assert (gauges.running, gauges.waiting, gauges.kv_usage) == (3.0, 1.0, 0.25)


@SETTINGS
@given(st.text(max_size=300))
def test_any_text_is_an_endpoints_file_or_its_error(text: str) -> None:
    try:
        read_endpoints(text)
    except EndpointsFileError:
        pass


@SETTINGS
@given(st.integers(0, 2**32), st.integers(1, 8))
def test_a_mutated_endpoints_file_is_one_or_its_error(seed: int, edits: int) -> None:
    text = mutate(VALID_FILE.encode(), random.Random(seed), edits).decode("utf-8", "replace")
    try:
        states, labels = read_endpoints(text)
    except EndpointsFileError:
        return
    assert all(isinstance(a, str) for a in states) and all(isinstance(k, str) for k in labels)


@SETTINGS
@given(st.integers(0, 2**32), st.integers(1, 12))
def test_a_mutated_metrics_page_is_gauges_or_its_error(seed: int, edits: int) -> None:
    page = mutate(VALID_PAGE, random.Random(seed), edits)
    try:
        gauges = parse_engine_gauges(page)
    except MetricsPageError:
        return
    assert gauges.running >= 0 and gauges.waiting >= 0 and 0 <= gauges.kv_usage <= 1


@SETTINGS
@given(st.binary(max_size=400))
def test_any_bytes_are_a_metrics_page_or_its_error(page: bytes) -> None:
    try:
        parse_engine_gauges(page)
    except MetricsPageError:
        pass


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=4) | st.integers(-(2**63), 2**63 - 1), inner, max_size=3)
    ),
    max_leaves=12,
)


@SETTINGS
@given(msgpack_values)
def test_any_kv_event_message_applies_or_is_refused_never_raises_else(value: object) -> None:
    view = KvBlocks()
    for payload in (msgpack.packb(value), msgpack.packb([1.0, [value]]), msgpack.packb([1.0, value])):
        try:
            apply_batch(view, "m", 0, payload)
        except ValueError:
            pass
        view.last_sequence = None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)


@SETTINGS
@given(json_values)
def test_any_v1_models_answer_is_what_it_serves_or_nothing(body: object) -> None:
    from picker.pool.served import parse_models

    for shaped in (body, {"data": body}, {"data": [body]}, {"data": [{"id": body, "max_model_len": body}]}):
        served = parse_models(shaped)
        assert served is None or all(isinstance(m, str) for m in served.models)


@SETTINGS
@given(st.text(max_size=300))
def test_any_endpoint_picker_config_is_one_or_its_error(text: str) -> None:
    from picker.config.plugins import PluginConfigError, parse_plugin_config

    try:
        parse_plugin_config(text)
    except PluginConfigError:
        pass
