"""The default model (SmolLM2-135M, GGUF Q4_1) on the GPU: kept 4-bit (`--quantization keep`, what `auto` does on a
GPU) against dequantized to bf16 (`none`), in-process engine, CUDA graphs on, greedy, `ignore_eos`.

Decode tok/s at batch 1 / 8 / 64 after a warm-up run of the same shape, and how often the two engines'
greedy tokens agree (the 4-bit engine uses the file's exact Q4_1 values; bf16 rounds them).

    python3 bench/default_model_quant.py --commit "$(git rev-parse --short HEAD)" --out x.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch

from compute_service.engine import EngineConfig, LLMEngine, SamplingParams

BATCHES = (1, 8, 64)
PROMPT_LEN, OUTPUT_LEN = 32, 128


def decode_tok_s(engine: LLMEngine, batch: int, seed: int) -> tuple[float, list[list[int]]]:
    """Output tok/s of `batch` prompts run to OUTPUT_LEN tokens (prefill included, small here)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 20000, (PROMPT_LEN,), generator=g).tolist() for _ in range(batch)]
    p = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, p)                                   # warm-up: same shapes, graphs captured
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(prompts, p)
    torch.cuda.synchronize()
    return batch * OUTPUT_LEN / (time.perf_counter() - t0), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "default_model_quant.json")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    res: dict = dict(device=torch.cuda.get_device_name(0), commit=args.commit, torch=torch.__version__,
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     model="SmolLM2-135M-Instruct.Q4_1.gguf", prompt_len=PROMPT_LEN, output_len=OUTPUT_LEN,
                     cases={})
    outputs = {}
    for mode in ("keep", "none"):
        engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", quantization=mode, max_num_seqs=max(batches),
                                        max_model_len=512))
        for batch in batches:
            tok_s, out = decode_tok_s(engine, batch, seed=batch)
            res["cases"].setdefault(mode, {})[str(batch)] = dict(tok_per_s=tok_s)
            outputs[(mode, batch)] = out
            print(f"{mode:5s} B={batch:3d} {tok_s:9.0f} tok/s", flush=True)
        del engine
        torch.cuda.empty_cache()
    for batch in batches:
        a, b = outputs[("keep", batch)], outputs[("none", batch)]
        same_prefix = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]
        res["cases"]["keep"][str(batch)].update(
            speedup_over_bf16=res["cases"]["keep"][str(batch)]["tok_per_s"] / res["cases"]["none"][str(batch)]["tok_per_s"],
            identical_streams=sum(a_ == b_ for a_, b_ in zip(a, b)) / batch,
            mean_equal_prefix=sum(same_prefix) / batch)
    print(json.dumps(res["cases"]["keep"], indent=1))
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
