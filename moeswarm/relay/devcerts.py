"""A private CA and a relay certificate signed by it: for tests, benchmarks and private networks.

Public relays should use a certificate from a public CA (ACME/certbot); a relay on a private
network can use these instead, with every device and backbone given the CA file (``--ca``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class DevCerts:
    ca: Path  # the CA certificate (PEM): what clients trust
    cert: Path  # the relay's certificate chain (PEM): leaf, then CA
    key: Path  # the relay's private key (PEM, mode 0600)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_dev_certs(folder: str | Path, names: tuple[str, ...] = ("127.0.0.1", "localhost"), *,
                   ca_name: str = "moeswarm private relay CA", days: int = 30) -> DevCerts:
    """Write ``ca.pem``, ``relay.pem`` (chain) and ``relay.key`` into ``folder`` (created).

    ``names`` become the leaf's subject alternative names (IP addresses or DNS names).
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name(ca_name)).issuer_name(_name(ca_name))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    leaf = (x509.CertificateBuilder().subject_name(_name(names[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    certs = DevCerts(out / "ca.pem", out / "relay.pem", out / "relay.key")
    certs.ca.write_bytes(ca.public_bytes(pem))
    certs.cert.write_bytes(leaf.public_bytes(pem) + ca.public_bytes(pem))
    fd = os.open(certs.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(_pem_key(key))
    return certs


if __name__ == "__main__":  # python -m moeswarm.relay.devcerts DIR [NAME...]
    import sys

    made = make_dev_certs(sys.argv[1], tuple(sys.argv[2:]) or ("127.0.0.1", "localhost"))
    print(f"CA {made.ca}\ncertificate {made.cert}\nkey {made.key}")
