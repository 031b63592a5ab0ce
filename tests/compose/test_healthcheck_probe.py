"""docker/healthcheck.py, the containers' probe, against a real service process."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from loraplex.procs import spawn_service, start_service, wait_listening

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


@pytest.mark.slow
def test_probe_speaks_tls_and_mutual_tls_as_the_gateway_does(tmp_path):
    from tls_pki import make_pki

    pki = make_pki(tmp_path)
    cache = start_service("cache", ["cache", "--listen", "127.0.0.1:0"], timeout_s=120)
    gateways = []

    def tls_gateway(flags: list[str]):
        # ready at its listening line: start_service's own readiness poll speaks plaintext
        svc = wait_listening(spawn_service("gateway", ["gateway", "--listen", "127.0.0.1:0", "--cache-address",
                                                       cache.address, "--compute-addresses", "127.0.0.1:9", *flags]),
                             120)
        gateways.append(svc)
        return svc

    try:
        tls = tls_gateway(["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)])
        env = {"LORAPLEX_TLS_CERT": str(pki.server_cert), "LORAPLEX_HEALTHCHECK_CA": str(pki.ca)}
        ok = probe(tls.address, env=env)
        deadline = time.monotonic() + 60
        while ok.returncode != 0 and time.monotonic() < deadline:       # listening, maybe not serving yet
            time.sleep(0.5)
            ok = probe(tls.address, env=env)
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
        own = probe(tls.address, env={"LORAPLEX_TLS_CERT": str(pki.server_cert)})   # its own certificate as trust
        assert own.returncode == 0, own.stderr
        untrusted = probe(tls.address, env={**env, "LORAPLEX_HEALTHCHECK_CA": str(pki.client_ca)})   # another CA
        assert untrusted.returncode == 1 and "UNAVAILABLE" in untrusted.stderr
        assert probe(tls.address).returncode == 1                                         # plaintext refused
        mtls = tls_gateway(["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                            "--tls-client-ca", str(pki.client_ca)])
        env_m = {**env, "LORAPLEX_TLS_CLIENT_CA": str(pki.client_ca)}
        missing = probe(mtls.address, env=env_m)
        assert missing.returncode != 0 and "LORAPLEX_HEALTHCHECK_CLIENT_CERT" in missing.stderr
        ok = probe(mtls.address, env={**env_m, "LORAPLEX_HEALTHCHECK_CLIENT_CERT": str(pki.client_cert),
                                      "LORAPLEX_HEALTHCHECK_CLIENT_KEY": str(pki.client_key)})
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    finally:
        for svc in (*gateways, cache):
            svc.stop()
