"""`loraplex serve`: the whole system in one command.

Starts redis-server (with `--backend redis` and no `--redis-url`), then the
host cache service, the compute service (on the GPU when there is one, else
the CPU) and the gateway all at once; forwards their logs (prefixed with their
names) from the start, so the compute service's warm-up progress shows; waits
until each answers its health check (the compute service says SERVING once its
kernels are compiled and graphs captured); prints `gateway listening on
HOST:PORT`; then runs until Ctrl-C or SIGTERM, when it stops them all, gateway
first. If any service exits on its own, the others are stopped too. The
gateway also serves the OpenAI-compatible HTTP API (--http-listen, default
127.0.0.1:8000; docs/openai.md).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from loraplex.cli.serve_procs import RedisServer, forward_logs, free_port, reserve_shared_port, stop_all
from loraplex.logging_setup import say
from loraplex.procs import ServiceProcess, spawn_service, wait_listening, wait_serving


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="Start redis (optional), cache, compute and gateway together.",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", default="127.0.0.1:50051", help="gateway address (default 127.0.0.1:50051)")
    p.add_argument("--http-listen", default=None,
                   help="address of the gateway's OpenAI-compatible HTTP API (default 127.0.0.1:8000, or a "
                        "free port when --listen's port is 0; empty: off)")
    p.add_argument("--model", default="", help="GGUF file or HF folder; default SmolLM2-135M-Instruct")
    p.add_argument("--backend", choices=("shm", "redis"), default="shm",
                   help="host cache backend: shm (shared memory, default) or redis")
    p.add_argument("--redis-url", default="", help="use this Redis server instead of starting redis-server")
    p.add_argument("--lora-root", default="", help="folder of named adapters (<root>/<name>/ or <name>.safetensors)")
    p.add_argument("--lora-prefetch-dir", default="",
                   help="folder of <task_id>/model.lora_{config,weights}.npy loaded at start")
    p.add_argument("--host-cache-bytes", default="", help="host cache byte budget (default 1 GiB)")
    p.add_argument("--max-lora-rank", default="", help="largest adapter rank accepted (default 256)")
    p.add_argument("--device", default="auto", help="compute device: auto (GPU if present), cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto, float32, float16 or bfloat16")
    p.add_argument("--quantization", default="",
                   help="a quantized checkpoint: auto (kept quantized on a GPU when its projections take 1 GiB "
                        "or more in 16 bits, else dequantized, as on the CPU; the default), keep (quantized "
                        "everywhere; on the CPU slow), none (dequantized everywhere)")
    p.add_argument("--max-model-len", default="", help="longest prompt + output")
    p.add_argument("--tensor-parallel-size", default="",
                   help="processes (one GPU each, or CPU processes) the compute service splits the model over "
                        "(tensor parallelism, docs/tensor_parallel.md)")
    p.add_argument("--cache-flags", default="", help='more flags for the cache service, e.g. "--metrics-port 9101"')
    p.add_argument("--compute-flags", default="", help='more flags for the compute service, e.g. "--max-num-seqs 8"')
    p.add_argument("--gateway-flags", default="", help="more flags for the gateway")
    p.add_argument("--gateway-workers", type=int, default=default_gateway_workers(),
                   help="gateway processes sharing --listen and --http-listen (the kernel spreads connections "
                        "over them; API key limits and /metrics are per process) [env LORAPLEX_GATEWAY_WORKERS; "
                        "default: a quarter of the CPU cores, 1 to 4]")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds each service may take to start")
    p.add_argument("--quiet", action="store_true", help="do not forward the services' logs")
    p.set_defaults(func=run)


def default_gateway_workers(cpus: int | None = None) -> int:
    """LORAPLEX_GATEWAY_WORKERS, else one gateway per 4 CPU cores, 1 to 4 (on an H100 host of 16 cores, 4 took
    Poisson time to first token at 64-256 streams from 26-206 ms to 10-102 ms; docs/performance.md)."""
    env = os.environ.get("LORAPLEX_GATEWAY_WORKERS", "").strip()
    if env:
        return int(env)
    if cpus is None:
        from loraplex.host_limits import usable_cpus

        cpus = usable_cpus()                    # the container's CPU quota included
    return max(1, min(4, cpus // 4))


def child_env() -> dict[str, str]:
    """Puts the folder holding the service packages first on the children's import path, so they
    import the same code as this process whatever the current directory (an editable install
    alone can resolve packages as namespaces from elsewhere)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": root + (os.pathsep + path if path else "")}


