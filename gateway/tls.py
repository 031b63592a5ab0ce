"""TLS for the public gateway: server credentials from PEM files, optionally requiring client certificates.

`--tls-cert` (the certificate chain) and `--tls-key` (its private key) turn TLS
on; `--tls-client-ca` in addition makes every client present a certificate
signed by that CA (mutual TLS). The files are read once, at start.
"""
from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import grpc

from loraplex.settings import SettingsError


def read_pem(path: str, what: str) -> bytes:
    """The bytes of a PEM file, or a SettingsError naming the setting."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SettingsError(f"{what}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise SettingsError(f"{what}: {path} is not a PEM file (no -----BEGIN line)")
    return data


def check_tls_settings(cert: str, key: str, client_ca: str) -> None:
    """Both of cert and key or neither; a client CA only with them; every file readable PEM."""
    if bool(cert) != bool(key):
        raise SettingsError("tls_cert and tls_key go together: give both (or neither, for plaintext)")
    if client_ca and not cert:
        raise SettingsError("tls_client_ca needs tls_cert and tls_key: mutual TLS is TLS first")
    for path, what in ((cert, "tls_cert"), (key, "tls_key"), (client_ca, "tls_client_ca")):
        if path:
            read_pem(path, what)


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS credentials for `add_secure_port`; with `client_ca`, clients must present a certificate it signed."""
    pair = [(read_pem(key, "tls_key"), read_pem(cert, "tls_cert"))]
    if not client_ca:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(pair, root_certificates=read_pem(client_ca, "tls_client_ca"),
                                       require_client_auth=True)


def credentials_from_config(config: Any) -> grpc.ServerCredentials | None:
    """The gateway's server credentials, None for plaintext."""
    if not config.tls_cert:
        return None
    return server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)


def http_tls_options(config: Any) -> dict[str, Any] | None:
    """The same certificate (and client CA) for the HTTP API, as the ASGI server's ssl_* options."""
    if not config.tls_cert:
        return None
    options: dict[str, Any] = {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key}
    if config.tls_client_ca:
        options.update(ssl_ca_certs=config.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options
