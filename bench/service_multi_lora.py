"""Multi-LoRA serving through the gRPC services: what the service layers cost over the bare engine.

The same Llama-3-8B-shaped random bf16 model as bench/multi_lora.py (its
builder), served by the real services on one machine:
- the host adapter cache (`python -m cache_service`, its own process, shm
  backend), validating adapters against the model's config.json;
- the compute service (`compute_service.server.serve`, the code `loraplex
  compute` runs) in this process, over the model already in GPU memory (the
  only difference from `loraplex serve`: the weights are not read from disk);
- a load generator in its own process: puts the adapters into the cache over
  gRPC, then streams `Compute.GenerateTokens` requests, each with its own
  adapter, 43 random prompt token ids, 100 greedy tokens (EOS ignored).
The gateway is left out: the random model has no tokenizer, and the compute
API already takes token ids, so the figures are engine + compute service
(asyncio loop, adapter cache, gRPC streaming) + the client's gRPC stack.

Per case and batch: tokens/s over the whole run (prefill included), time per
output token (from the moment every request had its first token to the last
token, as bench/multi_lora.py measures the engine) and median TTFT, next to
the engine's figures from bench/results/multi_lora.json.

    python3 bench/service_multi_lora.py --commit "$(git rev-parse HEAD)" --out bench/results/service_multi_lora.json
    .venv/bin/python bench/service_multi_lora.py --smoke --out /tmp/s.json     # checks the script on CPU
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from multi_lora import LLAMA3_8B, MODULE_IDS, QKV, SMOKE, build_hf, build_loaded, module_shape  # noqa: E402

# (name as in multi_lora.json, rank, modules, distinct adapter per request?)
CASES = [("base", 0, (), False), ("shared_r64_qkv", 64, QKV, False), ("distinct_r16_qkv", 16, QKV, True)]
ENGINE_RESULTS = ROOT / "bench" / "results" / "multi_lora.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_adapter(dims: dict, rank: int, modules: tuple[str, ...], seed: int, dtype: torch.dtype):
    """Converted form ([module, layer, rank] rows; A then B flattened per row), fresh random weights."""
    import numpy as np

    from loraplex.formats.adapter import Adapter

    gen = torch.Generator().manual_seed(seed)
    cfg, rows, in_out = [], [], []
    for layer in range(dims["num_hidden_layers"]):
        for m in modules:
            fin, fout = module_shape(dims, m)
            a = torch.randn(rank, fin, generator=gen) * fin ** -0.5
            b = torch.randn(fout, rank, generator=gen) * 0.02
            cfg.append([MODULE_IDS[m], layer, rank])
            rows.append(torch.cat([a.flatten(), b.flatten()]))
            in_out.append((fin, fout))
    w = torch.zeros(len(rows), max(r.numel() for r in rows), dtype=dtype)
    for i, r in enumerate(rows):
        w[i, : r.numel()] = r
    return Adapter(config=np.asarray(cfg, dtype=np.int32), weights=w, in_out=tuple(in_out))


# -- the load generator (its own process) -----------------------------------------------------------
async def stream_one(stub, pb, rid: str, prompt: list[int], ref, out_len: int, t0: float) -> dict:
    from loraplex.v1 import common_pb2

    req = pb.GenerateTokensRequest(request_id=rid, input_ids=prompt, sampling=common_pb2.SamplingParams(
        max_tokens=out_len, temperature=0.0, ignore_eos=True))
    if ref is not None:
        req.adapter.CopyFrom(ref)
    n, first, last = 0, None, None
    async for msg in stub.GenerateTokens(req):
        if msg.token_ids:
            last = time.perf_counter() - t0
            first = last if first is None else first
            n += len(msg.token_ids)
    return dict(n=n, first=first, last=last)


async def run_batch(stub, pb, refs: list, in_len: int, out_len: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (in_len,), generator=g).tolist() for _ in refs]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[stream_one(stub, pb, f"b{seed}-{i}", p, r, out_len, t0)
                                  for i, (p, r) in enumerate(zip(prompts, refs))])
    total = max(o["last"] for o in outs)
    n_tokens = sum(o["n"] for o in outs)
    assert n_tokens == len(refs) * out_len, (n_tokens, len(refs), out_len)
    all_started = max(o["first"] for o in outs)
    tpot = (total - all_started) / (out_len - 1)
    per_req = sorted((o["last"] - o["first"]) / (o["n"] - 1) for o in outs)
    ttft = sorted(o["first"] for o in outs)
    return dict(total_s=total, tok_per_s=n_tokens / total, ttft_s=ttft[len(ttft) // 2], tpot_ms=tpot * 1e3,
                decode_tok_per_s=len(refs) / tpot, tpot_per_request_ms=per_req[len(per_req) // 2] * 1e3)


async def client(args: argparse.Namespace) -> dict:
    import grpc

    from loraplex.cache_client import CacheClient
    from loraplex.v1 import compute_pb2 as pb
    from loraplex.v1 import compute_pb2_grpc

    dims = SMOKE if args.smoke else LLAMA3_8B
    dtype = torch.float32 if args.smoke else torch.bfloat16
    batches = [int(b) for b in args.batches.split(",")]
    res: dict = {}
    async with CacheClient(args.cache) as cache, grpc.aio.insecure_channel(args.compute) as ch:
        stub = compute_pb2_grpc.ComputeStub(ch)
        for ci, (name, rank, modules, distinct) in enumerate(CASES):
            refs: list = [None] * max(batches)
            if rank:
                t = time.perf_counter()
                n = max(batches) if distinct else 1
                put = [await cache.put_adapter(random_adapter(dims, rank, modules, 1000 * ci + i, dtype),
                                               1000 * ci + i) for i in range(n)]
                made = [pb.AdapterRef(task_id=p.adapter.task_id, version=p.adapter.version) for p in put]
                refs = [made[i % n] for i in range(max(batches))]
                for r in made:    # page them in ahead (their first request would do the same, later)
                    await stub.PrefetchAdapter(pb.PrefetchAdapterRequest(adapter=r))
                res.setdefault("put_s", {})[name] = time.perf_counter() - t
            for batch in batches:
                await run_batch(stub, pb, refs[:batch], args.in_len, 3, dims["vocab_size"], seed=1)   # warm-up
                r = await run_batch(stub, pb, refs[:batch], args.in_len, args.out_len, dims["vocab_size"], seed=2)
                r["distinct_adapters"] = len({(x.task_id, x.version) for x in refs[:batch] if x is not None})
                res.setdefault(name, {})[str(batch)] = r
                print(f"service {name:18s} B={batch:3d} {r['tok_per_s']:9.1f} tok/s  tpot {r['tpot_ms']:7.2f} ms"
                      f"  ttft {r['ttft_s'] * 1e3:7.1f} ms", flush=True)
            if rank:
                for i in range(max(batches) if distinct else 1):
                    await stub.DropAdapter(pb.DropAdapterRequest(task_id=1000 * ci + i))
    return res


# -- the orchestrator (this process serves Compute) --------------------------------------------------
def engine_figures(res: dict) -> None:
    """Puts the engine's own figures (bench/multi_lora.py's last H200 run) next to the service's."""
    if not ENGINE_RESULTS.is_file():
        return
    eng = json.loads(ENGINE_RESULTS.read_text())
    res["engine_results"] = dict(commit=eng.get("commit"), date=eng.get("date"), device=eng.get("device"))
    for name, per_batch in res["service"].items():
        if not isinstance(per_batch, dict) or name == "put_s":
            continue
        for batch, r in per_batch.items():
            e = eng.get("engine", {}).get(name, {}).get(batch)
            if e:
                r["engine"] = {k: e.get(k) for k in ("tok_per_s", "tpot_ms", "ttft_s", "gpu_step_ms")}
                r["tpot_over_engine"] = r["tpot_ms"] / e["tpot_ms"]
                r["tok_per_s_over_engine"] = r["tok_per_s"] / e["tok_per_s"]


