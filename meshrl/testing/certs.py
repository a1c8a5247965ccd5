"""Throw-away certificates for TLS tests: a CA, server and client certificates it signs.

Needs the `cryptography` package (a dev dependency). Keys are EC P-256 (fast to make);
certificates last a day. Never use these outside tests.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CertFiles:
    """PEM files of one certificate authority and the two leaves it signed."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certs(
    folder: Path, name: str = "meshrl-test", hosts: tuple[str, ...] = ("127.0.0.1", "localhost")
) -> CertFiles:
    """Writes ``<name>-ca.pem`` and server/client cert + key pairs into `folder`.

    The server certificate names `hosts` (IP or DNS subjectAltNames), as a client checks the
    address it dials against them.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)

    def subject(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def builder(cn: str, issuer: x509.Name, key) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject(cn))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
        )

    def write_key(key, path: Path) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )

    def write_cert(cert, path: Path) -> None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        builder(f"{name} CA", subject(f"{name} CA"), ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, usage, alt_names: list | None):
        key = ec.generate_private_key(ec.SECP256R1())
        b = builder(cn, ca.subject, key).add_extension(
            x509.BasicConstraints(ca=False, path_length=None), critical=True
        )
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if alt_names:
            b = b.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        return b.sign(ca_key, hashes.SHA256()), key

    alt: list[x509.GeneralName] = []
    for h in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    server, server_key = leaf(f"{name} server", ExtendedKeyUsageOID.SERVER_AUTH, alt)
    client, client_key = leaf(f"{name} client", ExtendedKeyUsageOID.CLIENT_AUTH, None)

    files = CertFiles(
        ca=folder / f"{name}-ca.pem",
        server_cert=folder / f"{name}-server.pem",
        server_key=folder / f"{name}-server.key",
        client_cert=folder / f"{name}-client.pem",
        client_key=folder / f"{name}-client.key",
    )
    write_cert(ca, files.ca)
    write_cert(server, files.server_cert)
    write_key(server_key, files.server_key)
    write_cert(client, files.client_cert)
    write_key(client_key, files.client_key)
    return files