def _opt(flag: str, value: str) -> list[str]:
    return [flag, value] if value else []


def service_args(args: argparse.Namespace, redis_url: str) -> tuple[list[str], list[str]]:
    """Flags of the cache and compute services (their addresses are picked by the OS)."""
    shared = _opt("--model", args.model) + _opt("--max-lora-rank", args.max_lora_rank)
    cache = (["cache", "--listen", "127.0.0.1:0", "--backend", args.backend] + _opt("--redis-url", redis_url)
             + _opt("--lora-root", args.lora_root) + _opt("--lora-prefetch-dir", args.lora_prefetch_dir)
             + _opt("--host-cache-bytes", args.host_cache_bytes) + shared + shlex.split(args.cache_flags))
    compute = (["compute", "--listen", "127.0.0.1:0", "--device", args.device, "--dtype", args.dtype]
               + _opt("--max-model-len", args.max_model_len) + _opt("--quantization", args.quantization)
               + _opt("--tensor-parallel-size", args.tensor_parallel_size)
               + shared + shlex.split(args.compute_flags))
    return cache, compute


def gateway_speaks_tls(args: argparse.Namespace) -> bool:
    """Whether the gateway was given a certificate (--gateway-flags or LORAPLEX_TLS_CERT)."""
    flags = shlex.split(args.gateway_flags)
    return any(f == "--tls-cert" or f.startswith("--tls-cert=") for f in flags) or bool(
        os.environ.get("LORAPLEX_TLS_CERT"))


def gateway_specs(args: argparse.Namespace, cache_addr: str, compute_addr: str) -> list[tuple[str, list[str]]]:
    """One (name, argv) per gateway worker: "gateway", then "gateway-2", ...; with several, each shares the
    listen addresses (`--reuse-port`), which must then name a port (`reserve_shared_port` picks one for 0)."""
    argv = (["gateway", "--listen", args.listen, "--cache-address", cache_addr, "--compute-addresses", compute_addr,
             "--http-listen", args.http_listen] + _opt("--model", args.model) + shlex.split(args.gateway_flags))
    if args.gateway_workers == 1:
        return [("gateway", argv)]
    return [("gateway" if i == 0 else f"gateway-{i + 1}", argv + ["--reuse-port"]) for i in range(args.gateway_workers)]


def check_gateway_workers(args: argparse.Namespace) -> None:
    if args.gateway_workers < 1:
        raise ValueError(f"--gateway-workers must be at least 1, got {args.gateway_workers}")
    flags = shlex.split(args.gateway_flags)
    if args.gateway_workers > 1 and any(f == "--metrics-port" or f.startswith("--metrics-port=") for f in flags):
        raise ValueError("--gateway-workers > 1 cannot share one --metrics-port: read each worker's counters on "
                         "the HTTP API's /metrics, or run one gateway")


