"""Served throughput and latency: `loraplex serve` under load vs the in-process engine, one run.

1. Starts the real system (`loraplex serve`: cache, compute, gateway) on a model
   (the default SmolLM2, any GGUF/HF folder, or a random model made here with a
   real tokenizer; with --quantize-bits a round-to-nearest 4- or 8-bit copy of it,
   made by `loraplex quantize`'s code) and an adapter root of random PEFT adapters written here
   (ranks cycling over --ranks, all seven projections), and waits for health.
2. Warms every adapter (one short request each) and, per case, runs a short
   warm-up of the same requests, then drives the case through the gateway with
   the public `AsyncClient` from --client-procs processes (each its own event
   loop; requests dealt round-robin). Workloads: `base`, `shared` (every stream
   the same adapter), `distinct` (each stream its own adapter). Arrivals:
   `burst` (all at once) and `poisson` (--poisson-factor x C requests at --rate
   per second, at most C in flight; rate 0 = 0.8 x the burst case's request
   rate). Prompts are fixed-length random token ids; outputs are greedy with
   the end-of-sequence token ignored, so every request makes --output-len tokens.
3. Stops the services, builds an `LLMEngine` on the same model in this process,
   loads the same adapters into its pool and runs the same prompts and
   concurrencies (burst: all added, stepped to the end).
4. Writes JSON (every figure, the flags, device, versions, commit, date) and a
   plot; served/engine ratios per case (bench/serve_load_stats.py says how each
   figure is computed).

    python3 bench/serve_load.py --out bench/results/serve_load.json --plot bench/results/serve_load.png
    python3 bench/serve_load.py --make-random-model /tmp/llama8b --shape 8b --lora-root /tmp/lora8b \
        --num-adapters 32 --arrivals burst --host-cache-bytes 17179869184 --lora-gpu-cache-bytes 17179869184 \
        --out bench/results/serve_load_8b.json --plot bench/results/serve_load_8b.png
    python3 bench/serve_load.py --make-random-model /tmp/llama8b --shape 8b --quantize-bits 4 \
        --lora-root /tmp/lora8b --num-adapters 32 --arrivals burst --out bench/results/serve_load_8b_w4.json
    python3 bench/serve_load.py --cpu --out /tmp/cpu.json          # CPU figures (smaller default cases)
    .venv/bin/python bench/serve_load.py --smoke --out /tmp/s.json  # checks the script on CPU in < 1 min
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serve_load_client import ClientPool, Request  # noqa: E402
from serve_load_proc import ServeProcess  # noqa: E402
from serve_load_setup import SHAPES, make_prompts, make_random_model, write_adapters  # noqa: E402
from serve_load_stats import plot, ratios, step_figures, summarize  # noqa: E402
from startup_stages import stages  # noqa: E402

from loraplex.cli.quantize import FORMATS as QUANTIZE_FORMATS  # noqa: E402  (no torch: argparse stays quick)

WORKLOADS = ("base", "shared", "distinct")
ARRIVALS = ("burst", "poisson")
# Defaults per mode: (concurrency, workloads, arrivals, adapters, output length, host cache, adapter pool)
MODES = {"gpu": ("1,8,32,64,128,256", "base,shared,distinct", "burst,poisson", 64, 100, 8 << 30, 8 << 30),
         "cpu": ("1,8", "base,distinct", "burst", 8, 32, 2 << 30, 1 << 30),
         "smoke": ("1,4", "base,shared,distinct", "burst,poisson", 4, 8, 256 << 20, 64 << 20)}


IDLE_TTFT_REQUESTS = 16    # the idle-TTFT figure: this many short requests, one at a time,
IDLE_TTFT_GAP_S = 0.05      # this far apart


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="results JSON")
    ap.add_argument("--plot", type=Path, help="PNG: served vs engine tok/s and ITL by concurrency")
    ap.add_argument("--model", default="", help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--make-random-model", type=Path, metavar="DIR",
                    help="write a random model with a tokenizer into DIR (kept if DIR has one) and serve it")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="shape of --make-random-model")
    ap.add_argument("--lora-root", type=Path, help="adapter root to write the adapters into (default: a temp dir)")
    ap.add_argument("--num-adapters", type=int, help="distinct adapters (default 64; cpu 8; smoke 4)")
    ap.add_argument("--ranks", default="8,16,32,64", help="adapter ranks, cycled")
    ap.add_argument("--max-lora-rank", type=int,
                    help="the pool's largest rank, both sides (default: the largest of --ranks; a server's own "
                         "default is 256)")
    ap.add_argument("--concurrency", help="comma-separated stream counts (default 1,8,32,64,128,256)")
    ap.add_argument("--workloads", help=f"subset of {','.join(WORKLOADS)}")
    ap.add_argument("--arrivals", help=f"subset of {','.join(ARRIVALS)}")
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson requests/s (0: 0.8 x the burst request rate)")
    ap.add_argument("--poisson-factor", type=int, default=2, help="Poisson cases send this many x C requests")
    ap.add_argument("--prompt-len", type=int, default=34)
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy), served and engine alike")
    ap.add_argument("--top-p", type=float, default=1.0, help="every request's top-p (1: off)")
    ap.add_argument("--output-len", type=int, help="output tokens per request (default 100; cpu 32; smoke 8)")
    ap.add_argument("--client-procs", type=int, default=4, help="load-generator processes")
    ap.add_argument("--client-connections", type=int, default=1,
                    help="TCP connections of each load-generator process (AsyncClient(connections=N))")
    ap.add_argument("--max-model-len", type=int, default=512, help="served and engine alike")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="served and engine alike")
    ap.add_argument("--host-cache-bytes", type=int, help="host adapter cache budget (default 8 GiB; cpu 2 GiB)")
    ap.add_argument("--lora-gpu-cache-bytes", type=int,
                    help="served adapter pool (default 8 GiB; cpu 1 GiB; 0: the service's default fraction)")
    ap.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                    help="overlapped decode steps or plain ones, in the served compute service and the in-process "
                         "engine alike (default: the service's own default, on with a GPU)")
    ap.add_argument("--quantization", default="auto", choices=("auto", "keep", "none"),
                    help="the base model's quantization, served and engine alike")
    ap.add_argument("--quantize-bits", type=int, choices=(4, 8),
                    help="serve a round-to-nearest copy of the model at these bits (`loraplex quantize`, into a "
                         "sibling folder of --make-random-model or a temp dir; kept and reused)")
    ap.add_argument("--quantize-group-size", type=int, default=128, help="group size of --quantize-bits")
    ap.add_argument("--quantize-format", default="compressed-tensors", choices=QUANTIZE_FORMATS,
                    help="layout of --quantize-bits' copy (default compressed-tensors)")
    ap.add_argument("--act-order-seed", type=int,
                    help="with --quantize-format gptq: an act-order (desc_act) layout, each input's channels in a "
                         "random order from this seed (`quantize_checkpoint`'s act_order_seed)")
    ap.add_argument("--step-trace", type=Path, help="where the compute service writes its step trace "
                    "(default: a temp file)")
    ap.add_argument("--serve-flags", default="", help="more `loraplex serve` flags")
    ap.add_argument("--compute-flags", default="", help="more compute-service flags (appended to --compute-flags)")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--cpu", action="store_true", help="serve and run the engine on the CPU")
    ap.add_argument("--smoke", action="store_true", help="tiny random model on the CPU: checks the script")
    ap.add_argument("--skip-engine", action="store_true", help="served figures only")
    ap.add_argument("--prepare-only", action="store_true",
                    help="write the model (--make-random-model) and the adapters (--lora-root), then stop")
    ap.add_argument("--plot-only", type=Path, metavar="JSON", help="re-plot a results JSON into --plot")
    ap.add_argument("--commit", default="", help="commit to record (default: git rev-parse HEAD)")
    args = ap.parse_args(argv)
    mode = "smoke" if args.smoke else "cpu" if args.cpu else "gpu"
    conc, workloads, arrivals, num_adapters, out_len, host_bytes, pool_bytes = MODES[mode]
    args.concurrency = [int(c) for c in (args.concurrency or conc).split(",")]
    args.workloads = (args.workloads or workloads).split(",")
    args.arrivals = (args.arrivals or arrivals).split(",")
    args.num_adapters = num_adapters if args.num_adapters is None else args.num_adapters
    args.output_len = args.output_len or out_len
    args.host_cache_bytes = host_bytes if args.host_cache_bytes is None else args.host_cache_bytes
    args.lora_gpu_cache_bytes = pool_bytes if args.lora_gpu_cache_bytes is None else args.lora_gpu_cache_bytes
    args.ranks = [int(r) for r in args.ranks.split(",")]
    if args.smoke:
        args.ranks, args.client_procs = [8, 16], min(args.client_procs, 2)
    args.max_lora_rank = args.max_lora_rank or max(args.ranks)
    if args.max_lora_rank < max(args.ranks):
        ap.error(f"--max-lora-rank {args.max_lora_rank} is below the adapters' rank {max(args.ranks)}")
    args.device = "cpu" if args.smoke or args.cpu else "auto"
    bad = set(args.workloads) - set(WORKLOADS) | set(args.arrivals) - set(ARRIVALS)
    if bad:
        ap.error(f"unknown workload or arrival {sorted(bad)}")
    if args.num_adapters < 1 and {"shared", "distinct"} & set(args.workloads):
        ap.error("the shared and distinct workloads need --num-adapters >= 1")
    return args


def case_requests(workload: str, prompts: list[list[int]], adapters: list[str],
                  offsets: list[float]) -> list[Request]:
    """Request i: prompt i, its adapter (none, the first, or adapter i mod the count), arrival offset i."""
    def lora(i: int) -> str | None:
        return None if workload == "base" else adapters[0] if workload == "shared" else adapters[i % len(adapters)]
    return [Request(i, prompts[i % len(prompts)], lora(i), off) for i, off in enumerate(offsets)]


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def serve_argv(args: argparse.Namespace, model: str, lora_root: Path) -> list[str]:
    compute = (f"--max-num-seqs {max(args.concurrency)} --max-num-batched-tokens {args.max_num_batched_tokens} "
               f"--quantization {args.quantization} --step-trace {shlex.quote(str(args.step_trace))} "
               + (f"--lora-gpu-cache-bytes {args.lora_gpu_cache_bytes} " if args.lora_gpu_cache_bytes else "")
               + ({True: "--async-scheduling ", False: "--no-async-scheduling ", None: ""}[args.async_scheduling])
               + args.compute_flags)
    return (["--lora-root", str(lora_root), "--device", args.device,
             "--max-model-len", str(args.max_model_len), "--max-lora-rank", str(args.max_lora_rank),
             "--host-cache-bytes", str(args.host_cache_bytes), "--startup-timeout", str(args.startup_timeout),
             "--compute-flags", compute]
            + (["--model", model] if model else []) + shlex.split(args.serve_flags))


def run_served(args: argparse.Namespace, model: str, lora_root: Path, adapters: list[str], res: dict,
               save) -> list[list[int]]:
    """Starts `loraplex serve`, runs every served case, stops it; returns the prompts it used."""
    from loraplex.client import Client

    svc = ServeProcess(serve_argv(args, model, lora_root), args.startup_timeout)
    pool = None
    try:
        res["served_start_s"] = svc.start_s
        res["served_start_stages"] = stages("".join(svc.startup_lines))     # the compute service's own figures
        with Client(svc.address, timeout=600) as client:
            info = client.model_info()
        res["model_info"] = dict(name=info.model_name, vocab_size=info.vocab_size, num_layers=info.num_layers,
                                 hidden_size=info.hidden_size, dtype=info.dtype, device=info.device)
        prompts = make_prompts(max(args.concurrency) * max(1, args.poisson_factor), args.prompt_len,
                               info.vocab_size)
        pool = ClientPool(svc.address, args.client_procs, args.client_connections)
        sampling = dict(max_tokens=args.output_len, temperature=args.temperature, top_p=args.top_p, ignore_eos=True)
        # The very first request after health, before any warm-up: is it as fast as the later C=1 base case?
        res["first_request"] = summarize(pool.run(case_requests("base", prompts, adapters, [0.0]), 1, sampling))
        if adapters and {"shared", "distinct"} & set(args.workloads):
            t = time.perf_counter()
            warm = case_requests("distinct", prompts, adapters, [0.0] * len(adapters))
            summary = summarize(pool.run(warm, len(adapters), dict(sampling, max_tokens=2)))
            res["adapters_warm_s"] = time.perf_counter() - t
            res["adapters_first_use"] = summary    # each adapter's first request, all at once (cold loads)
            if summary["num_failed"]:
                raise RuntimeError(f"adapter warm-up failed: {summary['errors']}")
        for workload in args.workloads:
            for conc in args.concurrency:
                for arrival in args.arrivals:
                    try:
                        r = served_case(pool, args, workload, conc, arrival, prompts, adapters, sampling, res)
                        res["served"].setdefault(workload, {}).setdefault(arrival, {})[str(conc)] = r
                        print_case("served", workload, arrival, conc, r)
                    except Exception as exc:  # keep the other cases; the error goes into the results
                        res["errors"].append(f"served {workload} {arrival} C={conc}: {exc!r}")
                        traceback.print_exc()
                    save()
        for workload in idle_workloads(args):
            r = summarize(pool.run(case_requests(workload, prompts, adapters, idle_offsets()), 1,
                                   dict(sampling, max_tokens=2)))
            res.setdefault("idle_ttft", {})[workload] = r
            print_idle("served", workload, r)
            save()
        return prompts
    finally:
        if pool is not None:
            pool.close()
        res["served_exit_code"] = svc.stop(60)
        if res["served_exit_code"] != 0:
            print(svc.tail(), file=sys.stderr)
        add_step_figures(res, args.step_trace)


def add_step_figures(res: dict, trace_path: Path) -> None:
    """The compute service's engine-step host times (its --step-trace, written at shutdown) per served case."""
    if not trace_path.is_file():
        res["errors"].append(f"no step trace at {trace_path}")
        return
    trace = json.loads(trace_path.read_text())
    for by_arrival in res["served"].values():
        for by_conc in by_arrival.values():
            for r in by_conc.values():
                if "window" in r:
                    r.update(step_figures(trace, *r["window"]))


