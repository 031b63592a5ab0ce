"""The engine's host work per step, part by part, at a batch of N decoding sequences.

Runs N requests of T greedy tokens through an in-process `LLMEngine` (a tiny random Llama by default, so
on the CPU the model's own time stays small; `--model` for a real one, `--device cuda` on a GPU) and times,
per step: the scheduler (`schedule`), the model (`model`: inputs, graph fill and launch, or the whole CPU
forward; `inputs`, the step's host lists, is also counted on its own), sampling (`sample`, queued on
the device), the scheduler's bookkeeping (`advance` at launch, `land` when the tokens are read back),
stop checks (`check_stop`), the per-request outputs (`delta`) and
the rest of the step (`other`: on a GPU this includes waiting for the step's tokens). Without overlapped
steps (`--async-scheduling`), every host millisecond here is a millisecond the GPU waits between two decode
steps.

    python bench/engine_host_step.py [--num-seqs 64] [--tokens 96] [--repeats 5] [--device cpu]
        [--async-scheduling] [--out x.json]
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import compute_service.engine.llm_engine as llm_engine  # noqa: E402
from compute_service.engine.config import EngineConfig  # noqa: E402
from compute_service.engine.llm_engine import LLMEngine  # noqa: E402
from compute_service.engine.sampling_params import SamplingParams  # noqa: E402

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8] * 4


def tiny_llama(folder: Path, max_positions: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


def timed(totals: collections.Counter, name: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=96, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds after one warm-up round")
    ap.add_argument("--model", default="", help="a model folder or GGUF (default: a tiny random Llama)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                    help="overlapped steps or plain ones (EngineConfig.async_scheduling; default: on with a GPU)")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_llama(Path(tmp) / "tiny", len(PROMPT) + args.tokens + 8))
        engine = LLMEngine(EngineConfig(model=model, device=args.device, max_num_seqs=args.num_seqs,
                                        max_model_len=len(PROMPT) + args.tokens + 8,
                                        async_scheduling=args.async_scheduling))
    totals: collections.Counter = collections.Counter()
    engine.scheduler.schedule = timed(totals, "schedule", engine.scheduler.schedule)
    engine.scheduler.schedule_decode = timed(totals, "schedule", engine.scheduler.schedule_decode)
    engine.scheduler.advance = timed(totals, "advance", engine.scheduler.advance)
    engine.scheduler.land = timed(totals, "land", engine.scheduler.land)
    engine.runner.run = timed(totals, "model", engine.runner.run)
    engine.runner.inputs = timed(totals, "inputs", engine.runner.inputs)
    engine._delta = timed(totals, "delta", engine._delta)
    llm_engine.sample_tokens = timed(totals, "sample", llm_engine.sample_tokens)
    llm_engine.check_stop = timed(totals, "check_stop", llm_engine.check_stop)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)

    def one_round(tag: str) -> tuple[int, float]:
        for i in range(args.num_seqs):
            engine.add_request(f"{tag}-{i}", PROMPT, params)
        steps, t = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        return steps, time.perf_counter() - t

    one_round("warm")
    rounds = []
    for r in range(args.repeats):
        totals.clear()
        steps, wall = one_round(f"r{r}")
        per_step = {k: v / steps * 1e3 for k, v in totals.items()}
        per_step["other"] = wall / steps * 1e3 - sum(v for k, v in per_step.items() if k != "inputs")
        per_step["step"] = wall / steps * 1e3
        rounds.append({"steps": steps, "ms_per_step": per_step})
    host_parts = ("schedule", "inputs", "advance", "land", "check_stop", "delta", "other")
    best = min(rounds, key=lambda r: sum(r["ms_per_step"][k] for k in host_parts))
    host = sum(best["ms_per_step"][k] for k in host_parts)
    print(f"{args.num_seqs} sequences, best of {args.repeats}: "
          + ", ".join(f"{k} {v:.3f}" for k, v in best["ms_per_step"].items()) + f" ms/step; host parts {host:.3f} ms")
    out = {"bench": "engine_host_step", "device": args.device, "commit": args.commit, "num_seqs": args.num_seqs,
           "async_scheduling": engine.overlap,
           "tokens": args.tokens, "model": args.model or "tiny random llama", "host_ms_per_step_best": host,
           "host_parts": list(host_parts), "rounds": rounds,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