def start_all(args: argparse.Namespace, cache_args: list[str], compute_args: list[str], env: dict[str, str],
              t0: float, started: list[ServiceProcess]) -> list[ServiceProcess]:
    """Starts the services at once (their ports picked here, so none waits for another's address),
    forwards their logs while they start (unless --quiet), then waits until each answers SERVING: the
    gateways and the cache within seconds, the compute service once it has warmed up. Returns the cache,
    the compute service, then the gateways."""
    cache_addr, compute_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cache_args = [a if a != "127.0.0.1:0" else cache_addr for a in cache_args]
    compute_args = [a if a != "127.0.0.1:0" else compute_addr for a in compute_args]
    with contextlib.ExitStack() as held:       # ports of several gateways, held until they listen
        if args.gateway_workers > 1:
            args.listen = held.enter_context(reserve_shared_port(args.listen))
            if args.http_listen:
                args.http_listen = held.enter_context(reserve_shared_port(args.http_listen))
        specs = ([("cache", cache_args), ("compute", compute_args + ["--cache-address", cache_addr])]
                 + gateway_specs(args, cache_addr, compute_addr))
        services = [spawn_service(name, argv, env=env) for name, argv in specs]
        started.extend(services)    # as soon as they exist: a failure or Ctrl-C part-way stops them all
        if not args.quiet:
            forward_logs(services)
        deadline = time.monotonic() + args.startup_timeout
        for svc in services:
            wait_listening(svc, max(1.0, deadline - time.monotonic()))
    for svc in sorted(services, key=lambda s: s.name == "compute"):   # the compute service is the slow one
        if svc.name.startswith("gateway") and gateway_speaks_tls(args):
            continue    # the probe speaks plaintext; the gateway serves from its listening line on
        wait_serving(svc, deadline)
        print(f"serve: {svc.name} healthy after {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
    return services


def _wait_stop_signal(services: list[ServiceProcess]) -> str:
    """Blocks until SIGINT/SIGTERM or a service exits; returns why."""
    stop = threading.Event()
    reason = ["signal"]

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop.wait(0.5):
        for svc in services:
            if svc.proc.poll() is not None:
                reason[0] = f"{svc.name} exited with code {svc.proc.returncode}"
                return reason[0]
    return reason[0]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    if args.http_listen is None:      # a gateway on a free port (tests, scripts) takes a free HTTP port too
        args.http_listen = "127.0.0.1:0" if args.listen.endswith(":0") else "127.0.0.1:8000"
    started: list[ServiceProcess] = []
    redis: RedisServer | None = None
    # Until everything is up, SIGTERM acts like Ctrl-C, so a half-started system is still stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        redis_url = args.redis_url
        if args.backend == "redis" and not redis_url:
            redis = RedisServer.start()
            redis_url = redis.url
            print(f"serve: redis-server at {redis_url}", file=sys.stderr, flush=True)
        check_gateway_workers(args)
        cache_args, compute_args = service_args(args, redis_url)
        env = child_env()
        t0 = time.monotonic()
        cache, compute, gateway, *more_gateways = start_all(args, cache_args, compute_args, env, t0, started)
        if more_gateways:
            print(f"serve: {1 + len(more_gateways)} gateway processes share {gateway.address}", file=sys.stderr,
                  flush=True)
        print(f"serve: cache at {cache.address} ({args.backend}), compute at {compute.address}, "
              f"ready in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
        if args.http_listen and not args.http_listen.endswith(":0"):   # port 0: the gateway's own line says
            scheme = "https" if gateway_speaks_tls(args) else "http"
            print(f"serve: OpenAI-compatible API at {scheme}://{args.http_listen}/v1", file=sys.stderr, flush=True)
        # The one line tools read (same form as every service's): where the public API is.
        say(f"gateway listening on {gateway.address}")
        reason = _wait_stop_signal(started)
        print(f"serve: stopping ({reason})", file=sys.stderr, flush=True)
        failed = reason != "signal"
        if failed:
            dead = next(s for s in started if s.proc.poll() is not None)
            sys.stderr.write("".join(dead.lines[-40:]))
        return 1 if failed else 0
    except KeyboardInterrupt:
        print("serve: interrupted while starting; stopping", file=sys.stderr, flush=True)
        return 130
    except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
        print(f"serve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_all(started, redis)
        print("serve: stopped", file=sys.stderr, flush=True)