def served_case(pool: ClientPool, args: argparse.Namespace, workload: str, conc: int, arrival: str,
                prompts: list[list[int]], adapters: list[str], sampling: dict, res: dict) -> dict:
    if arrival == "burst":
        reqs = case_requests(workload, prompts, adapters, [0.0] * conc)
        pool.run(reqs, conc, dict(sampling, max_tokens=3))      # warm-up: same batch shapes, few tokens
        t = time.monotonic()
        return dict(summarize(pool.run(reqs, conc, sampling)), window=(t, time.monotonic()))
    rate = args.rate
    if not rate:
        burst = res["served"].get(workload, {}).get("burst", {}).get(str(conc), {})
        if not burst.get("requests_per_s"):
            raise RuntimeError("poisson with --rate 0 needs the burst case of the same workload and concurrency")
        rate = 0.8 * burst["requests_per_s"]
    n = conc * max(1, args.poisson_factor)
    reqs = case_requests(workload, prompts, adapters, poisson_offsets(n, rate, seed=conc))
    t = time.monotonic()
    return dict(summarize(pool.run(reqs, conc, sampling)), rate_per_s=rate, max_in_flight=conc,
                window=(t, time.monotonic()))


def run_engine(args: argparse.Namespace, model: str, lora_root: Path, adapters: list[str],
               prompts: list[list[int]], res: dict, save) -> None:
    """The same model, adapters, prompts, concurrencies and arrivals on the in-process engine."""
    import torch

    from serve_load_engine import build_engine, load_adapters, measure

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else "cpu"
    t = time.perf_counter()
    engine, res["engine_warmup_s"] = build_engine(
        model, device, max_num_seqs=max(args.concurrency), max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, max_lora_rank=args.max_lora_rank, pool_bytes=args.lora_gpu_cache_bytes,
        quantization=args.quantization, async_scheduling=args.async_scheduling)
    res["engine_build_s"] = time.perf_counter() - t
    if adapters and {"shared", "distinct"} & set(args.workloads):
        res["engine_adapters_load_s"] = load_adapters(engine, lora_root, adapters)
    for workload in args.workloads:
        for conc in args.concurrency:
            for arrival in args.arrivals:
                try:
                    engine_case(engine, args, workload, conc, arrival, prompts, adapters, res)
                except Exception as exc:
                    res["errors"].append(f"engine {workload} {arrival} C={conc}: {exc!r}")
                    traceback.print_exc()
                save()
    for workload in idle_workloads(args):
        r = measure(engine, case_requests(workload, prompts, adapters, idle_offsets()), 2, f"{workload}-idle",
                    max_in_flight=1, sampling=engine_sampling(args))
        res.setdefault("engine_idle_ttft", {})[workload] = r
        print_idle("engine", workload, r)
        save()


