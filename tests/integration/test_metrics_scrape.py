"""Every service's /metrics during real requests, and JSON logs that carry the caller's request id.

cache (shm, an adapter root), compute (CPU, SmolLM2) and gateway run as real
processes, each with `--metrics-port`; base, adapter, failing and a long
adapter stream (compute is scraped while it runs) go through the gateway's
gRPC API, one completion through its HTTP API; then
every metric docs/deploy.md lists for a service is in its scrape with a
plausible value, and every loraplex_* family scraped is documented.
"""
from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.client import Client, build_generate_request
from loraplex.errors import NotFoundError
from loraplex.procs import spawn_service, wait_listening, wait_serving
from loraplex.v1 import gateway_pb2_grpc
from integration.e2e_support import PROMPT_EN, write_peft_adapter

pytestmark = [pytest.mark.serial, pytest.mark.slow, pytest.mark.timeout(600)]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
REQUEST_ID = "metrics-e2e-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name (of each sample, suffixes included) -> [(labels, value)]."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        out.setdefault(family.name, [])       # histograms and counters by their family name too
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    assert name in samples, f"{name} missing from the scrape"
    return sum(v for lab, v in samples[name] if all(lab.get(k) == x for k, x in labels.items()))


def documented(service: str) -> set[str]:
    """Metric names docs/deploy.md's metrics table lists for `service` (rows `| name | type | service | ...`)."""
    names = set()
    for line in DOCS.read_text().splitlines():
        m = re.match(r"\|\s*`(loraplex_\w+)`\s*\|\s*(\w+)\s*\|\s*([\w, ]+)\|", line)
        if m and service in m.group(3):
            names.add(m.group(1))
    return names


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The three services started at once on picked ports (as `loraplex serve` does); compute without
    warm-up, which these numbers do not need."""
    root = tmp_path_factory.mktemp("root")
    write_peft_adapter(root / "fr", seed=5, rank=8)
    ports = {name: free_port() for name in ("cache", "compute", "gateway")}
    cache_at, compute_at = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    argv = {
        "cache": ["cache", "--listen", cache_at, "--lora-root", str(root), "--metrics-port", str(ports["cache"])],
        "compute": ["compute", "--listen", compute_at, "--device", "cpu", "--cache-address", cache_at,
                    "--max-model-len", "256", "--warmup", "off", "--metrics-port", str(ports["compute"]),
                    "--log-format", "json", "--log-level", "DEBUG"],
        "gateway": ["gateway", "--listen", "127.0.0.1:0", "--cache-address", cache_at, "--compute-addresses",
                    compute_at, "--http-listen", "127.0.0.1:0", "--metrics-port", str(ports["gateway"]),
                    "--log-format", "json", "--log-requests"]}
    services = {name: spawn_service(name, args) for name, args in argv.items()}
    try:
        deadline = time.monotonic() + 300
        for svc in services.values():
            wait_listening(svc, deadline - time.monotonic())
            wait_serving(svc, deadline)
        yield {**services, "ports": ports}
    finally:
        for svc in reversed(services.values()):
            svc.stop()


@pytest.fixture(scope="module")
def scrapes(stack):
    """Requests of every kind, then a scrape of every service (and one of compute mid-stream)."""
    try:
        return run_requests(stack)
    except Exception as exc:      # say what each service printed and whether it still runs
        report = "\n".join(f"--- {name} (exit code {svc.proc.poll()}):\n{svc.output()[-4000:]}"
                            for name, svc in stack.items() if name != "ports")
        raise AssertionError(f"{exc}\n{report}") from exc


def run_requests(stack: dict) -> dict:
    with Client(stack["gateway"].address, timeout=300) as client:
        client.generate(PROMPT_EN, max_tokens=6, ignore_eos=True)
        client.generate(PROMPT_EN, lora="fr", max_tokens=6, ignore_eos=True)
        with pytest.raises(NotFoundError):
            client.generate(PROMPT_EN, lora="no-such-adapter", max_tokens=4)
        task_id = next(a.task_id for a in client.list_loras().adapters if a.name == "fr")
    with grpc.insecure_channel(stack["gateway"].address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(
            build_generate_request(PROMPT_EN, ["fr"], max_tokens=40, ignore_eos=True), timeout=300,
            metadata=[("x-request-id", REQUEST_ID)])
        next(call)
        mid = scrape(stack["ports"]["compute"])
        rest = list(call)
    assert rest[-1].usage.completion_tokens == 40
    http = re.search(r"gateway http listening on (\S+)", stack["gateway"].output()).group(1)
    body = json.dumps({"model": "fr", "prompt": PROMPT_EN, "max_tokens": 4, "ignore_eos": True}).encode()
    answer = urllib.request.urlopen(urllib.request.Request(f"http://{http}/v1/completions", data=body,
                                                           headers={"content-type": "application/json"}),
                                    timeout=300)
    assert json.loads(answer.read())["usage"]["completion_tokens"] == 4
    out = {name: scrape(port) for name, port in stack["ports"].items()}
    out["compute_mid"], out["task_id"] = mid, task_id
    return out


def test_gateway_metrics(stack, scrapes):
    g = scrapes["gateway"]
    assert value(g, "loraplex_gateway_requests_total", method="Generate", code="OK") == 3
    assert value(g, "loraplex_gateway_requests_total", method="Generate", code="NOT_FOUND") == 1
    assert value(g, "loraplex_gateway_requests_total", method="ListLoras", code="OK") == 1
    assert value(g, "loraplex_gateway_requests_total", method="POST /v1/completions", code="200") == 1
    assert value(g, "loraplex_gateway_time_to_first_token_seconds_count") == 4
    assert value(g, "loraplex_gateway_inter_token_latency_seconds_count") > 0
    assert value(g, "loraplex_gateway_e2e_request_latency_seconds_count") == 4
    assert 0 < value(g, "loraplex_gateway_time_to_first_token_seconds_sum") < \
        value(g, "loraplex_gateway_e2e_request_latency_seconds_sum")
    assert value(g, "loraplex_gateway_generated_tokens_total") == 6 + 6 + 40 + 4
    assert value(g, "loraplex_gateway_streams_running") == 0
    expected = documented("gateway")
    assert len(expected) >= 6 and expected <= set(g), sorted(expected - set(g))
    # the HTTP API's port serves the same registry
    http = re.search(r"gateway http listening on (\S+)", stack["gateway"].output()).group(1)
    text = urllib.request.urlopen(f"http://{http}/metrics", timeout=10).read().decode()
    assert 'loraplex_gateway_requests_total{code="NOT_FOUND",method="Generate"} 1.0' in text


def test_compute_metrics(scrapes):
    c, mid, task = scrapes["compute"], scrapes["compute_mid"], str(scrapes["task_id"])
    assert value(mid, "loraplex_lora_requests_running", adapter=task) == 1
    info = mid["loraplex_lora_requests_info"][0][0]
    assert info["running_lora_adapters"] == task and int(info["max_lora"]) >= 1
    assert value(c, "loraplex_compute_time_to_first_token_seconds_count") == 4
    assert value(c, "loraplex_compute_inter_token_latency_seconds_count") == 5 + 5 + 39 + 3
    assert value(c, "loraplex_compute_e2e_request_latency_seconds_count") == 4
    assert value(c, "loraplex_compute_requests_finished_total", reason="length") == 4
    assert value(c, "loraplex_adapter_loads_total", tier="gpu", outcome="ok") == 1
    assert value(c, "loraplex_adapter_load_bytes_total", tier="gpu") > 1 << 20
    assert value(c, "loraplex_adapter_load_seconds_count", tier="gpu") == 1
    assert value(c, "loraplex_adapters_resident") == 1
    assert 0 < value(c, "loraplex_adapter_pool_usage_ratio") <= 1
    assert value(c, "loraplex_compute_kv_blocks_total") > 0
    assert value(c, "loraplex_compute_kv_cache_usage_ratio") == 0      # nothing running now
    assert value(c, "loraplex_compute_step_seconds_count") >= 40
    expected = documented("compute")
    assert len(expected) >= 25 and expected <= set(c) | set(mid), sorted(expected - (set(c) | set(mid)))


def test_cache_metrics(scrapes):
    h = scrapes["cache"]
    assert value(h, "loraplex_adapter_loads_total", tier="host", outcome="ok") == 1
    assert value(h, "loraplex_adapter_load_bytes_total", tier="host") > 1 << 20
    assert value(h, "loraplex_host_cache_hits_total") >= 1
    assert value(h, "loraplex_host_cache_misses_total") >= 0
    assert value(h, "loraplex_host_cache_evictions_total") == 0
    assert value(h, "loraplex_host_cache_bytes_used") >= value(h, "loraplex_adapter_load_bytes_total")
    assert value(h, "loraplex_host_cache_adapters") == 1
    expected = documented("cache")
    assert len(expected) >= 10 and expected <= set(h), sorted(expected - set(h))


def test_json_logs_carry_the_request_id_from_gateway_to_compute(stack, scrapes):
    def records(svc):
        return [json.loads(line) for line in svc.lines if line.startswith("{")]
    gw = [r for r in records(stack["gateway"]) if r.get("request_id") == REQUEST_ID]
    assert gw and gw[0]["service"] == "gateway" and gw[0]["level"] == "INFO"
    comp = [r for r in records(stack["compute"]) if r.get("request_id") == REQUEST_ID]
    assert {r["message"].split(":")[0] for r in comp} >= {"started", "finished (length)"}
