"""A small PKI for the TLS tests: a CA, a rogue CA, server and client leaves, and a bcrypt hash."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

HASH = "$2y$10$X0h1gDsPszWURQaxFh.zoubFi6DXncSjhoQNJgRrnGs7EsimhC7zG"  # exporter-toolkit docs example


@dataclass
class Pki:
    dir: Path

    def path(self, name: str) -> Path:
        return self.dir / name


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> None:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def make_ca(path: Path, cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(path, cert, key)
    return cert, key


def make_leaf(path: Path, cn: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], *, server: bool,
              sans: list[x509.GeneralName]) -> int:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    serial = x509.random_serial_number()
    usage = x509.oid.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(serial).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write(path, cert, key)
    return serial


def make_pki(directory: Path) -> Pki:
    """ca.crt; server.crt/key (127.0.0.1, localhost); client.crt/key (DNS prometheus.example, signed by
    ca); rogue-ca.crt and rogue.crt/key (a client cert from another CA); server2 (a second server
    certificate for rotation tests)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory / "ca", "test CA")
    rogue_ca = make_ca(directory / "rogue-ca", "rogue CA")
    server_sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    make_leaf(directory / "server", "server", ca, server=True, sans=server_sans)
    make_leaf(directory / "server2", "server two", ca, server=True, sans=server_sans)
    make_leaf(directory / "client", "prometheus", ca, server=False,
              sans=[x509.DNSName("prometheus.example"), x509.UniformResourceIdentifier("spiffe://test/prometheus")])
    make_leaf(directory / "other", "other", ca, server=False, sans=[x509.DNSName("other.example")])
    make_leaf(directory / "rogue", "prometheus", rogue_ca, server=False, sans=[x509.DNSName("prometheus.example")])
    return Pki(directory)
