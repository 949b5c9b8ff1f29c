"""TLS on the ext_proc port, end to end: Envoy -> picker over TLS (the default), plaintext on
request, a certificate from --cert-path rotated in place the way the kubelet updates a Secret
volume, and the `inference-extension` health name through the picker's shutdown.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import completion_body
from picker.extproc.tls import CERT_FILE, KEY_FILE, KeyPair, self_signed

pytestmark = pytest.mark.envoy

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def publish(directory: Path, cert_pem: bytes, key_pem: bytes, version: int) -> None:
    """Swap the whole pair at once, as the kubelet's atomic writer updates a mounted Secret:
    tls.crt -> ..data/tls.crt, and ..data a symlink renamed over to a new timestamped directory."""
    target = directory / f"..v{version}"
    target.mkdir()
    (target / CERT_FILE).write_bytes(cert_pem)
    (target / KEY_FILE).write_bytes(key_pem)
    staging = directory / "..data_tmp"
    staging.symlink_to(target.name)
    os.replace(staging, directory / "..data")
    for name in (CERT_FILE, KEY_FILE):
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")


def reaches_picker(port: int, trusted: KeyPair) -> bool:
    """A new TLS connection trusting only `trusted` reaches the ext_proc server.

    The port serves no health service, so a completed handshake answers UNIMPLEMENTED; a
    certificate the client does not trust fails the handshake: UNAVAILABLE.
    """
    credentials = grpc.ssl_channel_credentials(root_certificates=trusted.cert_pem)
    options = [("grpc.use_local_subchannel_pool", 1)]  # a fresh connection every time
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined,no-any-return]
    return True


def health_status(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return int(reply.status)


def routed_ok(stack: Stack, count: int = 5) -> bool:
    body = {**completion_body(3), "stream": False}
    with http_client.Client(timeout=10) as client:
        return all(
            client.post(stack.url + "/v1/completions", json=body).status_code == 200 for _ in range(count)
        )


def envoy_stat(stack: Stack, name: str) -> int | None:
    text = http_client.get(f"http://127.0.0.1:{stack.admin_port}/stats?filter=^{name}$", timeout=5).text
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return int(value)
    return None


@pytest.mark.parametrize("tls", [True, False], ids=["tls-default", "secure-serving-false"])
def test_envoy_reaches_the_picker_with_and_without_tls(tmp_path: Path, tls: bool) -> None:
    stack = Stack(tmp_path, StackOptions(replicas=2, envoy_picker_tls=tls)).start()
    try:
        assert routed_ok(stack)
        handshakes = envoy_stat(stack, "cluster.picker.ssl.handshake")
        if tls:
            assert handshakes is not None and handshakes >= 1
            assert "(tls self-signed)" in stack.picker.log_text()  # type: ignore[union-attr]
        else:
            assert not handshakes
            assert "(plaintext)" in stack.picker.log_text()  # type: ignore[union-attr]
    finally:
        stack.stop()


def test_cert_path_rotation_reaches_new_connections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    certs = tmp_path / "tls"
    certs.mkdir()
    first, second, third = self_signed(), self_signed(), self_signed()
    publish(certs, first.cert_pem, first.key_pem, 1)
    monkeypatch.setenv("PICKER_SERVER__CERT_POLL_S", "0.1")  # many polls while a bad pair sits there
    stack = Stack(tmp_path / "stack", StackOptions(replicas=2, picker_args=("--cert-path", str(certs))))
    try:
        stack.start()
        picker = stack.picker
        assert picker is not None
        assert reaches_picker(stack.grpc_port, first)
        assert not reaches_picker(stack.grpc_port, second)
        assert routed_ok(stack)  # Envoy does not verify the certificate, whoever issued it

        publish(certs, second.cert_pem, second.key_pem, 2)
        wait_until(lambda: reaches_picker(stack.grpc_port, second), 15, what="the rotated certificate")
        assert not reaches_picker(stack.grpc_port, first)

        # A malformed replacement (the key of another certificate): the last good one stays in service.
        publish(certs, third.cert_pem, first.key_pem, 3)
        wait_until(lambda: "rejected" in picker.log_text(), 15, what="the bad pair to be rejected")
        for _ in range(3):
            assert reaches_picker(stack.grpc_port, second)
        assert routed_ok(stack)

        publish(certs, third.cert_pem, third.key_pem, 4)
        wait_until(lambda: reaches_picker(stack.grpc_port, third), 15, what="the next good certificate")
        log = picker.log_text()
        assert log.count("rejected") == 1, log  # one line for the bad version, not one per poll
        assert log.count("serving the new certificate") == 2, log
        assert routed_ok(stack)
    finally:
        stack.stop()


def test_unusable_cert_path_stops_the_start_with_a_clear_message(tmp_path: Path) -> None:
    certs = tmp_path / "tls"
    certs.mkdir()
    (certs / CERT_FILE).write_bytes(b"not a certificate")
    (certs / KEY_FILE).write_bytes(self_signed().key_pem)
    stack = Stack(tmp_path / "stack", StackOptions(replicas=0, picker_args=("--cert-path", str(certs))))
    with pytest.raises(RuntimeError, match="exited with 2") as failed:
        stack.start_picker()
    assert "server.cert_path" in str(failed.value) and CERT_FILE in str(failed.value)
    stack.stop()


def test_inference_extension_health_turns_not_serving_on_shutdown(tmp_path: Path) -> None:
    # A long propagation phase: the picker stays up, not ready, while load balancers notice.
    args = ("--propagation", "20", "--quiet-interval", "10", "--drain-timeout", "30")
    stack = Stack(tmp_path, StackOptions(replicas=1, picker_args=args))
    try:
        stack.start_sims()
        stack.start_picker()
        picker = stack.picker
        assert picker is not None
        assert health_status(stack.health_port, "inference-extension") == SERVING
        picker.signal(15)
        wait_until(
            lambda: health_status(stack.health_port, "inference-extension") == NOT_SERVING,
            10,
            what="inference-extension NOT_SERVING after SIGTERM",
        )
        assert picker.alive()
        assert health_status(stack.health_port, "readiness") == NOT_SERVING
        assert health_status(stack.health_port, "liveness") == SERVING
    finally:
        stack.stop()
