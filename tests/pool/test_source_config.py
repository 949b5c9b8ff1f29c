"""Configuration of the endpoint sources and the admin API: defaults, flags, errors that name the field."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from picker.config.model import ConfigError, canonical_address
from picker.config.serve_flags import SERVE_FLAGS, add_serve_flags, overrides
from picker.config.sources import load_config


def test_defaults() -> None:
    config = load_config()
    assert config.pool.endpoints_file is None and config.pool.endpoints_file_poll_s == 1.0
    kube = config.kube
    assert not kube.enabled and kube.namespace is None and kube.target_port is None
    assert (kube.watch_timeout_s, kube.inactivity_deadline_s) == (60, 90.0)
    assert config.admin.token is None


def test_flags_reach_the_right_fields(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    kubeconfig = tmp_path / "kc"
    args = parser.parse_args(
        [
            "--kube-service",
            "vllm",
            "--kube-namespace",
            "models",
            "--kube-target-port",
            "8000",
            "--kubeconfig",
            str(kubeconfig),
            "--admin-token",
            "a-long-enough-token-123",
        ]
    )
    config = load_config(overrides=overrides(args, SERVE_FLAGS))
    assert config.kube.selector == "kubernetes.io/service-name=vllm" and config.kube.namespace == "models"
    assert config.kube.target_port == "8000" and config.kube.kubeconfig == kubeconfig
    assert (
        config.admin.token is not None and config.admin.token.get_secret_value() == "a-long-enough-token-123"
    )
    assert "a-long-enough-token" not in str(config.model_dump(mode="json"))  # `picker config` hides it
    args = parser.parse_args(
        ["--endpoints-file", "/etc/picker/endpoints.yaml", "--kube-label-selector", "a=b"]
    )
    with pytest.raises(ConfigError, match=r"pool\.endpoints_file, kube\.label_selector"):
        load_config(overrides=overrides(args, SERVE_FLAGS))


def test_yaml_target_port_may_be_a_number(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text("kube: {label_selector: 'app=vllm', target_port: 8000}\n")
    assert load_config(path).kube.target_port == "8000"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (
            {"pool": {"endpoints": "10.0.0.1:80", "endpoints_file": "/x.yaml"}},
            "pool.endpoints, pool.endpoints_file",
        ),
        ({"pool": {"endpoints": "10.0.0.1:80"}, "kube": {"service": "vllm"}}, "pool.endpoints, kube.service"),
        ({"kube": {"service": "vllm", "label_selector": "a=b"}}, "kube.service and kube.label_selector"),
        ({"kube": {"service": "Not_A_Name"}}, "kube.service"),
        ({"kube": {"namespace": "UPPER"}}, "kube.namespace"),
        ({"kube": {"target_port": "70000"}}, "kube.target_port"),
        ({"kube": {"target_port": "Http"}}, "kube.target_port"),
        ({"kube": {"watch_timeout_s": 0}}, "kube.watch_timeout_s"),
        ({"kube": {"watch_timeout_s": 120}}, "kube.inactivity_deadline_s"),
        ({"kube": {"backoff_initial_s": 60}}, "kube.backoff_initial_s"),
        ({"kube": {"label_selector": ""}}, "kube.label_selector"),
        ({"kube": {"servce": "x"}}, "kube.servce"),
        ({"pool": {"endpoints_file_poll_s": 0}}, "pool.endpoints_file_poll_s"),
        ({"admin": {"token": "short"}}, "admin.token"),
    ],
)
def test_errors_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(overrides=overrides)


def test_addresses_have_one_spelling() -> None:
    assert canonical_address("[fd00:0:0::1]:8000") == "[fd00::1]:8000"
    assert canonical_address(" 10.0.0.1:80") == "10.0.0.1:80"
    assert canonical_address("pod.ns.svc:8000") == "pod.ns.svc:8000"
