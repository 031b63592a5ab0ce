"""Where a cold named adapter's time goes, stage by stage, in one process (CPU or GPU).

Builds a PEFT folder for a model shape (SmolLM2-135M by default, or the
Llama-3-8B shape) in a temporary adapter root, then times each stage of the
path a never-seen named adapter takes through loraplex:

signature of the files -> plan from the headers -> convert each row straight
into a shared-memory segment (rows checked as written) -> structural checks ->
hash -> commit (the compute side's stages are in bench/cold_adapter.py).

Each stage of the host cache's put is timed alone (best of `--repeat`):
planning from the headers, the one-pass fill into a fresh shared-memory
segment with 1..16 threads (and into memory already touched, and into a
segment whose pages were allocated first as a spare's are, which show what
page faults cost; and that allocation alone), the version hash reading or skipping the padding; then the
whole `HostCache` put through its public API, with the file's pages mapped
lazily or populated up front. The floor is one read of the file's bytes.

    python bench/cold_adapter_stages.py [--shape smollm2|llama3-8b] [--rank 64] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cache_service import sources as disk  # noqa: E402
from cache_service.host_cache import HostCache  # noqa: E402
from cache_service.shm_backend import ShmBackend  # noqa: E402
from cache_service.shm_segments import OwnedSegment, new_instance_tag  # noqa: E402
from cache_service.shm_spares import populate  # noqa: E402
from loraplex.formats import ModelSpec, mapped  # noqa: E402
from loraplex.formats.hashing import weights_version  # noqa: E402
from loraplex.formats.peft_rows import FILL_WORKERS, fill_workers, plan_peft  # noqa: E402
from loraplex.formats.modules import module_shape  # noqa: E402

SHAPES = {
    "smollm2": dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, intermediate_size=1536, vocab_size=49152, model_type="llama"),
    "llama3-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=14336, vocab_size=128256, model_type="llama"),
}
PROJ = {1: ("self_attn", "q_proj"), 2: ("self_attn", "k_proj"), 3: ("self_attn", "v_proj"),
        4: ("self_attn", "o_proj"), 5: ("mlp", "gate_proj"), 6: ("mlp", "up_proj"), 7: ("mlp", "down_proj")}


def write_peft(folder: Path, spec: ModelSpec, rank: int, dtype: torch.dtype, seed: int = 0) -> int:
    """A PEFT folder with every module of every layer at `rank`; returns the safetensors file's bytes."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for m, (block, proj) in PROJ.items():
            s = module_shape(m, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
                             num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
                             intermediate_size=spec.intermediate_size)
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, s.in_features, generator=gen) * 0.02).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(s.out_features, rank, generator=gen) * 0.02).to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "lora_dropout": 0.0,
        "target_modules": [p for _, p in PROJ.values()], "task_type": "CAUSAL_LM"}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return (folder / "adapter_model.safetensors").stat().st_size


def write_model_and_root(tmp: Path, shape: str, names: list[str], rank: int) -> tuple[Path, Path, list[int]]:
    """A model folder holding only `shape`'s config.json (what the cache validates against) and an adapter
    root with one PEFT folder per name (every module, `rank`, bf16, seed = its index); returns (model
    folder, root, each adapter file's bytes)."""
    cfg = SHAPES[shape]
    spec = ModelSpec.from_hf_config(cfg)
    model_dir, root = tmp / "model", tmp / "root"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    file_bytes = [write_peft(root / n, spec, rank, torch.bfloat16, seed=i) for i, n in enumerate(names)]
    return model_dir, root, file_bytes


def best_ms(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, (time.perf_counter() - t) * 1e3)
    return best, out


def read_into(path: Path, buf: bytearray) -> int:
    with path.open("rb") as f:
        return f.readinto(buf)


def fresh_segment_fill(rows, workers: int, populated: bool = False) -> float:
    """Fills a new shared-memory segment (fresh pages, as a put does; `populated`: its pages allocated
    first, as a spare's are, outside the timing); returns milliseconds."""
    seg = OwnedSegment(new_instance_tag(), rows.num_bytes)
    try:
        if populated:
            populate(seg)
        out = torch.frombuffer(seg.data, dtype=rows.dtype).view(rows.shape)
        t = time.perf_counter()
        rows.fill(out, check_finite=True, workers=workers)
        ms = (time.perf_counter() - t) * 1e3
        del out
    finally:
        seg.retire()
    return ms


