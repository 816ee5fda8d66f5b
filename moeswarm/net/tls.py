"""TLS for the data plane.

Each server makes an ephemeral self-signed certificate at start.  Clients do not check it
against a CA: a peer's identity is its Ed25519 key, proven by the protocol handshake, and the
handshake signs a channel binding (RFC 5929 ``tls-server-end-point``: SHA-256 of the server's
certificate) so a man in the middle with its own certificate cannot relay a valid handshake.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import ssl
import tempfile

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

ALPN = "moeswarm/1"  # protocol_spec section 8


def self_signed_server_context(common_name: str) -> tuple[ssl.SSLContext, bytes]:
    """A server context with a fresh P-256 key and self-signed certificate, and the cert's DER."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .sign(key, hashes.SHA256())
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols([ALPN])
    # ssl only loads key material from files: write both to a private temp file, load, delete.
    fd, path = tempfile.mkstemp(prefix="moeswarm-tls-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(cert.public_bytes(serialization.Encoding.PEM))
            fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
        ctx.load_cert_chain(path)
    finally:
        os.unlink(path)
    return ctx, cert.public_bytes(serialization.Encoding.DER)


def client_context() -> ssl.SSLContext:
    """Encrypts; authentication is the handshake's job (see the module docstring)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols([ALPN])
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def channel_binding(cert_der: bytes | None) -> bytes:
    """``tls-server-end-point`` binding of a certificate; empty without TLS."""
    return hashlib.sha256(cert_der).digest() if cert_der else b""
