"""docker/healthcheck.py, the containers' probe, against a real service process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loraplex.procs import start_service

from compose_files import ROOT

PROBE = ROOT / "docker" / "healthcheck.py"


def probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True,
                          timeout=30, env=full_env)


@pytest.mark.slow
def test_probe_follows_the_service_state(free_port):
    svc = start_service("cache", ["cache", "--listen", f"127.0.0.1:{free_port}"], timeout_s=120)
    try:
        ok = probe(svc.address)
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
        # as in the image: no argument, the port comes from LORAPLEX_LISTEN
        ok = probe(env={"LORAPLEX_LISTEN": f"0.0.0.0:{svc.port}"})
        assert ok.returncode == 0, ok.stderr
        unknown = probe(svc.address, "no.such.Service")
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    finally:
        assert svc.stop() == 0, svc.output()
    down = probe(svc.address)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def test_probe_without_an_address_says_what_to_set():
    out = probe()
    assert out.returncode != 0 and "LORAPLEX_LISTEN" in out.stderr
