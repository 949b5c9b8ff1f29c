"""The reference picker's flags and plugin configuration, read as this picker reads them (issue 21)."""

from __future__ import annotations

import argparse

import pytest

from picker.cli.main import _load
from picker.config.plugins import PluginConfigError, affinity_settings, parse_plugin_config
from picker.config.reference_flags import (
    ReferenceFlagError,
    add_reference_flags,
    reference_overrides,
    seconds,
)
from tests.gateways.reference_chart import DEFAULT_PLUGINS


@pytest.mark.parametrize(
    ("text", "expected"),
    [("50ms", 0.05), ("5s", 5.0), ("1m30s", 90.0), ("0.25", 0.25), ("1h", 3600.0), ("250us", 0.00025)],
)
def test_go_durations_are_seconds(text: str, expected: float) -> None:
    assert seconds(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "soon", "5 s", "1x", "ms"])
def test_a_bad_duration_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        seconds(text)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_reference_flags(parser)
    return parser.parse_args(list(argv))


def test_mapped_flags_set_settings_and_accepted_ones_say_so() -> None:
    overrides, notes = reference_overrides(
        parse(
            "--grpc-health-port",
            "9013",
            "--zap-encoder",
            "json",
            "--v",
            "4",
            "--tracing",
            "--refresh-metrics-interval=50ms",
            "--ha-enable-leader-election",
            "--enable-pprof=false",
        )
    )
    assert overrides == {
        "server": {"health_port": 9013},
        "log_format": "json",
        "log_level": "DEBUG",
        "tracing": {"enabled": True},
        "leader": {"enabled": True},
        "load": {"scrape_interval_s": 0.05},
    }
    assert len(notes) == 1 and "pprof" in notes[0]


@pytest.mark.parametrize(
    "argv",
    [
        ("--pool-group", "inference.networking.x-k8s.io"),
        ("--tracing=maybe",),
        ("--zap-encoder", "xml"),
        ("--model-server-metrics-https-insecure-skip-verify=false",),
    ],
)
def test_values_that_cannot_be_honoured_name_their_flag(argv: tuple[str, ...]) -> None:
    with pytest.raises(ReferenceFlagError, match=argv[0].split("=")[0]):
        reference_overrides(parse(*argv))


def test_the_charts_default_plugins_parse_and_map_onto_affinity_settings() -> None:
    config = parse_plugin_config(DEFAULT_PLUGINS, "default-plugins.yaml")
    assert [p.type for p in config.plugins] == [
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "prefix-cache-scorer",
    ]
    assert config.weight("prefix-cache-scorer") == 3.0 and config.weight("queue-scorer") == 2.0
    assert config.notes == ()
    assert affinity_settings(config) == {
        "prefix": "approximate",
        "prefix_weight": 3.0,
        "load_weight": 4.0,  # queue 2 + KV cache 2: one load score here
        "lora_weight": 0.0,
        "sticky_threshold": 1.01,  # no prefix-cache-affinity-filter in that file: weighted scores only
    }


def test_the_sticky_stack_of_the_current_guides_maps_too() -> None:
    text = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-affinity-filter
  parameters: {affinityThreshold: 0.7}
- type: precise-prefix-cache-producer
- type: queue-scorer
- type: lora-affinity-scorer
- type: session-affinity-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-affinity-filter
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: lora-affinity-scorer
  - pluginRef: max-score-picker
"""
    settings = affinity_settings(parse_plugin_config(text))
    assert settings["prefix"] == "precise" and settings["sticky_threshold"] == 0.7
    assert settings["load_weight"] == 2.0 and settings["lora_weight"] == 1.0
    assert settings["session_header"] == "x-session-id"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: magic-scorer\n",
            "magic-scorer",
        ),
        ("apiVersion: v9\nkind: EndpointPickerConfig\n", "apiVersion"),
        ("apiVersion: llm-d.ai/v1alpha1\nkind: Other\n", "kind"),
        (
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n"
            "schedulingProfiles:\n- name: d\n  plugins:\n  - pluginRef: nope\n",
            "pluginRef",
        ),
        ("[unclosed", "YAML"),
    ],
)
def test_a_config_this_picker_cannot_use_is_an_error_naming_what(text: str, named: str) -> None:
    with pytest.raises(PluginConfigError, match=named):
        parse_plugin_config(text)


def test_our_flags_win_over_the_reference_ones() -> None:
    from picker.config.serve_flags import add_serve_flags

    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    config = _load(parser.parse_args(["--grpc-health-port", "9013", "--health-port", "9023"]))
    assert config.server.health_port == 9023


@pytest.mark.parametrize(
    "argv",
    [
        ("--zap-log-level=debug", "-v", "1"),
        ("-v", "1", "--zap-log-level=debug"),
        ("--zap-log-level=info", "-v", "5"),
    ],
)
def test_the_more_verbose_of_zap_log_level_and_v_wins_whatever_their_order(argv: tuple[str, ...]) -> None:
    overrides, _ = reference_overrides(parse(*argv))
    assert overrides["log_level"] == "DEBUG"  # was INFO when -v came last in the flags' table


def test_the_rollout_package_exports_what_it_names() -> None:
    namespace: dict[str, object] = {}
    exec("from picker.rollout import *", namespace)  # `steps_of` was named but not defined there
    assert "Canary" in namespace