def engine_sampling(args: argparse.Namespace) -> dict:
    """The requests' sampling on the engine side, as the served side sends it."""
    return dict(temperature=args.temperature, top_p=args.top_p)


def idle_workloads(args: argparse.Namespace) -> list[str]:
    """The workloads of the idle-TTFT figure: base, and distinct adapters when there are any."""
    return [w for w in ("base", "distinct") if w in args.workloads]


def idle_offsets() -> list[float]:
    """IDLE_TTFT_REQUESTS arrivals IDLE_TTFT_GAP_S apart, one in flight at a time: time to first token of a
    short request on an idle server, with enough samples for a p50/p90 (a C=1 case has one or two)."""
    return [i * IDLE_TTFT_GAP_S for i in range(IDLE_TTFT_REQUESTS)]


def print_idle(side: str, workload: str, r: dict) -> None:
    t = r["ttft_ms"]
    print(f"{side:6s} {workload:8s} idle TTFT p50/p90 {t['p50'] or 0:7.2f}/{t['p90'] or 0:7.2f} ms over "
          f"{r['num_requests']} requests" + (f"  failed {r['num_failed']}" if r["num_failed"] else ""), flush=True)


def engine_case(engine, args: argparse.Namespace, workload: str, conc: int, arrival: str,
                prompts: list[list[int]], adapters: list[str], res: dict) -> None:
    """One case on the engine: a burst (into res["engine"], with the served/engine ratios), or the served
    Poisson case's very arrivals and cap (into res["engine_poisson"])."""
    from serve_load_engine import measure

    if arrival == "burst":
        r = measure(engine, case_requests(workload, prompts, adapters, [0.0] * conc), args.output_len,
                    f"{workload}-{conc}", sampling=engine_sampling(args))
        res["engine"].setdefault(workload, {})[str(conc)] = r
        served = res["served"].get(workload, {}).get("burst", {}).get(str(conc))
        if served:
            res["ratios"].setdefault(workload, {})[str(conc)] = ratios(served, r)
    else:
        rate = res["served"].get(workload, {}).get("poisson", {}).get(str(conc), {}).get("rate_per_s")
        if not rate:
            raise RuntimeError("the engine's Poisson case takes the served case's rate; it has none")
        offsets = poisson_offsets(conc * max(1, args.poisson_factor), rate, seed=conc)
        r = dict(measure(engine, case_requests(workload, prompts, adapters, offsets), args.output_len,
                         f"{workload}-{conc}p", max_in_flight=conc, sampling=engine_sampling(args)),
                 rate_per_s=rate, max_in_flight=conc)
        res.setdefault("engine_poisson", {}).setdefault(workload, {})[str(conc)] = r
    print_case("engine", workload, arrival, conc, r)


