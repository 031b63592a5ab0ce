"""Which process of `loraplex serve` spends the CPU under load (Linux).

Starts `loraplex serve`, then drives repeated bursts of N base streams of T
greedy tokens through the gateway (4 processes of the Python `AsyncClient`, as
`bench/serve_load.py` does) for D seconds. Over a window in the middle it reads
each process's user + system CPU time from /proc and reports it as a share of
one core: every gateway process, the compute service's gRPC process, its engine
process, the cache service and anything else under `serve`. With it: time to
first token over all bursts, and how far apart a burst's first tokens came.

    python3 bench/serve_cpu_share.py --streams 256 --tokens 2      # admission-bound bursts
    python3 bench/serve_cpu_share.py --streams 64 --tokens 100     # token-bound streams
    python3 bench/serve_cpu_share.py --smoke                       # tiny random model on the CPU

A process near 1.0 is where the served system waits. The gateway processes
share the clients' connections as the kernel spreads them (SO_REUSEPORT), so
with few client connections their shares differ.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serve_load_client import ClientPool, Request  # noqa: E402
from serve_load_proc import ServeProcess  # noqa: E402
from serve_load_setup import make_prompts, make_random_model  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS         # utime + stime


def role(pid: int, parent: str) -> str:
    """gateway / compute / engine / cache / ... from the command line and the parent's role."""
    try:
        words = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    except OSError:
        return "gone"
    for name in ("gateway", "compute", "cache"):
        if name in words:
            return name
    if any("spawn_main" in w for w in words):
        return {"compute": "engine", "cache": "convert-worker"}.get(parent, f"{parent}-child")
    if any("resource_tracker" in w for w in words):
        return f"{parent}-tracker"
    return words[0].rsplit("/", 1)[-1] if words and words[0] else "?"


def processes(root: int) -> dict[int, str]:
    """pid -> role of every process under `serve` (gateways numbered in pid order)."""
    roles: dict[int, str] = {}

    def walk(pid: int, parent: str) -> None:
        for kid in children(pid):
            roles[kid] = role(kid, parent)
            walk(kid, roles[kid])

    walk(root, "serve")
    for i, p in enumerate(sorted(p for p, r in roles.items() if r == "gateway")):
        roles[p] = f"gateway-{i + 1}"
    return {p: r for p, r in roles.items() if r != "gone"}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2, help="output tokens per stream")
    ap.add_argument("--seconds", type=float, default=20.0, help="how long the bursts go on")
    ap.add_argument("--window", type=float, default=8.0, help="seconds of CPU time measured, mid-run")
    ap.add_argument("--prompt-len", type=int, default=34)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--client-connections", type=int, default=1, help="TCP connections per client process")
    ap.add_argument("--serve-flags", default="", help="more `loraplex serve` flags")
    ap.add_argument("--smoke", action="store_true", help="tiny random model on the CPU: checks the script")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    flags = ["--host-cache-bytes", str(1 << 30), "--compute-flags",
             f"--max-num-seqs {max(args.streams, 8)} --max-num-batched-tokens 2048"]
    if args.smoke:
        model = make_random_model(Path(tempfile.mkdtemp(prefix="cpu-share-")) / "tiny", "tiny", dtype="float32")
        flags += ["--model", str(model), "--device", "cpu", "--max-model-len", "256"]
    svc = ServeProcess(flags + shlex.split(args.serve_flags), 900.0)
    from loraplex.client import Client
    with Client(svc.address, timeout=600) as client:
        vocab = client.model_info().vocab_size
    pool = ClientPool(svc.address, args.client_procs, args.client_connections)
    sampling = dict(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(args.streams, args.prompt_len, vocab)
    reqs = [Request(i, p, None, 0.0) for i, p in enumerate(prompts)]
    result: dict = {}
    try:
        pool.run(reqs, args.streams, dict(sampling, max_tokens=2))        # warm: every stream once
        roles = processes(svc.proc.pid)
        window: dict[str, float] = {}

        def measure() -> None:
            time.sleep(max(0.0, (args.seconds - args.window) / 2))
            before = {p: cpu_seconds(p) for p in roles}
            t0 = time.monotonic()
            time.sleep(args.window)
            wall = time.monotonic() - t0
            for p, r in roles.items():
                a, b = before[p], cpu_seconds(p)
                if a is not None and b is not None:
                    window[f"{r} ({p})"] = round((b - a) / wall, 3)

        meter = threading.Thread(target=measure, daemon=True)
        meter.start()
        t_end = time.monotonic() + args.seconds
        ttfts, spreads, bursts = [], [], 0
        while time.monotonic() < t_end:
            tls = pool.run(reqs, args.streams, sampling, lead_s=0.05)
            firsts = [tl.messages[0][0] for tl in tls if tl.messages]
            ttfts += sorted(tl.messages[0][0] - tl.sent for tl in tls if tl.messages)
            if firsts:
                spreads.append(max(firsts) - min(tl.sent for tl in tls))
            bursts += 1
        meter.join()
        ttfts.sort()
        spreads.sort()
        result = dict(streams=args.streams, tokens=args.tokens, bursts=bursts, window_s=args.window,
                      client_procs=args.client_procs, client_connections=args.client_connections,
                      cpu_share=dict(sorted(window.items())),
                      ttft_ms=dict(p50=1e3 * ttfts[len(ttfts) // 2], p90=1e3 * ttfts[int(len(ttfts) * 0.9)]),
                      first_token_spread_ms_p50=1e3 * spreads[len(spreads) // 2])
    finally:
        pool.close()
        svc.stop(20)
    return report(result, args.out)


def report(result: dict, out: Path | None) -> dict:
    """Prints `result` as JSON and writes it to `out` when given."""
    print(json.dumps(result, indent=1))
    if out:
        out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
