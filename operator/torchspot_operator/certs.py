"""X.509 certificates made here: a per-job CA, the operator's CA, and the certificates they sign. No I/O.

Used for each job's managed etcd (mutual TLS) and by the lab's HTTPS API emulator. Two
authorities, so the operator never reads a job's Secret (its service account may only
create them, and read no Secret outside its own namespace):
- the job's CA signs its workers' client certificate, and its key is discarded at once;
- the operator's CA (kept in one Secret of the operator's own namespace) signs every managed
  etcd's server certificate and the operator's own client certificate.
Each etcd trusts client certificates of its job's CA and of the operator's (`ca.crt` holds
both), and its workers and the operator verify its server certificate by the operator's CA.
A worker of another job holds neither; a server certificate (serverAuth only) is no client
certificate, so another job's Secret opens nothing here either.
ECDSA P-256 keys: small and quick to make (a job's whole set takes milliseconds), accepted by
etcd, Go's TLS and Python's `ssl`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS: Final = 3650
"""A job's certificates live as long as the job: they are never renewed, so they must not expire
under a long run; the Secret holding them goes with the job."""
BACKDATE: Final = timedelta(minutes=5)
"""Certificates are valid from a little before now: clocks across nodes are not exact."""


_SIGNING_ONLY: Final = x509.KeyUsage(
    digital_signature=True,
    key_cert_sign=True,
    crl_sign=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    encipher_only=False,
    decipher_only=False,
)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, PEM-encoded."""

    cert: bytes
    key: bytes


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    encoding, form = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    return key.private_bytes(encoding, form, serialization.NoEncryption())


def _builder(subject: str, issuer: x509.Name, public: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.now(UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + timedelta(days=VALID_DAYS))
    )


def authority(name: str) -> KeyPair:
    """A self-signed CA that may sign leaf certificates only."""
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(name, subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_SIGNING_ONLY, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def issue(ca: KeyPair, name: str, *, hosts: Sequence[str] = (), server: bool = False, client: bool = False) -> KeyPair:
    """A leaf certificate signed by `ca` for `name`: a server's for `hosts` (DNS names or IP
    addresses), a client's, or both."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    if ca_cert.subject == x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]):
        raise ValueError(f"{name!r} is the CA's own name: TLS would take the certificate for a self-signed one")
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError("the CA's key is not an EC key made by authority()")
    key = _key()
    wanted = {ExtendedKeyUsageOID.SERVER_AUTH: server, ExtendedKeyUsageOID.CLIENT_AUTH: client}
    usages = [usage for usage, yes in wanted.items() if yes]
    builder = (
        _builder(name, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if hosts:
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


@dataclass(frozen=True)
class EtcdCertificates:
    """What a job's managed etcd and its workers need: the CA certificates they trust (the job's, whose
    key is discarded once it signed the client pair, so nothing can mint more; and the operator's),
    the server's pair and the workers' client pair."""

    ca: bytes
    server: KeyPair
    client: KeyPair


@dataclass(frozen=True)
class OperatorCertificates:
    """The operator's CA (it signs every managed etcd's server certificate) and the client pair it signs
    for the operator itself, which every managed etcd accepts."""

    ca: KeyPair
    client: KeyPair


def operator_certificates(name: str = "torchspot operator") -> OperatorCertificates:
    """A fresh operator CA and the operator's client certificate."""
    ca = authority(f"{name} CA")
    return OperatorCertificates(ca, issue(ca, f"{name} client", client=True))


def etcd_certificates(service: str, namespace: str, operator: OperatorCertificates | None = None) -> EtcdCertificates:
    """A fresh CA for one job's etcd and the client certificate its workers present; a server certificate
    for its Service's names (and loopback, where the lab reaches it), signed by the operator's CA (by
    the job's own without one: tests of the etcd alone)."""
    ca = authority(f"{namespace}/{service} etcd CA")
    names = [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]
    signer = ca if operator is None else operator.ca
    server = issue(signer, f"{service}.{namespace}.svc", hosts=[*names, "localhost", "127.0.0.1"], server=True)
    client = issue(ca, f"{namespace}/{service} client", client=True)
    trusted = ca.cert if operator is None else ca.cert + operator.ca.cert
    return EtcdCertificates(trusted, server, client)


CA_FILE: Final = "ca.crt"
SERVER_CERT_FILE: Final = "tls.crt"
SERVER_KEY_FILE: Final = "tls.key"
CLIENT_CERT_FILE: Final = "client.crt"
CLIENT_KEY_FILE: Final = "client.key"
SERVER_FILES: Final = (CA_FILE, SERVER_CERT_FILE, SERVER_KEY_FILE)
"""What the etcd pod mounts of the job's Secret."""
CLIENT_FILES: Final = (CA_FILE, CLIENT_CERT_FILE, CLIENT_KEY_FILE)
"""What a worker pod mounts of it (never the server's key)."""


def secret_files(bundle: EtcdCertificates) -> dict[str, bytes]:
    """The job's Secret's data, by file name."""
    return {
        CA_FILE: bundle.ca,
        SERVER_CERT_FILE: bundle.server.cert,
        SERVER_KEY_FILE: bundle.server.key,
        CLIENT_CERT_FILE: bundle.client.cert,
        CLIENT_KEY_FILE: bundle.client.key,
    }


OPERATOR_CA_KEY_FILE: Final = "ca.key"
OPERATOR_FILES: Final = (CA_FILE, OPERATOR_CA_KEY_FILE, CLIENT_CERT_FILE, CLIENT_KEY_FILE)
"""The operator CA Secret's data (in the operator's namespace)."""


def operator_files(bundle: OperatorCertificates) -> dict[str, bytes]:
    """The operator CA Secret's data, by file name."""
    files = (bundle.ca.cert, bundle.ca.key, bundle.client.cert, bundle.client.key)
    return dict(zip(OPERATOR_FILES, files, strict=True))


def from_operator_files(files: Mapping[str, bytes]) -> OperatorCertificates:
    """The operator's certificates back from its Secret's (decoded) data; KeyError names a missing file."""
    ca = KeyPair(files[CA_FILE], files[OPERATOR_CA_KEY_FILE])
    return OperatorCertificates(ca, KeyPair(files[CLIENT_CERT_FILE], files[CLIENT_KEY_FILE]))


def from_secret_files(files: Mapping[str, bytes]) -> EtcdCertificates:
    """The bundle back from a Secret's (decoded) data; KeyError names a missing file."""
    server = KeyPair(files[SERVER_CERT_FILE], files[SERVER_KEY_FILE])
    return EtcdCertificates(files[CA_FILE], server, KeyPair(files[CLIENT_CERT_FILE], files[CLIENT_KEY_FILE]))
