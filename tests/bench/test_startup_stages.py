"""bench/startup_stages.py (bench/startup.py, bench/serve_load.py) reads each start-up stage's seconds from the
compute service's log lines."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _startup():
    spec = importlib.util.spec_from_file_location("startup_stages", ROOT / "bench" / "startup_stages.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


COLD = """\
[compute] 2026-11-26 19:45:10,312 INFO compute_service.build: runtime built in 1.2 s (CUDA context 0.3 s, model 0.7 s)
[compute] 2026-11-26 19:45:21,936 INFO compute_service.warmup: warm-up: 12 launch classes in 9.0 s (plan saved to /x.json)
[compute] 2026-11-26 19:45:27,735 INFO compute_service.warmup: warm-up: 105/105 Triton programs compiled in 15 processes \
(102.7 s summed); recording took 3.1 s, the last programs 2.7 s more
[compute] 2026-11-26 19:45:31,111 INFO compute_service.warmup: warm-up: kernels compiled in 9.2 s (105 Triton programs)
[compute] 2026-11-26 19:45:33,050 INFO compute_service.warmup: warm-up: captured 16 decode CUDA graphs and 12 prefill \
CUDA graphs in 1.9 s
[compute] 2026-11-26 19:45:33,250 INFO compute_service.warmup: warm-up: real requests through the engine in 0.2 s
[compute] 2026-11-26 19:45:33,287 INFO compute_service.local_engine: start-up: SERVING 24.2 s after start (model 1.2 s)
"""


def test_a_cold_start_s_stages():
    got = _startup().stages(COLD)
    assert got == {"runtime_s": 1.2, "cuda_context_s": 0.3, "model_s": 0.7, "plan_s": 9.0, "pool_summed_s": 102.7,
                   "pool_recording_s": 3.1, "pool_tail_s": 2.7, "compile_pass_s": 9.2, "graphs_s": 1.9,
                   "engine_pass_s": 0.2, "compute_serving_s": 24.2, "pool_programs": 105, "pool_compiled": 105,
                   "pool_failed": 0, "plan_cached": False}


def test_programs_a_worker_failed_on_are_counted():
    # what the served 8B 4-bit start-up logged while the workers parsed the explicit-layout dialect as plain Triton
    failing = COLD.replace("105/105 Triton programs compiled in 15 processes (102.7 s summed);",
                           "93/105 Triton programs compiled in 15 processes (102.7 s summed); 12 left to the "
                           "warm-up (quant_wgmma_kernel: RuntimeError: error encountered during parsing);")
    got = _startup().stages(failing)
    assert (got["pool_programs"], got["pool_compiled"], got["pool_failed"]) == (105, 93, 12)
    assert got["pool_summed_s"] == 102.7 and got["pool_recording_s"] == 3.1


def test_a_warm_start_has_no_plan_or_pool_stage():
    warm = "\n".join(line for line in COLD.splitlines() if "launch classes" not in line and "processes" not in line)
    got = _startup().stages(warm + "\nwarm-up: plan from cache /x.json (12 launch classes)")
    assert got["plan_cached"] and "plan_s" not in got and "pool_summed_s" not in got
    assert got["compile_pass_s"] == 9.2 and got["compute_serving_s"] == 24.2


def test_a_cpu_start_has_no_cuda_context():
    got = _startup().stages("runtime built in 0.9 s (model 0.6 s, engine and KV cache 0.2 s, adapter pool 0.1 s)")
    assert got["runtime_s"] == 0.9 and got["model_s"] == 0.6 and "cuda_context_s" not in got
