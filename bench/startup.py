"""Start-up benchmark: time from `loraplex serve` to healthy, and whether the first requests are slower.

    python bench/startup.py --label after --out bench/results/startup.json [--repo DIR] [--cold] [--serve-flags ...]

Starts `loraplex serve` (the tree in --repo, default this one) with the default
model and an adapter root of random adapters, with Triton's cache in a fresh
folder (--cold) or in the one the previous run of this script left; records the
seconds until the gateway's listening line (serve prints it once every service
answers SERVING) and the compute service's own start-up lines; then sends
requests through the gateway with the Python client and records time to first
token (TTFT):
- `first[L]`: a never-seen adapter, the first request of prompt length L;
- `later_cold[L]`: another never-seen adapter at length L after 60 other requests
  (the same adapter load from the root, no first-use cost of the service);
- `warm[L]`: an adapter already resident.
first ~= later_cold means nothing compiled on the first request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from startup_stages import stages  # noqa: E402

LENGTHS = (34, 300, 1500)
NUM_ADAPTERS = 2 * len(LENGTHS) + 2


def write_adapter_root(folder: Path, num: int) -> list[str]:
    """`num` random rank-16 all-module adapters as llgtrt `.safetensors` (weights + config tensors)."""
    from safetensors.torch import save_file

    from compute_service.adapter_cache.layout import module_features
    from compute_service.engine.gguf_loader import read_gguf
    from compute_service.engine.loader import default_model_path

    spec = read_gguf(default_model_path())[0]
    feats = module_features(spec)
    gen = torch.Generator().manual_seed(0)
    names = []
    for i in range(num):
        rank = 16
        rows, cfg = [], []
        for layer in range(spec.num_layers):
            for m, (fin, fout) in feats.items():
                a = torch.randn(rank, fin, generator=gen) * fin ** -0.5
                b = torch.randn(fout, rank, generator=gen) * 0.02
                rows.append(torch.cat([a.flatten(), b.flatten()]))
                cfg.append([m, layer, rank])
        w = torch.zeros(len(rows), max(r.numel() for r in rows), dtype=torch.float16)
        for j, r in enumerate(rows):
            w[j, : r.numel()] = r
        name = f"bench{i}"
        save_file({"weights": w, "config": torch.from_numpy(np.asarray(cfg, dtype=np.int32))},
                  str(folder / f"{name}.safetensors"))
        names.append(name)
    return names


async def ttft(client, prompt: list[int], lora: str | None) -> float:
    t0 = time.perf_counter()
    async for _chunk in client.stream(prompt, lora=lora, max_tokens=4, ignore_eos=True):
        return time.perf_counter() - t0
    raise RuntimeError("empty stream")


async def measure(address: str, names: list[str]) -> dict:
    from loraplex.client import AsyncClient

    gen = np.random.default_rng(0)

    def prompt(n: int) -> list[int]:
        return gen.integers(100, 40000, n).tolist()

    res: dict = {"first": {}, "later_cold": {}, "warm": {}}
    fresh = iter(names)
    async with AsyncClient(address, timeout=120) as c:
        res["first_base_34"] = await ttft(c, prompt(34), None)
        for n in LENGTHS:
            res["first"][n] = await ttft(c, prompt(n), next(fresh))
        busy = names[-1]
        await asyncio.gather(*[ttft(c, prompt(int(gen.integers(8, 600))), busy if i % 2 else None)
                               for i in range(60)])
        for n in LENGTHS:
            res["later_cold"][n] = await ttft(c, prompt(n), next(fresh))
            res["warm"][n] = await ttft(c, prompt(n), busy)
        res["later_base_34"] = await ttft(c, prompt(34), None)
    return res


def run_once(args: argparse.Namespace, cache_dir: Path, lora_root: Path, names: list[str], log_path: Path) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1")
    repo = Path(args.repo).resolve()
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "loraplex.cli.main", "serve", "--listen", "127.0.0.1:0", "--lora-root",
           str(lora_root)] + args.serve_flags.split()
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        address = ""
        assert proc.stdout is not None
        for line in proc.stdout:
            m = re.search(r"gateway listening on (\S+)", line)
            if m:
                address = m.group(1)
                break
        healthy_s = time.perf_counter() - t0
        if not address:
            proc.wait(10)
            raise RuntimeError(f"serve exited ({proc.returncode}); see {log_path}")
        out = {"healthy_s": round(healthy_s, 2)}
        try:
            if not args.no_requests:
                out.update(asyncio.run(measure(address, names)))
        finally:
            proc.terminate()
            proc.wait(60)
    text = log_path.read_text()
    out["stages"] = stages(text)
    out["startup_lines"] = [ln.strip()[-220:] for ln in text.splitlines() if "start-up" in ln or "warm-up" in ln
                            or "runtime built" in ln or "captured" in ln or "ready in" in ln]
    return out


def has_bytecode() -> bool:
    """Whether torch's modules have compiled bytecode beside them (as in the image, which runs compileall);
    without it every process that imports torch compiles its sources first, seconds per service."""
    import importlib.util

    return Path(importlib.util.cache_from_source(torch.__file__)).is_file()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True)
    p.add_argument("--repo", default=str(ROOT), help="tree whose `loraplex serve` runs (an older checkout, say)")
    p.add_argument("--cold", action="store_true", help="empty Triton cache (else the last run's)")
    p.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "loraplex-startup-triton"))
    p.add_argument("--serve-flags", default="")
    p.add_argument("--no-requests", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--commit", default="", help="recorded as the commit (else the tree's HEAD)")
    args = p.parse_args()
    cache_dir = Path(args.cache_dir)
    if args.cold:
        shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="startup-"))
    lora_root = work / "adapters"
    lora_root.mkdir()
    names = write_adapter_root(lora_root, NUM_ADAPTERS)
    log_path = Path(os.environ.get("OUT", work)) / f"serve_{args.label}.log"
    res = run_once(args, cache_dir, lora_root, names, log_path)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.repo,
                                           capture_output=True, text=True).stdout.strip()
    res.update(label=args.label, commit=commit or None, cold_triton_cache=args.cold, bytecode=has_bytecode(),
               gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               date=time.strftime("%Y-%m-%d"))
    print(json.dumps(res, indent=1))
    if args.out:
        path = Path(args.out)
        allres = json.loads(path.read_text()) if path.is_file() else {}
        allres[args.label] = res
        path.write_text(json.dumps(allres, indent=1) + "\n")


if __name__ == "__main__":
    main()
