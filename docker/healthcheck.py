"""Container health probe: exits 0 when a service answers grpc.health.v1 SERVING.

Usage: `python docker/healthcheck.py [HOST:PORT] [SERVICE]`. Without an address
it probes 127.0.0.1 on the port of `LORAPLEX_LISTEN`, the variable every
loraplex service listens on, so one image-level HEALTHCHECK fits all three
services. Exit 1 (with a reason on stderr) on anything else: not listening,
NOT_SERVING (a service draining on SIGTERM), or no answer within the timeout.

TLS: when the service has a certificate (`LORAPLEX_TLS_CERT`, the gateway's
setting), the probe speaks TLS too. It trusts `LORAPLEX_HEALTHCHECK_CA` (else the
service's certificate file itself, pinned as the trust anchor), checks the name `LORAPLEX_HEALTHCHECK_SERVER_NAME` (else the
address it dials, 127.0.0.1), and under mutual TLS (`LORAPLEX_TLS_CLIENT_CA`)
presents `LORAPLEX_HEALTHCHECK_CLIENT_CERT` / `_CLIENT_KEY`.
"""
from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def probe_target(environ: dict[str, str]) -> str:
    """127.0.0.1 on the port the service was told to listen on."""
    listen = environ.get("LORAPLEX_LISTEN", "")
    if ":" not in listen:
        raise SystemExit("healthcheck: give HOST:PORT or set LORAPLEX_LISTEN (e.g. 0.0.0.0:50051)")
    return "127.0.0.1:" + listen.rsplit(":", 1)[1]


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise SystemExit(f"healthcheck: cannot read {what} {path}: {e}") from None


def channel_for(target: str, environ: dict[str, str]) -> grpc.Channel:
    """Plaintext, or TLS (and mutual TLS) as the service's own settings say."""
    cert = environ.get("LORAPLEX_TLS_CERT", "")
    if not cert:
        return grpc.insecure_channel(target)
    ca = environ.get("LORAPLEX_HEALTHCHECK_CA", "") or cert
    client_cert = environ.get("LORAPLEX_HEALTHCHECK_CLIENT_CERT", "")
    client_key = environ.get("LORAPLEX_HEALTHCHECK_CLIENT_KEY", "")
    if environ.get("LORAPLEX_TLS_CLIENT_CA") and not (client_cert and client_key):
        raise SystemExit("healthcheck: the service asks for client certificates (LORAPLEX_TLS_CLIENT_CA): set "
                         "LORAPLEX_HEALTHCHECK_CLIENT_CERT and LORAPLEX_HEALTHCHECK_CLIENT_KEY")
    creds = grpc.ssl_channel_credentials(
        _read(ca, "CA"), _read(client_key, "client key") if client_key else None,
        _read(client_cert, "client certificate") if client_cert else None)
    name = environ.get("LORAPLEX_HEALTHCHECK_SERVER_NAME", "")
    return grpc.secure_channel(target, creds, [("grpc.ssl_target_name_override", name)] if name else [])


def check(target: str, service: str = "", timeout_s: float = TIMEOUT_S,
          environ: dict[str, str] | None = None) -> tuple[bool, str]:
    """(serving?, what was seen)."""
    with channel_for(target, dict(os.environ) if environ is None else environ) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{target}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, f"{target}: {status}"


def main(argv: list[str]) -> int:
    target = argv[1] if len(argv) > 1 else probe_target(dict(os.environ))
    service = argv[2] if len(argv) > 2 else ""
    ok, seen = check(target, service)
    print(seen, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
