from pathlib import Path

import pytest

from picker.config.model import ConfigError, parse_address
from picker.config.sources import load_config


def test_defaults_match_the_documented_ports() -> None:
    config = load_config()
    assert (config.server.grpc_port, config.server.health_port, config.server.metrics_port) == (
        9002,
        9003,
        9090,
    )
    assert config.scheduling.fallback_count == 2


def test_file_then_env_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text("server: {grpc_port: 1001, health_port: 1002}\npool: {endpoints: ['10.0.0.1:8000']}\n")
    monkeypatch.setenv("PICKER_SERVER__HEALTH_PORT", "2002")
    config = load_config(path, {"server": {"metrics_port": 3003}})
    assert (config.server.grpc_port, config.server.health_port, config.server.metrics_port) == (
        1001,
        2002,
        3003,
    )
    assert config.pool.endpoints == ("10.0.0.1:8000",)


def test_endpoints_are_canonical_and_deduplicated() -> None:
    config = load_config(overrides={"pool": {"endpoints": " 10.0.0.1:80,[::1]:81,10.0.0.1:80 "}})
    assert config.pool.endpoints == ("10.0.0.1:80", "[::1]:81")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"server": {"grpc_port": 70000}}, "server.grpc_port"),
        ({"pool": {"endpoints": "10.0.0.1"}}, "pool.endpoints"),
        ({"pool": {"endpoints": "10.0.0.1:0"}}, "pool.endpoints"),
        ({"scheduling": {"fallback_count": -1}}, "scheduling.fallback_count"),
        ({"sheduling": {}}, "sheduling"),
        ({"log_level": "LOUD"}, "log_level"),
    ],
)
def test_errors_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(overrides=overrides)


def test_bad_files_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        (tmp_path / "a.yaml").write_text("server: [")
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        (tmp_path / "b.yaml").write_text("- 1\n")
        load_config(tmp_path / "b.yaml")
    with pytest.raises(ConfigError, match=r"missing\.yaml"):
        load_config(tmp_path / "missing.yaml")


def test_unreadable_files_are_config_errors_naming_the_file(tmp_path: Path) -> None:
    """Bytes that are not UTF-8, or YAML nested past the parser's depth, are a ConfigError naming
    the file (the command line says it and exits 2), never a traceback."""
    from picker.config.model import SchedulingConfig
    from picker.config.sources import read_plugin_config

    bad = tmp_path / "bad.yaml"
    for content in (b"server: {grpc_port: 1001}  # caf\xe9\n", b"a: " + b"[" * 100_000):
        bad.write_bytes(content)
        with pytest.raises(ConfigError, match=r"bad\.yaml"):
            load_config(bad)
        with pytest.raises(ConfigError, match=r"bad\.yaml"):
            read_plugin_config(SchedulingConfig(config_file=bad))


def test_address_parsing() -> None:
    assert parse_address("[fe80::1]:8000") == ("fe80::1", 8000)
    assert parse_address("pod.ns.svc:8000") == ("pod.ns.svc", 8000)
    with pytest.raises(ValueError):
        parse_address("[zz]:1")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("10.0.0.1:8000", ("10.0.0.1:8000",)),
        ("10.0.0.1:8000,10.0.0.2:8000", ("10.0.0.1:8000", "10.0.0.2:8000")),
        (" 10.0.0.1:8000 , 10.0.0.2:8000 ", ("10.0.0.1:8000", "10.0.0.2:8000")),
        ('["10.0.0.1:8000", "10.0.0.2:8000"]', ("10.0.0.1:8000", "10.0.0.2:8000")),
        ("[fd00::1]:8000,[fd00::2]:8000", ("[fd00::1]:8000", "[fd00::2]:8000")),
        ("[fd00::1]:8000", ("[fd00::1]:8000",)),
    ],
)
def test_env_endpoints_take_the_flag_forms_and_json(value: str, expected: tuple[str, ...]) -> None:
    assert load_config(environ={"PICKER_POOL__ENDPOINTS": value}).pool.endpoints == expected
    if not value.startswith('["'):  # the flag takes the list form only
        assert load_config(overrides={"pool": {"endpoints": value}}).pool.endpoints == expected


def test_env_scalars_and_whole_groups() -> None:
    config = load_config(
        environ={
            "PICKER_SERVER": '{"grpc_port": 1001, "health_port": 1002}',
            "PICKER_SERVER__HEALTH_PORT": "2002",
            "PICKER_LOAD__SCRAPE": "false",
            "PICKER_LOG_LEVEL": "DEBUG",
            "PICKER_SKIP_REAL_VLLM": "1",  # not a setting, and known not to be one
            "PICKER_EVENT_LOOP": "asyncio",
        }
    )
    assert (config.server.grpc_port, config.server.health_port) == (1001, 2002)
    assert config.load.scrape is False
    assert config.log_level == "DEBUG"


@pytest.mark.parametrize(
    ("variable", "hint"),
    [
        ("PICKER_LOGLEVEL", "PICKER_LOG_LEVEL"),
        ("PICKER_POOL__ENDPOINTZ", "PICKER_POOL__ENDPOINTS"),
        ("PICKER_ADMIN_TOKEN", "PICKER_ADMIN__TOKEN"),
        ("PICKER_SERVER__GRPC_PORT__X", "PICKER_SERVER__GRPC_PORT"),
        ("PICKER_NOTHING_LIKE_IT", None),
    ],
)
def test_env_typos_are_errors_naming_the_variable(variable: str, hint: str | None) -> None:
    with pytest.raises(ConfigError, match=f"environment variable {variable}: no such setting") as caught:
        load_config(environ={variable: "1"})
    if hint is not None:
        assert f"did you mean {hint}?" in str(caught.value)


def test_env_errors_name_the_field_and_the_variable() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(environ={"PICKER_SERVER__GRPC_PORT": "abc", "PICKER_POOL__ENDPOINTS": "nope"})
    text = str(caught.value)
    assert "server.grpc_port (from PICKER_SERVER__GRPC_PORT)" in text
    assert "pool.endpoints (from PICKER_POOL__ENDPOINTS)" in text
    # A flag that overrides the variable is what was wrong, not the variable.
    with pytest.raises(ConfigError) as caught:
        load_config(overrides={"server": {"grpc_port": 70000}}, environ={"PICKER_SERVER__GRPC_PORT": "1"})
    assert "server.grpc_port: " in str(caught.value) and "PICKER_" not in str(caught.value)


@pytest.mark.parametrize(
    "overrides",
    [
        {"leader": {"lease_duration_s": float("inf")}},  # passed, then round(inf) killed the election
        {"leader": {"renew_deadline_s": float("nan")}},
        {"streams": {"stall_after_s": float("inf")}},
        {"load": {"scrape_interval_s": "inf"}},
    ],
)
def test_durations_and_figures_must_be_finite(overrides: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="finite"):
        load_config(overrides=overrides)


def test_peers_without_a_credential_refuse_to_start_with_one_clear_line() -> None:
    with pytest.raises(ConfigError, match="peers need a credential"):
        load_config(overrides={"peers": {"members": ["10.0.0.1:9004", "10.0.0.2:9004"]}})
    with pytest.raises(ConfigError, match="peers need a credential"):
        load_config(overrides={"peers": {"service": "pickers.ns.svc:9004"}})
    relaxed = load_config(overrides={"peers": {"members": ["127.0.0.1:9004"], "allow_unauthenticated": True}})
    assert relaxed.peers.secret is None
    alone = load_config(overrides={})
    assert alone.peers.secret is None  # no peers: nothing to authenticate
