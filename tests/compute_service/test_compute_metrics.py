"""Prometheus metrics of the compute service read live engine and pool state."""
from __future__ import annotations

import asyncio

from compute_helpers import random_adapter
from prometheus_client import generate_latest
from test_runner_workload import collect, make_runtime

from compute_service.engine.loader import load_model
from compute_service.engine.sampling_params import SamplingParams
from compute_service.metrics import ComputeMetrics


def _value(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_metrics_follow_pool_and_steps(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    adapter = random_adapter(loaded.spec, 8, seed=3)
    rt = make_runtime(loaded, tiny_model_dir, {3: adapter}, 2 << 20)
    metrics = ComputeMetrics(rt)
    metrics.attach()
    before = generate_latest(metrics.registry).decode()

    async def main():
        rt.runner.start()
        try:
            await collect(rt.runner, "m1", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0,
                                                                     ignore_eos=True), 3)
        finally:
            await rt.runner.stop()

    asyncio.run(main())
    after = generate_latest(metrics.registry).decode()
    assert _value(before, "loraplex_adapter_pool_pages_used") == 0
    assert _value(after, "loraplex_adapter_pool_pages_used") == rt.slots.stats().pages_used > 0
    assert _value(after, "loraplex_adapters_resident") == 1
    assert _value(after, "loraplex_adapter_pool_pages_total") == rt.slots.layout.num_pages
    assert _value(after, "loraplex_compute_kv_blocks_used") == 0
    assert _value(after, "loraplex_compute_step_seconds_count") >= 4
    assert _value(after, "loraplex_compute_tokens_per_step_sum") == 4
    # per sequence: one first token, three gaps, one end; one load into the pool of the adapter's bytes
    assert _value(after, "loraplex_compute_time_to_first_token_seconds_count") == 1
    assert _value(after, "loraplex_compute_inter_token_latency_seconds_count") == 3
    assert _value(after, "loraplex_compute_e2e_request_latency_seconds_count") == 1
    assert _value(after, "loraplex_compute_e2e_request_latency_seconds_sum") > 0
    assert 'loraplex_compute_requests_finished_total{reason="length"} 1.0' in after
    assert 'loraplex_adapter_loads_total{outcome="ok",tier="gpu"} 1.0' in after
    assert f'loraplex_adapter_load_bytes_total{{tier="gpu"}} {float(adapter.num_bytes)}' in after
    assert 'loraplex_adapter_load_seconds_count{tier="gpu"} 1.0' in after
    assert f'max_lora="{rt.slots.max_slots}",running_lora_adapters="",waiting_lora_adapters=""' in after


def test_per_adapter_gauges_count_running_and_waiting(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    adapters = {3: random_adapter(loaded.spec, 8, seed=3), 5: random_adapter(loaded.spec, 8, seed=5)}
    rt = make_runtime(loaded, tiny_model_dir, adapters, 2 << 20)
    metrics = ComputeMetrics(rt)
    for task in (3, 5):
        rt.engine.add_adapter(f"{task}@", adapters[task])
    rt.engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4), "3@")
    rt.engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=4), "5@")
    rt.engine.add_request("c", [1, 2, 3], SamplingParams(max_tokens=4), "5@")
    rt.engine.add_request("d", [1, 2, 3], SamplingParams(max_tokens=4))
    text = generate_latest(metrics.registry).decode()
    assert 'loraplex_lora_requests_waiting{adapter="3"} 1.0' in text
    assert 'loraplex_lora_requests_waiting{adapter="5"} 2.0' in text
    assert 'waiting_lora_adapters="3,5"' in text
    rt.engine.step()
    text = generate_latest(metrics.registry).decode()
    assert 'loraplex_lora_requests_running{adapter="5"} 2.0' in text
    assert 'running_lora_adapters="3,5"' in text
    assert _value(text, "loraplex_compute_running") == 4

