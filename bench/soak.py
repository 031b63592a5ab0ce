"""Soak and faults: the real services under many streams, cancels, deadlines, kills and restarts.

Runs the scenarios of bench/soak_scenarios.py against real processes (bench/soak_stack.py) on a tiny
random model with a byte-level tokenizer, or on any model given with --model:

1. the soak system (one compute replica, shm host cache, an adapter pool that holds --pool-adapters
   of the --num-adapters adapters, a small KV cache so sequences are preempted):
   `streams` (--streams concurrent streams, --cancel-frac cancelled by their client after a random
   number of tokens, --deadline-frac with a deadline), `small_pool` (every output equals its alone
   run while adapters are evicted and loaded again), `stalled_reader`;
2. the fault system (two compute replicas, the redis backend when redis-server is installed):
   `kill_cache` (SIGKILL mid-load, restart on the same address), `restart_redis`, `kill_compute`
   (SIGKILL of one replica under streams and a burst of new requests).

After each scenario the services are asked what they still hold (KV blocks, sequences, adapter pins,
shared-memory segments): a leak is any figure not back to zero. Prints one line per scenario and
writes every figure to --out (JSON: streams held, cancels, deadlines, faults injected, leaks found,
latency percentiles, problems), with the commit, device and date. Exit code 1 when a scenario found
a problem.

    .venv/bin/python bench/soak.py --out /tmp/soak.json                  # CPU: 1,000 streams, ~2 min
    python3 bench/soak.py --device cuda --streams 10000 --max-tokens 64 --num-adapters 64 \\
        --pool-adapters 16 --out bench/results/soak_gpu.json              # the larger GPU run
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import soak_scenarios as sc  # noqa: E402
from serve_load import environment, git_commit  # noqa: E402
from soak_stack import Stack, make_model, redis_available, write_adapters  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="results JSON")
    ap.add_argument("--model", default="", help="HF folder or GGUF to serve (default: a tiny random model)")
    ap.add_argument("--device", default="cpu", help="compute device: cpu, cuda or auto")
    ap.add_argument("--streams", type=int, default=1000, help="concurrent streams of the soak")
    ap.add_argument("--rounds", type=int, default=1, help="soak rounds (each --streams streams, new seed)")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens of a soak stream")
    ap.add_argument("--cancel-frac", type=float, default=0.2, help="streams their client cancels")
    ap.add_argument("--deadline-frac", type=float, default=0.2, help="streams with a deadline (0.05-1.5 s)")
    ap.add_argument("--num-adapters", type=int, default=6, help="adapters in the working set")
    ap.add_argument("--pool-adapters", type=int, default=2, help="adapters the GPU pool holds at once")
    ap.add_argument("--small-pool-streams", type=int, default=200, help="streams of the small-pool scenario")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-cache-bytes", type=int, default=2 << 20,
                    help="soak replica's KV cache (small: sequences are preempted; 0: the service's default)")
    ap.add_argument("--stalled-tokens", type=int, default=12000, help="max_tokens of the stalled stream")
    ap.add_argument("--kill-streams", type=int, default=8, help="long streams when a compute replica is killed")
    ap.add_argument("--kill-burst", type=int, default=64, help="short requests arriving as it dies")
    ap.add_argument("--dtype", default="float32",
                    help="compute dtype; the outputs are compared token for token with each request run alone, "
                         "which holds in float32 (bf16 on a GPU flips greedy near-ties between batch shapes)")
    ap.add_argument("--scenarios", default="streams,small_pool,stalled_reader,kill_cache,restart_redis,kill_compute")
    ap.add_argument("--commit", default="", help="commit to record (default: git rev-parse HEAD)")
    return ap.parse_args(argv)


def soak_flags(args: argparse.Namespace) -> tuple[str, ...]:
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-resident-adapters", str(args.pool_adapters),
             "--max-model-len", "512", "--dtype", args.dtype]
    if args.kv_cache_bytes:
        flags += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    return tuple(flags)


def run_scenario(res: dict, name: str, fn: Callable[[], dict[str, Any]], save: Callable[[], None]) -> None:
    t0 = time.monotonic()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - the other scenarios still run; the error is a finding
        traceback.print_exc()
        out = {"problems": [f"the scenario failed: {exc!r}"]}
    out["scenario_s"] = time.monotonic() - t0
    res["scenarios"].setdefault(name, []).append(out)
    leaks = {k: v for k, v in out.get("leaks", {}).items() if v}
    res["leaks_found"] += len(leaks)
    res["problems"] += [f"{name}: {p}" for p in out["problems"]]
    codes = out.get("codes") or out.get("loads_while_killed") or out.get("burst_at_kill") or ""
    print(f"{name:15s} {out['scenario_s']:6.1f}s  problems {len(out['problems'])}  leaks {len(leaks)}  {codes}",
          flush=True)
    save()


def run_soak(args: argparse.Namespace, model: Path, root: Path, names: list[str], res: dict, save) -> None:
    wanted = set(args.scenarios.split(","))
    if not wanted & {"streams", "small_pool"}:
        return
    stack = Stack.start(model, root, device=args.device, compute_flags=soak_flags(args))
    try:
        for r in range(args.rounds if "streams" in wanted else 0):
            run_scenario(res, "streams", lambda: sc.streams(
                stack, args.streams, names, max_tokens=args.max_tokens, cancel_frac=args.cancel_frac,
                deadline_frac=args.deadline_frac, seed=r), save)
            s = res["scenarios"]["streams"][-1]
            res["streams_held"] += s.get("streams", 0)
            res["cancels"] += s.get("cancels", 0)
            res["deadlines"] += s.get("deadlines", 0)
        if "small_pool" in wanted:
            run_scenario(res, "small_pool", lambda: sc.small_pool(stack, args.small_pool_streams, names), save)
            res["streams_held"] += res["scenarios"]["small_pool"][-1].get("streams", 0)
    finally:
        stack.stop()


def run_faults(args: argparse.Namespace, model: Path, root: Path, names: list[str], res: dict, save) -> None:
    wanted = set(args.scenarios.split(","))
    if not wanted & {"stalled_reader", "kill_cache", "restart_redis", "kill_compute"}:
        return
    backend = "redis" if redis_available() else "shm"
    res["fault_backend"] = backend
    # the stalled stream outgrows the gateway's buffer: the model length holds it
    max_len = max(8192, args.stalled_tokens + 64)
    stack = Stack.start(model, root, num_computes=2, backend=backend, device=args.device,
                        compute_flags=("--max-model-len", str(max_len), "--max-num-seqs", str(args.max_num_seqs),
                                       "--dtype", args.dtype,
                                       *(("--kv-cache-bytes", str(args.kv_cache_bytes)) if args.kv_cache_bytes else ())),
                        gateway_flags=("--replica-health-interval-s", "600"))
    fresh = names[-4:]     # adapters no request on this system used yet: loading them needs the cache
    try:
        if "stalled_reader" in wanted:
            run_scenario(res, "stalled_reader", lambda: sc.stalled_reader(
                stack, stalled_tokens=args.stalled_tokens), save)
            res["faults_injected"]["stalled_reader"] = 1
        if "kill_cache" in wanted:
            run_scenario(res, "kill_cache", lambda: sc.kill_cache(stack, fresh[:2]), save)
            res["faults_injected"]["kill_cache"] = 1
        if "restart_redis" in wanted:
            if stack.redis is None:
                res["skipped"].append("restart_redis: redis-server is not installed")
            else:
                run_scenario(res, "restart_redis", lambda: sc.restart_redis(stack, fresh[2:]), save)
                res["faults_injected"]["restart_redis"] = 1
        if "kill_compute" in wanted:
            run_scenario(res, "kill_compute", lambda: sc.kill_compute(
                stack, names[:2], num_streams=args.kill_streams, num_burst=args.kill_burst), save)
            res["faults_injected"]["kill_compute"] = 1
            res["streams_held"] += args.kill_streams + args.kill_burst
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    model = Path(args.model) if args.model else make_model(tmp / "model")
    if args.num_adapters < 4:
        raise SystemExit("--num-adapters must be at least 4 (the fault scenarios load four fresh ones)")
    names = write_adapters(tmp / "adapters", model, args.num_adapters)
    env = environment(argparse.Namespace(device="auto" if args.device != "cpu" else "cpu"))
    res: dict[str, Any] = dict(env, commit=args.commit or git_commit(),
                               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               model=args.model or "tiny random (bench/soak_stack.py)",
                               flags={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                               streams_held=0, cancels=0, deadlines=0, faults_injected={}, leaks_found=0,
                               problems=[], skipped=[], scenarios={})

    def save() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(res, indent=1))

    run_soak(args, model, tmp / "adapters", names, res, save)
    run_faults(args, model, tmp / "adapters", names, res, save)
    res["wall_s"] = time.monotonic() - t0
    save()
    print(f"streams held {res['streams_held']}, cancels {res['cancels']}, deadlines {res['deadlines']}, "
          f"faults injected {sum(res['faults_injected'].values())}, leaks found {res['leaks_found']}, "
          f"problems {len(res['problems'])} in {res['wall_s']:.0f}s", flush=True)
    for p in res["problems"]:
        print(f"  PROBLEM {p}", flush=True)
    return res


if __name__ == "__main__":
    sys.exit(1 if main()["problems"] else 0)
