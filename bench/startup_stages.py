"""The compute service's start-up stages, in seconds, read from its log lines (bench/startup.py and
bench/serve_load.py record them beside the time to healthy)."""
from __future__ import annotations

import re

STAGE_PATTERNS = {          # the compute service's start-up log lines, as seconds of each stage
    "runtime_s": r"runtime built in ([\d.]+) s",
    "cuda_context_s": r"runtime built in [\d.]+ s \(CUDA context ([\d.]+) s",
    "model_s": r"runtime built in [\d.]+ s \([^)]*\bmodel ([\d.]+) s",
    "plan_s": r"launch classes in ([\d.]+) s",
    "pool_summed_s": r"Triton programs compiled in \d+ processes \(([\d.]+) s summed\)",
    "pool_recording_s": r"recording took ([\d.]+) s",
    "pool_tail_s": r"the last programs ([\d.]+) s more",
    "compile_pass_s": r"kernels compiled in ([\d.]+) s",
    "graphs_s": r"CUDA graphs in ([\d.]+) s",
    "engine_pass_s": r"real requests through the engine in ([\d.]+) s",
    "compute_serving_s": r"SERVING ([\d.]+) s after start",
}


# the compile pool's line: programs compiled there / handed to it, and those left to the warm-up
POOL_PATTERN = (r"(\d+)/(\d+) Triton programs compiled in \d+ processes \([\d.]+ s summed\)"
                r"(?:; (\d+) left to the warm-up)?")


def stages(log_text: str) -> dict:
    """Seconds of each start-up stage the compute service logged (a stage it did not log is left out), the
    compile pool's counts (a program a worker failed on is compiled later by the service, one at a time), and
    whether the warm-up plan came from the cache."""
    out: dict = {}
    for name, pattern in STAGE_PATTERNS.items():
        m = re.search(pattern, log_text)
        if m:
            out[name] = float(m.group(1))
    m = re.search(POOL_PATTERN, log_text)
    if m:
        out.update(pool_compiled=int(m.group(1)), pool_programs=int(m.group(2)), pool_failed=int(m.group(3) or 0))
    out["plan_cached"] = "plan from cache" in log_text
    return out