def print_case(side: str, workload: str, arrival: str, conc: int, r: dict) -> None:
    if not r.get("output_tokens"):
        print(f"{side:6s} {workload:8s} {arrival:7s} C={conc:3d} failed: {r.get('errors')}", flush=True)
        return
    print(f"{side:6s} {workload:8s} {arrival:7s} C={conc:3d} {r['output_tok_per_s']:9.1f} tok/s "
          f"(decode {r['decode_tok_per_s'] or 0:9.1f})  TTFT p50 {r['ttft_ms']['p50']:8.1f} ms  "
          f"ITL p50/p99 {r['itl_ms']['p50'] or 0:6.2f}/{r['itl_ms']['p99'] or 0:6.2f} ms  "
          f"e2e p99 {r['e2e_ms']['p99']:8.1f} ms" + (f"  failed {r['num_failed']}" if r["num_failed"] else ""),
          flush=True)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def environment(args: argparse.Namespace) -> dict:
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    on_gpu = args.device == "auto" and torch.cuda.is_available()
    return dict(device=torch.cuda.get_device_name(0) if on_gpu else f"cpu ({os.cpu_count()} cores)",
                torch=torch.__version__, triton=triton_version)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.plot_only:
        res = json.loads(args.plot_only.read_text())
        plot(res, args.plot or args.plot_only.with_suffix(".png"))
        return res
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="serve-load-"))
    model = args.model
    if args.smoke:
        model = str(make_random_model(tmp / "tiny-model", "tiny", dtype="float32"))
    elif args.make_random_model:
        if not (args.make_random_model / "config.json").is_file():
            make_random_model(args.make_random_model, args.shape,
                              device="cuda" if not args.cpu and _has_cuda() else "cpu")
        model = str(args.make_random_model)
    source = model
    if args.quantize_bits:
        model = quantized_copy(model, args, tmp)
    lora_root = args.lora_root or tmp / "adapters"
    args.step_trace = args.step_trace or tmp / "steps.json"
    ranks = write_adapters(lora_root, model, args.num_adapters, args.ranks) if args.num_adapters else {}
    if args.prepare_only:
        print(f"model {model or 'default'}, {len(ranks)} adapters under {lora_root}: {time.perf_counter() - t_start:.0f}s")
        return {}
    res: dict = dict(environment(args), commit=args.commit or git_commit(),
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     model=model or "SmolLM2-135M-Instruct (default)", adapters=ranks, max_lora_rank=args.max_lora_rank,
                     quantized_from=(source or "SmolLM2-135M-Instruct (default)") if args.quantize_bits else None,
                     flags={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     setup_s=time.perf_counter() - t_start, served={}, engine={}, ratios={}, errors=[])

    def save() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(res, indent=1))

    adapters = list(ranks)
    prompts = run_served(args, model, lora_root, adapters, res, save)
    if not args.skip_engine:
        run_engine(args, model, lora_root, adapters, prompts, res, save)
    res["wall_s"] = time.perf_counter() - t_start
    save()
    if args.plot:
        plot(res, args.plot)
    print(json.dumps(res["ratios"], indent=1))
    return res


