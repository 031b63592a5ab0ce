"""Container health probe: exits 0 when a service answers grpc.health.v1 SERVING.

Usage: `python docker/healthcheck.py [HOST:PORT] [SERVICE]`. Without an address
it probes 127.0.0.1 on the port of `LORAPLEX_LISTEN`, the variable every
loraplex service listens on, so one image-level HEALTHCHECK fits all three
services. Exit 1 (with a reason on stderr) on anything else: not listening,
NOT_SERVING (a service draining on SIGTERM), or no answer within the timeout.
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


def check(target: str, service: str = "", timeout_s: float = TIMEOUT_S) -> tuple[bool, str]:
    """(serving?, what was seen)."""
    with grpc.insecure_channel(target) as channel:
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
