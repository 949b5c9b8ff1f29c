"""TLS on the ext_proc port: certificate generation, loading, in-place rotation, health names, flags."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.cli.main import main as cli_main
from picker.config.model import ConfigError
from picker.config.sources import load_config
from picker.drain.check import check_paths
from picker.drain.rules import Budget
from picker.extproc.server import INFERENCE_EXTENSION, HealthState, health_server
from picker.extproc.tls import (
    CERT_FILE,
    KEY_FILE,
    CertificateError,
    KeyPair,
    ServingCertificate,
    load,
    self_signed,
    validate,
)

K8S = Path(__file__).resolve().parents[3] / "config" / "k8s"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def write_pair(directory: Path, pair: KeyPair) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CERT_FILE).write_bytes(pair.cert_pem)
    (directory / KEY_FILE).write_bytes(pair.key_pem)


# -- generation and loading -------------------------------------------------------------------


def test_self_signed_is_p256_for_loopback_and_this_host() -> None:
    pair = self_signed(["picker.example.svc"])
    leaf = validate(pair)
    key = serialization.load_pem_private_key(pair.key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", socket.gethostname(), "picker.example.svc"} <= set(
        sans.get_values_for_type(x509.DNSName)
    )
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    now = datetime.datetime.now(datetime.UTC)
    assert leaf.not_valid_before_utc <= now < leaf.not_valid_after_utc - datetime.timedelta(days=365)
    assert self_signed().cert_pem != pair.cert_pem  # a fresh key per start


def test_load_reads_a_valid_pair(tmp_path: Path) -> None:
    pair = self_signed()
    write_pair(tmp_path, pair)
    assert load(tmp_path) == pair


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d, other: (d / KEY_FILE).unlink(), KEY_FILE),
        (lambda d, other: (d / CERT_FILE).write_bytes(b"not a certificate"), CERT_FILE),
        (lambda d, other: (d / KEY_FILE).write_bytes(b"-----BEGIN PRIVATE KEY-----\nAAAA\n"), KEY_FILE),
        (lambda d, other: (d / KEY_FILE).write_bytes(other.key_pem), "not the private key"),
    ],
    ids=["missing-key", "garbage-cert", "garbage-key", "mismatched-key"],
)
def test_load_names_what_is_wrong(tmp_path: Path, damage, expected: str) -> None:  # type: ignore[no-untyped-def]
    write_pair(tmp_path, self_signed())
    damage(tmp_path, self_signed())
    with pytest.raises(CertificateError, match=expected):
        load(tmp_path)


def test_encrypted_key_is_refused(tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    pair = self_signed()
    encrypted = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret-passphrase"),
    )
    with pytest.raises(CertificateError, match="unencrypted"):
        validate(KeyPair(pair.cert_pem, encrypted))


# -- serving and rotation through a real gRPC server --------------------------------------------


@pytest.fixture
async def tls_health() -> AsyncIterator[tuple[ServingCertificate, KeyPair, int]]:
    """A gRPC health server behind a ServingCertificate (the ext_proc port's credentials path)."""
    first = self_signed()
    certificate = ServingCertificate(first)
    state = HealthState()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(state.servicer, server)
    port = server.add_secure_port("127.0.0.1:0", certificate.credentials())
    await server.start()
    await state.serving()
    try:
        yield certificate, first, port
    finally:
        await server.stop(0)


async def handshake_ok(port: int, trusted: KeyPair) -> bool:
    """A new connection (own subchannel pool) trusting only `trusted` completes a health check."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    credentials = grpc.ssl_channel_credentials(root_certificates=trusted.cert_pem)
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return False
    return reply.status == SERVING


async def test_serves_the_certificate_and_swaps_it_for_new_connections(
    tls_health: tuple[ServingCertificate, KeyPair, int],
) -> None:
    certificate, first, port = tls_health
    second = self_signed()
    assert await handshake_ok(port, first)
    assert not await handshake_ok(port, second)
    assert certificate.offer(second)
    assert await handshake_ok(port, second)
    assert not await handshake_ok(port, first)
    assert not certificate.offer(second)  # the same pair again is no change
    assert certificate.reloads == 1


async def test_a_bad_pair_keeps_the_last_good_one_with_one_log_line(
    tls_health: tuple[ServingCertificate, KeyPair, int], caplog: pytest.LogCaptureFixture
) -> None:
    certificate, first, port = tls_health
    bad = KeyPair(first.cert_pem, self_signed().key_pem)
    with caplog.at_level(logging.WARNING, logger="picker.extproc.tls"):
        for _ in range(3):  # what three polls of an unchanged bad directory do
            assert not certificate.offer(bad)
    assert len([r for r in caplog.records if "rejected" in r.getMessage()]) == 1
    assert certificate.current == first
    assert await handshake_ok(port, first)


async def test_check_once_follows_the_directory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first, second = self_signed(), self_signed()
    write_pair(tmp_path, first)
    certificate = ServingCertificate.from_config(tmp_path, poll_s=1.0)
    assert certificate.current == first
    await certificate.check_once()
    assert certificate.reloads == 0
    write_pair(tmp_path, second)
    await certificate.check_once()
    assert certificate.current == second and certificate.reloads == 1
    (tmp_path / KEY_FILE).unlink()  # mid-rotation by a writer that is not atomic
    with caplog.at_level(logging.WARNING, logger="picker.extproc.tls"):
        await certificate.check_once()
        await certificate.check_once()
    assert len([r for r in caplog.records if "cannot read" in r.getMessage()]) == 1
    assert certificate.current == second
    assert certificate._fetch() is not None  # the swap to `second` is handed to gRPC once
    assert certificate._fetch() is None


def test_from_config_refuses_an_unusable_directory(tmp_path: Path) -> None:
    with pytest.raises(CertificateError, match=CERT_FILE):
        ServingCertificate.from_config(tmp_path, poll_s=1.0)


# -- health names ----------------------------------------------------------------------------


async def test_inference_extension_health_follows_readiness() -> None:
    state = HealthState()
    server, port = health_server(state, "127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def status(name: str) -> int:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                return int(reply.status)

            await state.serving()
            assert await status(INFERENCE_EXTENSION) == SERVING
            await state.not_ready()
            assert await status(INFERENCE_EXTENSION) == NOT_SERVING
            assert await status("readiness") == NOT_SERVING
            assert await status("liveness") == SERVING
    finally:
        await server.stop(0)


# -- configuration and flags -----------------------------------------------------------------


def test_defaults_serve_tls_self_signed() -> None:
    server = load_config().server
    assert server.secure_serving is True and server.cert_path is None


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--secure-serving=false"], False),
        (["--secure-serving", "false"], False),
        (["--secure-serving=true"], True),
        (["--secure-serving"], True),
        ([], True),
    ],
)
def test_secure_serving_flag_spellings(
    flags: list[str], expected: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    cli_main(["config", *flags])
    assert f"secure_serving: {str(expected).lower()}" in capsys.readouterr().out


def test_secure_serving_flag_rejects_other_words(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_main(["config", "--secure-serving=maybe"])
    assert exited.value.code == 2
    assert "expected true or false" in capsys.readouterr().err


def test_cert_path_without_tls_is_a_contradiction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"server\.cert_path"):
        load_config(overrides={"server": {"secure_serving": False, "cert_path": str(tmp_path)}})


@pytest.mark.parametrize(
    ("readiness", "liveness", "flagged"),
    [
        ("inference-extension", "liveness", set()),
        ("inference-extension", "inference-extension", {"PICKER-003"}),  # the reference charts' probes
    ],
)
def test_check_knows_inference_extension_is_a_readiness_name(
    tmp_path: Path, readiness: str, liveness: str, flagged: set[str]
) -> None:
    for source in K8S.glob("*.yaml"):
        text = source.read_text()
        if source.name == "picker.yaml":
            text = text.replace("{port: 9003, service: readiness}", f"{{port: 9003, service: {readiness}}}")
            text = text.replace("{port: 9003, service: liveness}", f"{{port: 9003, service: {liveness}}}")
        (tmp_path / source.name).write_text(text)
    report, _ = check_paths([tmp_path], Budget())
    assert {f.rule.id for f in report.findings if f.rule.id.startswith("PICKER-")} == flagged
