"""Test certificates made on the spot: a server CA and server certificate (localhost, 127.0.0.1), a
client CA with a client certificate, and a rogue client certificate from a CA nobody trusts."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_ca: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path      # a client certificate from a CA the gateway does not trust
    rogue_key: Path


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _issue(name: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
           *, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, signer = issuer if issuer else (subject, key)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_pki(d: Path) -> Pki:
    keys = {n: ec.generate_private_key(ec.SECP256R1()) for n in ("ca", "server", "cca", "client", "rca", "rogue")}
    ca = _issue("test ca", keys["ca"], None, ca=True)
    cca = _issue("client ca", keys["cca"], None, ca=True)
    rca = _issue("rogue ca", keys["rca"], None, ca=True)
    server = _issue("localhost", keys["server"], (ca.subject, keys["ca"]), server=True)
    client = _issue("client", keys["client"], (cca.subject, keys["cca"]))
    rogue = _issue("client", keys["rogue"], (rca.subject, keys["rca"]))
    return Pki(_write(d / "ca.pem", _pem_cert(ca)), _write(d / "server.pem", _pem_cert(server)),
               _write(d / "server.key", _pem_key(keys["server"])), _write(d / "client-ca.pem", _pem_cert(cca)),
               _write(d / "client.pem", _pem_cert(client)), _write(d / "client.key", _pem_key(keys["client"])),
               _write(d / "rogue.pem", _pem_cert(rogue)), _write(d / "rogue.key", _pem_key(keys["rogue"])))
