"""`loraplex convert`: PEFT folder / TensorRT-LLM .npy folder / llgtrt .safetensors, any to any.

Flags follow TensorRT-LLM's `hf_lora_convert.py` (`-i/--in-file`,
`-o/--out-dir`, `--storage-type`) and llgtrt's `extract_lora.py`
(`--out-file`, `-t/--dtype`). Without `--storage-type`, `.npy` output is
float16 (TensorRT-LLM's default) and other outputs keep the source dtype
(llgtrt's behaviour).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loraplex.formats import (FORMATS, STORAGE_DTYPES, AdapterError, ModelSpec, check_consistent,
                              load_adapter, save_adapter, validate)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "convert", help="convert a LoRA adapter between PEFT, TensorRT-LLM .npy and llgtrt .safetensors",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--in-file", "--input", dest="src", type=Path, required=True,
                   help="PEFT folder, folder with model.lora_{weights,config}.npy, or a .safetensors file")
    p.add_argument("-o", "--out-dir", "--out-file", "--output", dest="dst", type=Path, required=True,
                   help="output folder (npy, peft) or file (safetensors)")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="output format (default: safetensors if DST ends in .safetensors, else npy)")
    p.add_argument("--storage-type", "-t", "--dtype", dest="storage_type",
                   choices=sorted(STORAGE_DTYPES), default=None,
                   help="weights dtype (default: float16 for npy, else the source dtype)")
    p.add_argument("--model", default=None,
                   help="base model config.json, HF folder or .gguf: validate before writing "
                        "(needed to write PEFT from npy/safetensors)")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="rank limit for validation (default: no limit beyond the adapter's own)")
    p.add_argument("--verbose", action="store_true", help="print the converted rows' summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    fmt = args.format or ("safetensors" if args.dst.suffix == ".safetensors" else "npy")
    dtype = args.storage_type or ("float16" if fmt == "npy" else None)
    try:
        adapter = check_consistent(load_adapter(args.src, dtype=dtype))   # even without --model
        if args.model:
            spec = ModelSpec.from_path(args.model)
            adapter = validate(adapter, spec, args.max_lora_rank or adapter.max_rank)
        out = save_adapter(adapter, args.dst, fmt)
    except AdapterError as e:
        print(f"loraplex convert: {e}", file=sys.stderr)
        return 1
    print(f"wrote {fmt} {out}: {adapter.num_rows} rows, {str(adapter.dtype).removeprefix('torch.')}, "
          f"{adapter.num_bytes} bytes, hash {adapter.content_hash}")
    if args.verbose:
        for name, (layers, lo, hi) in adapter.ranks_by_module().items():
            print(f"  {name}: {layers} layers, rank {lo if lo == hi else f'{lo}-{hi}'}")
    return 0
