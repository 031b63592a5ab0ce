"""TLS and mutual TLS on a real gateway, with certificates made here: the handshake a client must pass,
on the gRPC API (Python client) and the HTTP API, and settings that are refused at start."""
from __future__ import annotations

import asyncio
import datetime
import http.client
import ipaddress
import ssl
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from loraplex.settings import SettingsError
from gateway.config import GatewayConfig
from test_auth import ADMIN, auth_stack, call_code

pytestmark = pytest.mark.timeout(120)


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


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
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


async def _model_info_code(st, key=None, **tls) -> grpc.StatusCode:
    async with st.client(key, **tls) as c:
        c.timeout = 5
        return await call_code(c.model_info())


def test_tls_handshake_and_plaintext_refused(tokenizer, pki):
    async def go():
        async with auth_stack(tokenizer, tls_cert=str(pki.server_cert), tls_key=str(pki.server_key)) as st:
            return (await _model_info_code(st, tls_ca=pki.ca),
                    await _model_info_code(st),                               # plaintext to a TLS port
                    await _model_info_code(st, tls_ca=pki.client_ca))         # a CA that did not sign it
    trusted, plaintext, untrusted = asyncio.run(go())
    assert trusted == grpc.StatusCode.OK
    assert plaintext == grpc.StatusCode.UNAVAILABLE and untrusted == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_from_the_client_ca(tokenizer, pki):
    async def go():
        async with auth_stack(tokenizer, tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                              tls_client_ca=str(pki.client_ca), api_keys=ADMIN) as st:
            return (await _model_info_code(st, ADMIN, tls_ca=pki.ca, tls_cert=pki.client_cert,
                                           tls_key=pki.client_key),
                    await _model_info_code(st, ADMIN, tls_ca=pki.ca),          # no certificate
                    await _model_info_code(st, ADMIN, tls_ca=pki.ca, tls_cert=pki.rogue_cert,
                                           tls_key=pki.rogue_key),
                    await _model_info_code(st, None, tls_ca=pki.ca, tls_cert=pki.client_cert,
                                           tls_key=pki.client_key))            # certificate, no key
    good, no_cert, rogue, no_key = asyncio.run(go())
    assert good == grpc.StatusCode.OK
    assert no_cert == grpc.StatusCode.UNAVAILABLE and rogue == grpc.StatusCode.UNAVAILABLE
    assert no_key == grpc.StatusCode.UNAUTHENTICATED          # mTLS and keys both apply


def test_http_api_serves_the_same_certificate_and_client_ca(tokenizer, pki):
    def get(port: int, context: ssl.SSLContext) -> int:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
        conn.request("GET", "/v1/models", headers={"authorization": f"Bearer {ADMIN}"})
        return conn.getresponse().status

    def context(cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        if cert:
            ctx.load_cert_chain(str(cert), str(key))
        return ctx

    async def go():
        async with auth_stack(tokenizer, tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                              tls_client_ca=str(pki.client_ca), api_keys=ADMIN, http=True) as st:
            good = await asyncio.to_thread(get, st.http_port, context(pki.client_cert, pki.client_key))
            try:
                await asyncio.to_thread(get, st.http_port, context())
                refused = None
            except (ssl.SSLError, ConnectionError, OSError) as exc:
                refused = exc
            return good, refused
    good, refused = asyncio.run(go())
    assert good == 200 and refused is not None


def test_tls_settings_refused_at_start(pki, tmp_path):
    with pytest.raises(SettingsError, match="go together"):
        GatewayConfig(tls_cert=str(pki.server_cert))
    with pytest.raises(SettingsError, match="needs tls_cert"):
        GatewayConfig(tls_client_ca=str(pki.client_ca))
    not_pem = tmp_path / "cert.der"
    not_pem.write_bytes(b"\x30\x82")
    with pytest.raises(SettingsError, match="not a PEM file"):
        GatewayConfig(tls_cert=str(not_pem), tls_key=str(pki.server_key))
    with pytest.raises(SettingsError, match="cannot read"):
        GatewayConfig(tls_cert=str(tmp_path / "missing.pem"), tls_key=str(pki.server_key))


def test_cli_connects_with_tls_and_a_key(tokenizer, pki):
    async def go():
        async with auth_stack(tokenizer, tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                              api_keys=ADMIN) as st:
            env = {"LORAPLEX_API_KEY": ADMIN, "PATH": ""}
            argv = [sys.executable, "-m", "loraplex.cli.main", "info", "-u", st.address, "--tls-ca", str(pki.ca),
                    "--timeout", "10"]
            ok = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, env=env)
            no_key = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, env={})
            return ok, no_key
    ok, no_key = asyncio.run(go())
    assert ok.returncode == 0, ok.stderr
    assert "max_model_len" in ok.stdout
    assert no_key.returncode == 1 and "UNAUTHENTICATED" in no_key.stderr
