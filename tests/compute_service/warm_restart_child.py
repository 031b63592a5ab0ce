"""A service start in its own process, for the warm-restart GPU test: builds the runtime on the GPU (CUDA graphs
on, as served), runs the full warm-up and prints what it did as one JSON line. Run as a script (the compile
pool's spawned workers import this module, so its work stays under `__main__`):

    python tests/compute_service/warm_restart_child.py MODEL_DIR QUANTIZATION [DEVICE]
"""
from __future__ import annotations

import json
import sys


def main(model_dir: str, quantization: str, device: str = "cuda") -> None:
    from compute_service.build import build_runtime
    from compute_service.config import ComputeConfig
    from compute_service.warmup import warm_up

    cfg = ComputeConfig(model=model_dir, device=device, max_model_len=96, kv_cache_bytes=1 << 20,
                        lora_gpu_cache_bytes=8 << 20, max_lora_rank=64, max_num_batched_tokens=256,
                        quantization=quantization)
    rt = build_runtime(cfg, None)
    report = warm_up(rt, "full")
    print(json.dumps(dict(compiled_kernels=report.compiled_kernels, pool=report.pool is not None,
                          graphs=report.num_graphs)))


if __name__ == "__main__":
    main(*sys.argv[1:4])
