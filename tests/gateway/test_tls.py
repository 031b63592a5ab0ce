"""TLS and mutual TLS on a real gateway, with certificates made here: the handshake a client must pass,
on the gRPC API (Python client) and the HTTP API, and settings that are refused at start."""
from __future__ import annotations

import asyncio
import http.client
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from loraplex.settings import SettingsError
from gateway.config import GatewayConfig
from test_auth import ADMIN, auth_stack, call_code
from tls_pki import Pki, make_pki

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


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
