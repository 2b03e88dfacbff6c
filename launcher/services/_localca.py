"""A throwaway certificate authority for one embedded server's internal mutual TLS.

SeaweedFS's components talk gRPC to each other on loopback ports; without mTLS any local user
could call the filer's or the master's gRPC API (list, read, delete every object) whatever the
S3 keys. `issue_node_certificate` makes a fresh CA and one certificate it signs, good for
127.0.0.1 as both server and client; every component presents it and trusts only that CA. The
CA's key exists only in memory, so nothing else can ever be signed by it. Fresh at every start:
no state to keep, nothing to rotate.

    paths = issue_node_certificate(data_dir / "tls")   # ca.crt, node.crt, node.key (0600)
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from launcher.services._credentials import private_dir, write_private

# Long enough for any run; the files are replaced at every start anyway.
VALID_FOR = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class NodeCertificate:
    ca: Path
    cert: Path
    key: Path


def issue_node_certificate(folder: Path, common_name: str = "fleetgen-embedded",
                           address: str = "127.0.0.1") -> NodeCertificate:
    """Write a new CA certificate and a node certificate + key it signed into `folder` (0700)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    private_dir(folder)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{common_name} CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALID_FOR)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    node_key = ec.generate_private_key(ec.SECP256R1())
    node_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_name).public_key(node_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALID_FOR)
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"),
            *(x509.IPAddress(ipaddress.ip_address(a)) for a in sorted({"127.0.0.1", address}))]),
            critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    paths = NodeCertificate(folder / "ca.crt", folder / "node.crt", folder / "node.key")
    pem = serialization.Encoding.PEM
    write_private(paths.ca, ca_cert.public_bytes(pem).decode())
    write_private(paths.cert, node_cert.public_bytes(pem).decode())
    write_private(paths.key, node_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode())
    return paths
