"""`loraplex serve --gateway-workers N`: several gateway processes share the public ports.

Against `loraplex serve` over the tiny model on the CPU: both workers listen on the
one gRPC port and the one HTTP port, connections spread over them (each worker logs
the requests it takes), every worker answers the same greedy text, and SIGTERM stops
them all cleanly. Plus the pieces: the shared-port reservation and the flag checks.
"""
from __future__ import annotations

import argparse
import re
import socket
import time
import urllib.request
import json

import pytest

from loraplex.cli.serve import check_gateway_workers, default_gateway_workers, gateway_specs
from loraplex.cli.serve_procs import reserve_shared_port
from loraplex.client import Client
from http_stack import make_tiny_model, start_http_stack, write_adapters

pytestmark = pytest.mark.timeout(300)
PROMPT = "The capital of France is"


def _args(**kw) -> argparse.Namespace:
    base = dict(listen="127.0.0.1:0", http_listen="127.0.0.1:0", model="", gateway_flags="", gateway_workers=1)
    base.update(kw)
    return argparse.Namespace(**base)


def test_reserved_port_is_shared_but_takes_no_connections():
    with reserve_shared_port("127.0.0.1:0") as address:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        with pytest.raises(ConnectionRefusedError):          # bound, not listening: no connection lands on it
            socket.create_connection((host, int(port)), timeout=2).close()
        sharers = []
        for _ in range(2):                                   # what each gateway worker does
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((host, int(port)))
            s.listen(8)
            sharers.append(s)
        socket.create_connection((host, int(port)), timeout=2).close()
        for s in sharers:
            s.close()


def test_reserving_a_port_taken_without_sharing_fails_clearly():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot share 127.0.0.1:{port} between gateway processes"):
            with reserve_shared_port(f"127.0.0.1:{port}"):
                pass


def test_default_workers(monkeypatch):
    monkeypatch.delenv("LORAPLEX_GATEWAY_WORKERS", raising=False)
    assert [default_gateway_workers(c) for c in (1, 2, 4, 7, 8, 15, 16, 64)] == [1, 1, 1, 1, 2, 3, 4, 4]
    monkeypatch.setenv("LORAPLEX_GATEWAY_WORKERS", "3")
    assert default_gateway_workers(64) == 3


def test_worker_flags():
    one = gateway_specs(_args(), "c:1", "k:2")
    assert [name for name, _ in one] == ["gateway"] and "--reuse-port" not in one[0][1]
    three = gateway_specs(_args(gateway_workers=3), "c:1", "k:2")
    assert [name for name, _ in three] == ["gateway", "gateway-2", "gateway-3"]
    assert all(argv[-1] == "--reuse-port" and argv[:3] == ["gateway", "--listen", "127.0.0.1:0"]
               for _, argv in three)
    check_gateway_workers(_args(gateway_workers=4, gateway_flags="--log-level DEBUG"))
    with pytest.raises(ValueError, match="at least 1"):
        check_gateway_workers(_args(gateway_workers=0))
    with pytest.raises(ValueError, match="cannot share one --metrics-port"):
        check_gateway_workers(_args(gateway_workers=2, gateway_flags="--metrics-port 9100"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("workers")
    model = make_tiny_model(tmp / "tiny", tokenizer)
    root = tmp / "root"
    write_adapters(model, root, {"alpha": 4})
    s = start_http_stack(model, root, "--gateway-workers", "2", "--gateway-flags=--log-requests")
    yield s
    s.stop()


def _completion(base_url: str, lora: str | None) -> str:
    body = {"model": lora or "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Connection": "close"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def _output_once(stack, *patterns: str, timeout_s: float = 10.0) -> str:
    """serve's output once every pattern is in it (or at the deadline): serve relays each child's lines
    from a thread of its own, and the children write their log lines from one, so a line can land a
    moment after serve says ready or after the request it logs has been answered."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = stack.serve.output()
        if all(re.search(p, out) for p in patterns) or time.monotonic() > deadline:
            return out
        time.sleep(0.05)


def test_two_workers_share_both_ports_and_answer_alike(stack):
    out = _output_once(stack, r"\[gateway\] gateway listening on", r"\[gateway-2\] gateway listening on")
    grpc_port = stack.grpc_address.rsplit(":", 1)[1]
    listening = re.findall(r"\[(gateway(?:-2)?)\] gateway listening on \S+:(\d+)", out)
    assert sorted(listening) == [("gateway", grpc_port), ("gateway-2", grpc_port)], out[-3000:]
    http_ports = set(re.findall(r"\[gateway(?:-2)?\] gateway http listening on \S+:(\d+)", out))
    assert len(http_ports) == 1 and stack.base_url.endswith(":" + http_ports.pop())
    assert "2 gateway processes share" in out

    texts = set()
    # New connections each time, so the kernel picks a worker for each: a client of one connection may be
    # handed the previous client's connection from gRPC's process-wide pool (in one fresh-clone CI run every
    # call reached one worker); a client of two connections keeps a pool of its own (one call uses the first).
    for i in range(16):
        with Client(stack.grpc_address, timeout=60, connections=2) as c:
            texts.add(c.generate(PROMPT, lora="alpha" if i % 2 else None, max_tokens=6).text + f"|{i % 2}")
    for i in range(16):
        texts.add(_completion(stack.base_url, "alpha" if i % 2 else None) + f"|{i % 2}")
    assert len(texts) == 2, texts               # one greedy text per model, whichever worker and API answered
    out = _output_once(stack, *(rf"\[{w}\] .*{what}" for w in ("gateway", "gateway-2")
                                for what in (r"generate \S+: \d+ prompt tokens", "http completion")))
    for worker in ("gateway", "gateway-2"):
        assert re.search(rf"\[{worker}\] .*generate \S+: \d+ prompt tokens", out), f"{worker} took no gRPC call"
        assert re.search(rf"\[{worker}\] .*http completion", out), f"{worker} took no HTTP request"


def test_sigterm_stops_every_worker(stack):
    code = stack.stop()
    out = stack.serve.output()
    assert code == 0, out[-3000:]
    for name in ("gateway", "gateway-2", "compute", "cache"):
        assert f"serve: {name} stopped (exit code 0)" in out
