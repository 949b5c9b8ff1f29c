from pathlib import Path

import pytest

from picker.config import ConfigError, load_config, parse_address


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


def test_address_parsing() -> None:
    assert parse_address("[fe80::1]:8000") == ("fe80::1", 8000)
    assert parse_address("pod.ns.svc:8000") == ("pod.ns.svc", 8000)
    with pytest.raises(ValueError):
        parse_address("[zz]:1")
