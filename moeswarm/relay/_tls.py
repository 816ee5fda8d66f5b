"""TLS for the relay: the server's certificate (reloadable), and how devices and clients verify it.

Unlike data-plane TLS (self-signed, identity proven by the handshake's channel binding), the
relay is a public web server: its certificate is checked against a CA (``--ca`` for a private
one, else the system store), so an untrusted certificate is refused before any byte is sent.
"""

from __future__ import annotations

import hashlib
import ssl
from functools import lru_cache
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ..errors import ConfigError


def first_certificate_der(path: str) -> bytes:
    """DER of the first (end-entity) certificate of a PEM chain file."""
    try:
        certs = x509.load_pem_x509_certificates(Path(path).read_bytes())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read a PEM certificate from {path}: {e}") from None
    return certs[0].public_bytes(serialization.Encoding.DER)


def binding_of(cert_der: bytes | None) -> bytes:
    """``tls-server-end-point`` channel binding: SHA-256 of the certificate; empty without TLS."""
    return hashlib.sha256(cert_der).digest() if cert_der else b""


class ServerTLS:
    """The relay's server context; ``reload`` picks up renewed files for new connections."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2  # phones in the field still speak 1.2
        self.context.set_alpn_protocols(["http/1.1"])
        self.cert_der = b""
        self.reload()

    def reload(self) -> None:
        try:
            self.context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"cannot load certificate {self.cert_file} / key {self.key_file}: {e}") from None
        self.cert_der = first_certificate_der(self.cert_file)


@lru_cache(maxsize=16)
def client_context(ca_file: str | None = None) -> ssl.SSLContext:
    """Verifies the relay's certificate and host name against ``ca_file`` only, or the system store."""
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot load CA certificates from {ca_file}: {e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


_default_ca: list[str | None] = [None]


def set_relay_ca(ca_file: str | None) -> None:
    """Trust ``ca_file`` (only) for relay connections this process dials; ``None``: system store.

    Backbones that reach devices through a relay with a private certificate call this once
    (``moeswarm backbone --relay-ca``); the default is the system trust store, which also
    honours ``SSL_CERT_FILE``.
    """
    if ca_file is not None and not Path(ca_file).is_file():
        raise ConfigError(f"CA file {ca_file} not found")
    _default_ca[0] = ca_file


def default_client_context() -> ssl.SSLContext:
    return client_context(_default_ca[0])


def is_certificate_error(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a failed certificate verification."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