def new_path_stages(folder: Path, repeat: int) -> dict[str, float]:
    """The put path stage by stage: map, fill into a fresh segment, hash (reading or skipping the padding)."""
    stages: dict[str, float] = {}
    stages["plan_map_headers"], rows = best_ms(lambda: plan_peft(folder), repeat)
    for w in sorted({2, 4, FILL_WORKERS, 16}):
        stages[f"fill_fresh_segment_w{w}"] = min(fresh_segment_fill(plan_peft(folder), w) for _ in range(repeat))
    stages["fill_workers_default"] = fill_workers(rows.num_bytes)     # what a put uses
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # no intra-op threads inside each worker's row copies
    for w in sorted({1, 4, FILL_WORKERS}):
        stages[f"fill_fresh_segment_w{w}_torch_threads1"] = min(fresh_segment_fill(plan_peft(folder), w)
                                                                for _ in range(repeat))
    torch.set_num_threads(threads)
    touched = torch.ones(rows.shape, dtype=rows.dtype)
    stages["fill_touched_memory"], _ = best_ms(lambda: rows.fill(touched, check_finite=True), repeat)
    default_workers = fill_workers(rows.num_bytes)
    stages["fill_spare_segment"] = min(fresh_segment_fill(plan_peft(folder), default_workers, populated=True)
                                       for _ in range(repeat))
    seg = OwnedSegment(new_instance_tag(), rows.num_bytes)
    stages["populate_spare"], _ = best_ms(lambda: populate(seg), 1)
    seg.retire()
    used = [int(r) * (fi + fo) * rows.dtype.itemsize for r, (fi, fo) in zip(rows.config[:, 2], rows.in_out)]
    seg = OwnedSegment(new_instance_tag(), rows.num_bytes)
    rows.fill(torch.frombuffer(seg.data, dtype=rows.dtype).view(rows.shape))
    data = seg.data
    stages["hash_skip_padding"], _ = best_ms(
        lambda: weights_version(rows.dtype, rows.config, rows.shape, data, row_used_bytes=used), repeat)
    stages["hash_read_all"], _ = best_ms(lambda: weights_version(rows.dtype, rows.config, rows.shape, data), repeat)
    stages["hash_read_all_1_thread"], _ = best_ms(
        lambda: weights_version(rows.dtype, rows.config, rows.shape, data, workers=1), 1)
    data.release()
    seg.retire()
    return stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    spec = ModelSpec.from_hf_config(SHAPES[args.shape])
    result: dict = dict(shape=args.shape, rank=args.rank, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        folder = root / "cold"
        result["file_bytes"] = write_peft(folder, spec, args.rank, getattr(torch, args.dtype))
        raw = (folder / "adapter_model.safetensors")
        stages: dict[str, float] = {}
        stages["read_file_bytes"], _ = best_ms(lambda: raw.read_bytes(), args.repeat)
        buf = bytearray(raw.stat().st_size)
        stages["read_file_into_touched_buffer"], _ = best_ms(lambda: read_into(raw, buf), args.repeat)
        del buf
        stages["signature"], _ = best_ms(lambda: disk.signature(folder), args.repeat)
        stages.update(new_path_stages(folder, args.repeat))
        result["converted_bytes"] = plan_peft(folder).num_bytes
        backend = ShmBackend(8 << 30)
        cache = HostCache(backend, spec, max_lora_rank=max(64, args.rank), lora_root=str(root))
        for populate in (False, True):
            mapped.POPULATE = populate
            label = "host_cache_put_total" + ("_populate" if populate else "")
            for i in range(args.repeat + 1):
                backend.evict(disk.task_id_for_name("cold"))
                t = time.perf_counter()
                cache.resolve_name("cold", "always")
                if i:
                    stages[label] = min(stages.get(label, 1e9), (time.perf_counter() - t) * 1e3)
        mapped.POPULATE = False
        backend.close()
        result["stages_ms"] = stages
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