def quantized_copy(model: str, args: argparse.Namespace, tmp: Path) -> str:
    """`model` (a path, or "" for the default) quantized round-to-nearest by `loraplex quantize`'s code into
    `<random model dir>-w<bits>g<group>` (reused when complete) or a temp folder; returns its path."""
    from compute_service.build import resolve_device
    from compute_service.engine.quant_formats.export import quantize_checkpoint
    from loraplex.model_files import resolve_model_path

    if args.act_order_seed is not None and args.quantize_format != "gptq":
        raise SystemExit("--act-order-seed needs --quantize-format gptq")
    tag = f"w{args.quantize_bits}g{args.quantize_group_size}"
    if args.quantize_format != "compressed-tensors":
        tag += f"-{args.quantize_format}" + ("" if args.act_order_seed is None else f"-ao{args.act_order_seed}")
    base = args.make_random_model if args.make_random_model and not args.smoke else None
    out = base.with_name(f"{base.name}-{tag}") if base else tmp / f"model-{tag}"
    if not ((out / "config.json").is_file() and (out / "model.safetensors").is_file()):
        t0 = time.perf_counter()
        r = quantize_checkpoint(resolve_model_path(model), out, bits=args.quantize_bits,
                                group_size=args.quantize_group_size, device=resolve_device(args.device),
                                fmt=args.quantize_format, act_order_seed=args.act_order_seed, progress=False)
        print(f"quantized {model or 'the default model'} -> {out}: {r.num_quantized} projections "
              f"({r.quantized_bytes / 2**30:.2f} GiB), {len(r.not_converted)} kept dense, "
              f"{time.perf_counter() - t0:.0f}s", flush=True)
    return str(out)


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
