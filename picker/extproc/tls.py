"""TLS for the ext_proc port, as the reference endpoint picker serves it.

Either a self-signed certificate made at start (Envoy does not verify it, as in the GIE charts), or
tls.crt / tls.key from a directory (a mounted Secret, which cert-manager rotates in place). The
directory is polled; a new valid pair is handed to gRPC, which uses it from the next handshake on.
A broken or half-written pair is reported once and the last good certificate stays in service.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger(__name__)

CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
# Regenerated at every start and never verified by Envoy: the lifetime only has to outlast the process.
SELF_SIGNED_DAYS = 3650


class CertificateError(ValueError):
    """A certificate/key pair that cannot be served, worded for the operator."""


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate chain (leaf first) and its PEM private key."""

    cert_pem: bytes
    key_pem: bytes


def self_signed(hostnames: Sequence[str] = ()) -> KeyPair:
    """An ECDSA P-256 certificate for localhost, 127.0.0.1, ::1, this host's name and `hostnames`.

    P-256 rather than RSA: the handshake costs the picker a fraction of an RSA one.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    names = dict.fromkeys(["localhost", socket.gethostname(), *hostnames])
    alt_names: list[x509.GeneralName] = [x509.DNSName(n) for n in names if n]
    alt_names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1")]
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "inference-picker"),
            x509.NameAttribute(NameOID.COMMON_NAME, "inference-picker"),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate a peer's clock skew
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def validate(pair: KeyPair) -> x509.Certificate:
    """The leaf certificate, once the pair is known to be servable; CertificateError says why not."""
    try:
        chain = x509.load_pem_x509_certificates(pair.cert_pem)
    except ValueError as exc:
        raise CertificateError(f"{CERT_FILE} holds no readable PEM certificate ({exc})") from exc
    try:
        key = serialization.load_pem_private_key(pair.key_pem, password=None)
    except (ValueError, TypeError) as exc:  # TypeError: the key is encrypted
        raise CertificateError(f"{KEY_FILE} holds no readable unencrypted PEM private key ({exc})") from exc
    except Exception as exc:  # cryptography raises UnsupportedAlgorithm for exotic keys
        raise CertificateError(f"{KEY_FILE}: unsupported private key ({exc})") from exc
    leaf = chain[0]
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.PEM, spki) != leaf.public_key().public_bytes(
        serialization.Encoding.PEM, spki
    ):
        raise CertificateError(f"{KEY_FILE} is not the private key of the first certificate in {CERT_FILE}")
    return leaf


def read_files(directory: Path) -> KeyPair:
    """The two files' bytes, unchecked (OSError when one is missing or unreadable)."""
    return KeyPair((directory / CERT_FILE).read_bytes(), (directory / KEY_FILE).read_bytes())


def load(directory: Path) -> KeyPair:
    """tls.crt / tls.key from `directory`, checked; CertificateError names the problem."""
    try:
        pair = read_files(directory)
    except OSError as exc:
        raise CertificateError(f"{exc.filename}: {exc.strerror}") from exc
    validate(pair)
    return pair


def _describe(pair: KeyPair) -> str:
    leaf = x509.load_pem_x509_certificates(pair.cert_pem)[0]
    return f"subject={leaf.subject.rfc4514_string()!r} expires={leaf.not_valid_after_utc:%Y-%m-%d}"


def _configuration(pair: KeyPair) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(pair.key_pem, pair.cert_pem)])


class ServingCertificate:
    """The certificate the ext_proc port presents, swappable while the server runs.

    gRPC calls `_fetch` from its own threads before every new handshake, so it only hands over a
    configuration prepared earlier (by `watch`, on the event loop): no file I/O, no parsing, and no
    exception ever reaches gRPC. Connections already open keep the certificate they started with.
    """

    def __init__(self, pair: KeyPair, directory: Path | None = None, poll_s: float = 1.0) -> None:
        validate(pair)
        self.directory = directory
        self.poll_s = poll_s
        self.current = pair
        self.reloads = 0
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self._lock = threading.Lock()
        self._rejected: KeyPair | None = None
        self._unreadable: str | None = None

    @classmethod
    def from_config(cls, cert_path: Path | None, poll_s: float) -> ServingCertificate:
        """From `cert_path` (CertificateError if it cannot be served), else a fresh self-signed one."""
        if cert_path is None:
            return cls(self_signed())
        return cls(load(cert_path), cert_path, poll_s)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(_configuration(self.current), self._fetch)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            with self._lock:
                pending, self._pending = self._pending, None
            return pending
        except Exception:  # pragma: no cover - never let anything escape into gRPC's handshake
            return None

    def offer(self, pair: KeyPair) -> bool:
        """Serve `pair` from the next handshake on if it is valid; otherwise keep the current one."""
        if pair == self.current:
            return False
        try:
            validate(pair)
            config = _configuration(pair)
        except (CertificateError, ValueError, TypeError) as exc:
            if pair != self._rejected:  # one line per bad version, not one per poll
                self._rejected = pair
                log.warning(
                    "tls: new certificate in %s rejected, still serving the last good one: %s",
                    self.directory,
                    exc,
                )
            return False
        with self._lock:
            self._pending = config
        self.current = pair
        self._rejected = None
        self.reloads += 1
        log.info("tls: serving the new certificate from %s (%s)", self.directory, _describe(pair))
        return True

    async def check_once(self) -> None:
        """Read the directory (off the loop) and offer what it holds."""
        assert self.directory is not None
        try:
            pair = await asyncio.to_thread(read_files, self.directory)
        except OSError as exc:
            reason = f"{exc.filename}: {exc.strerror}"
            if reason != self._unreadable:
                self._unreadable = reason
                log.warning("tls: cannot read the certificate (%s), still serving the last good one", reason)
            return
        self._unreadable = None
        self.offer(pair)

    async def watch(self) -> None:
        """Poll the certificate directory until cancelled (nothing to do for a self-signed one)."""
        if self.directory is None:
            return
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.check_once()
            except Exception:  # a surprise from a parser must not end rotation for good
                log.exception("tls: checking %s failed; the current certificate stays", self.directory)