async def orchestrate(args: argparse.Namespace, res: dict) -> None:
    from compute_service.config import ComputeConfig
    from compute_service.server import serve
    from loraplex.serving import wait_healthy

    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    dims = SMOKE if args.smoke else LLAMA3_8B
    batches = [int(b) for b in args.batches.split(",")]
    t = time.perf_counter()
    hf = build_hf(dims, dev, dtype)
    max_len = 256
    loaded, _ = await asyncio.to_thread(build_loaded, hf, dev, dtype, max_len)
    res["build_s"] = time.perf_counter() - t
    tmp = Path(tempfile.mkdtemp(prefix="svc-bench-"))
    hf.config.architectures = ["LlamaForCausalLM"]
    hf.config.save_pretrained(tmp)           # the cache validates adapters against this config
    cache_addr, compute_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cache = subprocess.Popen([sys.executable, "-m", "cache_service", "--listen", cache_addr, "--model", str(tmp),
                              "--host-cache-bytes", str(4 << 30), "--log-level", "WARNING"], env=env, cwd=ROOT)
    spec = loaded.spec
    kv_bytes = 2 * max(batches) * max_len * 2 * spec.num_layers * spec.kv_size * loaded.model.dtype.itemsize
    cfg = ComputeConfig(listen=compute_addr, cache_address=cache_addr, device=str(dev),
                        dtype="float32" if args.smoke else "bfloat16", max_num_seqs=max(batches),
                        max_num_batched_tokens=max(2048, max(batches) * args.in_len), max_model_len=max_len,
                        kv_cache_bytes=kv_bytes, max_lora_rank=64, lora_gpu_cache_bytes=(64 << 20) if args.smoke
                        else (3 << 30), max_resident_adapters=max(batches) + 8, log_level="WARNING")
    res["compute_config"] = {k: getattr(cfg, k) for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                                          "kv_cache_bytes", "lora_gpu_cache_bytes",
                                                          "gil_switch_interval_us")}
    server = asyncio.create_task(serve(cfg, loaded))
    try:
        t = time.perf_counter()
        await wait_healthy(cache_addr, 120)
        await wait_healthy(compute_addr, 600)
        res["compute_start_s"] = time.perf_counter() - t    # incl. pool allocation and graph capture
        out = Path(tempfile.mkstemp(suffix=".json")[1])
        cmd = [sys.executable, __file__, "--client", "--cache", cache_addr, "--compute", compute_addr,
               "--batches", args.batches, "--in-len", str(args.in_len), "--out-len", str(args.out_len),
               "--out", str(out)] + (["--smoke"] if args.smoke else [])
        proc = await asyncio.create_subprocess_exec(*cmd, env=env, cwd=ROOT)
        if await proc.wait() != 0:
            raise RuntimeError(f"load generator exited with {proc.returncode}")
        res["service"] = json.loads(out.read_text())
    finally:
        os.kill(os.getpid(), signal.SIGTERM)     # run_server's own shutdown path (drain, stop the runner)
        await server
        cache.terminate()
        cache.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--in-len", type=int, default=43)
    ap.add_argument("--out-len", type=int, default=100)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, no figures")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--compute", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke and args.out_len == 100:
        args.out_len = 8
    if args.client:
        res = asyncio.run(client(args))
        args.out.write_text(json.dumps(res, indent=1))
        return
    dev_name = "cpu" if args.smoke else torch.cuda.get_device_name(0)
    res: dict = dict(device=dev_name, commit=args.commit, torch=torch.__version__,
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     dims=SMOKE if args.smoke else LLAMA3_8B, input_len=args.in_len, output_len=args.out_len,
                     path="client process -> gRPC Compute.GenerateTokens (token ids, no gateway) -> compute service "
                          "(this process) -> adapters fetched from the cache service process over gRPC + shm")
    t = time.perf_counter()
    asyncio.run(orchestrate(args, res))
    res["wall_s"] = time.perf_counter() - t
    if not args.smoke:
        engine_figures(res)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "service"}, indent=1))


if __name__ == "__main__":
    main()
