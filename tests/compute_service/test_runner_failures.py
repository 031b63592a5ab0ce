"""The runner survives a failing engine step: that step's requests fail, later ones run."""
from __future__ import annotations

import asyncio

import pytest
from test_runner_workload import collect, make_runtime

from compute_service.engine.loader import load_model
from compute_service.engine.sampling_params import SamplingParams


def test_failing_step_fails_its_requests_and_the_loop_goes_on(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    rt = make_runtime(loaded, tiny_model_dir, {}, 2 << 20)
    real_step, calls = rt.engine.step, {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fell over")
        return real_step()
    rt.engine.step = step
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def main():
        rt.runner.start()
        try:
            with pytest.raises(RuntimeError, match="device fell over"):
                await collect(rt.runner, "f1", [1, 2, 3], params, None)
            return await collect(rt.runner, "f2", [1, 2, 3], params, None)
        finally:
            await rt.runner.stop()

    toks, last = asyncio.run(main())
    assert len(toks) == 4 and last.finished
    assert rt.engine.stats().num_kv_blocks_used == 0 and rt.engine.stats().num_running == 0
