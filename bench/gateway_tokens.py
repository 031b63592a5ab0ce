"""The gateway's own cost per streamed token, without a GPU: a real gateway process over a stepping fake compute.

A fake compute service (in a process of its own) answers the gateway's token
stream the way the engine does: every `--step-ms` it sends one message with one
new token for every running sequence, and ends each sequence after its
`max_tokens`. A real `loraplex gateway` process (the default model's tokenizer)
sits between it and the load generator of `bench/serve_load.py` (4 processes
of the Python `AsyncClient`), which runs rounds of `--streams` base streams of
`--tokens` tokens for `--seconds`. Reported: tokens per second through the
gateway, the gateway's CPU share of one core (from /proc), and so its CPU time
per token; the fake compute's and the clients' shares beside it. A gateway near
1.0 of a core is the limit; then its microseconds per token set the served
throughput of every backend.

    python3 bench/gateway_tokens.py --streams 64 --tokens 100 --step-ms 1
    python3 bench/gateway_tokens.py --smoke
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serve_cpu_share import cpu_seconds, report  # noqa: E402
from serve_load_client import ClientPool, Request  # noqa: E402
from serve_load_proc import free_port  # noqa: E402
from serve_load import git_commit  # noqa: E402


def _fake_compute(port: int, step_s: float, vocab: int, eos: int, ready) -> None:
    """Serves Compute.StreamTokens (one message per step for every running sequence), GetModelInfo, health."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from loraplex.v1 import common_pb2, compute_pb2, compute_pb2_grpc

    class Stepping(compute_pb2_grpc.ComputeServicer):
        async def GetModelInfo(self, request, context):
            return compute_pb2.ComputeModelInfoResponse(model=common_pb2.ModelInfo(
                model_name="stepping", max_model_len=4096, vocab_size=vocab, eos_token_id=eos))

        async def StreamTokens(self, request_iterator, context):
            running: dict[int, list[int]] = {}       # handle -> [tokens left, prompt tokens, sent]

            async def read() -> None:
                async for req in request_iterator:
                    for s in req.start:
                        running[s.handle] = [s.request.sampling.max_tokens or 16, len(s.request.input_ids), 0]
                    for h in req.cancel:
                        running.pop(h, None)

            reader = asyncio.create_task(read())
            token = 1000
            try:
                while True:
                    await asyncio.sleep(step_s)
                    if not running:
                        continue
                    msg = compute_pb2.StreamTokensResponse()
                    for h, state in list(running.items()):
                        msg.handles.append(h)
                        msg.num_tokens.append(1)
                        msg.token_ids.append(token + h % 500)       # plain word pieces, never EOS
                        state[0] -= 1
                        state[2] += 1
                        if state[0] <= 0:
                            msg.finished.add(handle=h, finish_reason=common_pb2.LENGTH, usage=common_pb2.Usage(
                                prompt_tokens=state[1], completion_tokens=state[2]))
                            del running[h]
                    yield msg
            finally:
                reader.cancel()

    async def main() -> None:
        server = grpc.aio.server()
        compute_pb2_grpc.add_ComputeServicer_to_server(Stepping(), server)
        checker = health.aio.HealthServicer()
        await checker.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--step-ms", type=float, default=1.0, help="the fake engine's step time")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--gateway-flags", default="", help="more `loraplex gateway` flags")
    ap.add_argument("--smoke", action="store_true", help="a few seconds, 8 streams: checks the script")
    ap.add_argument("--commit", default="", help="commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.smoke:
        args.streams, args.tokens, args.seconds = 8, 20, 2.0
    from loraplex.model_files import load_tokenizer, resolve_model_path
    tok = load_tokenizer(resolve_model_path(""))
    vocab, eos = len(tok), int(tok.eos_token_id)
    ctx = mp.get_context("spawn")
    compute_port, gateway_port = free_port(), free_port()
    ready = ctx.Event()
    compute = ctx.Process(target=_fake_compute, args=(compute_port, args.step_ms / 1e3, vocab, eos, ready),
                          daemon=True)
    compute.start()
    if not ready.wait(60):
        raise RuntimeError("the fake compute service did not start")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    gateway = subprocess.Popen(
        [sys.executable, "-m", "loraplex.cli.main", "gateway", "--listen", f"127.0.0.1:{gateway_port}",
         "--compute-addresses", f"127.0.0.1:{compute_port}", "--cache-address", "127.0.0.1:1",
         *args.gateway_flags.split()], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    address = f"127.0.0.1:{gateway_port}"
    pool = None
    try:
        from loraplex.client import Client
        deadline = time.monotonic() + 120
        while True:
            try:
                with Client(address, timeout=2) as c:
                    c.generate([1000, 1001], max_tokens=1)
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline or gateway.poll() is not None:
                    raise RuntimeError("the gateway did not come up: "
                                       + (gateway.stderr.read().decode()[-2000:] if gateway.poll() is not None
                                          else "timeout"))
                time.sleep(0.3)
        pool = ClientPool(address, args.client_procs)
        reqs = [Request(i, [1000 + (7 * i + j) % 500 for j in range(34)], None, 0.0) for i in range(args.streams)]
        sampling = dict(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        pool.run(reqs, args.streams, sampling)                       # warm
        pids = {"gateway": gateway.pid, "fake compute": compute.pid}
        before = {k: cpu_seconds(p) for k, p in pids.items()}
        t0, tokens, rounds = time.monotonic(), 0, 0
        while time.monotonic() - t0 < args.seconds:
            tokens += sum(tl.num_tokens for tl in pool.run(reqs, args.streams, sampling, lead_s=0.02))
            rounds += 1
        wall = time.monotonic() - t0
        share = {k: round(((cpu_seconds(p) or 0.0) - (before[k] or 0.0)) / wall, 3) for k, p in pids.items()}
    finally:
        if pool is not None:
            pool.close()
        gateway.terminate()
        try:
            gateway.wait(20)
        except subprocess.TimeoutExpired:
            gateway.kill()
        compute.terminate()
        compute.join(10)
    tok_s = tokens / wall
    result = dict(bench="gateway_tokens", commit=args.commit or git_commit(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  device=f"cpu ({os.cpu_count()} cores)", client_procs=args.client_procs,
                  streams=args.streams, tokens=args.tokens, step_ms=args.step_ms, rounds=rounds,
                  tokens_per_s=round(tok_s), cpu_share=share,
                  gateway_cpu_us_per_token=round(1e6 * share["gateway"] / tok_s, 1) if tok_s else None,
                  engine_limit_tokens_per_s=round(args.streams / (args.step_ms / 1e3)))
    return report(result, args.out)


if __name__ == "__main__":
    main()
