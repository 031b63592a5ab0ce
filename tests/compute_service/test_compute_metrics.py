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
    rt = make_runtime(loaded, tiny_model_dir, {3: random_adapter(loaded.spec, 8, seed=3)}, 2 << 20)
    metrics = ComputeMetrics(rt)
    rt.runner.on_step = metrics.on_step
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

