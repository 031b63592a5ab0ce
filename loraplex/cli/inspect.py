"""`loraplex inspect`: an adapter's modules, layers, ranks and bytes; validated against a model if given."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loraplex.formats import (MODULE_ID_TO_HF, MODULE_NAMES, Adapter, AdapterError, ModelSpec,
                              detect_format, load_adapter, validate)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("inspect", help="show an adapter's modules, layers, ranks and bytes",
                              description=__doc__)
    p.add_argument("src", type=Path, help="PEFT folder, .npy folder or .safetensors file")
    p.add_argument("--model", default=None, help="base model config.json, HF folder or .gguf to validate against")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="rank limit for validation (default: the adapter's largest rank)")
    p.set_defaults(func=run)


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts: list[str] = []
    for x in sorted(set(layers)):
        if parts and parts[-1].split("-")[-1] == str(x - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{x}"
        else:
            parts.append(str(x))
    return ",".join(parts)


def table(adapter: Adapter) -> list[str]:
    """One line per module: name, id, layers, rank, bytes (unpadded when row shapes are known)."""
    elem = adapter.weights.element_size()
    width = int(adapter.weights.shape[1]) if adapter.num_rows else 0
    rows: dict[int, tuple[list[int], list[int], int]] = {}
    for i, (module_id, layer, rank) in enumerate(adapter.config.tolist()):
        layers, ranks, nbytes = rows.get(module_id, ([], [], 0))
        used = rank * sum(adapter.in_out[i]) if adapter.in_out else width
        rows[module_id] = (layers + [layer], ranks + [rank], nbytes + used * elem)
    lines = [f"{'module':<24} {'id':>3} {'layers':<16} {'rank':>7} {'bytes':>12}"]
    for module_id in sorted(rows):
        layers, ranks, nbytes = rows[module_id]
        name = MODULE_NAMES.get(module_id, "?")
        if module_id in MODULE_ID_TO_HF:
            name = f"{name} ({MODULE_ID_TO_HF[module_id]})"
        rank = str(min(ranks)) if min(ranks) == max(ranks) else f"{min(ranks)}-{max(ranks)}"
        lines.append(f"{name:<24} {module_id:>3} {layer_ranges(layers):<16} {rank:>7} {nbytes:>12}")
    return lines


def run(args: argparse.Namespace) -> int:
    try:
        fmt = detect_format(args.src)
        adapter = load_adapter(args.src)
    except AdapterError as e:
        print(f"loraplex inspect: {e}", file=sys.stderr)
        return 1
    print(f"{args.src}: {fmt}, {adapter.num_rows} rows x {adapter.weights.shape[1]} "
          f"{str(adapter.dtype).removeprefix('torch.')}, {adapter.num_bytes} bytes stored, "
          f"hash {adapter.content_hash}")
    if args.model:
        try:
            spec = ModelSpec.from_path(args.model)
            adapter = validate(adapter, spec, args.max_lora_rank or max(adapter.max_rank, 1),
                               enabled_module_ids=MODULE_ID_TO_HF.keys())
        except AdapterError as e:
            print("\n".join(table(adapter)))
            print(f"INVALID for {args.model}: {e}", file=sys.stderr)
            return 1
    print("\n".join(table(adapter)))
    if not adapter.in_out:
        print("(bytes are padded rows; pass --model for each module's exact bytes)")
    if args.model:
        print(f"valid for {args.model} ({spec.num_layers} layers, hidden {spec.hidden_size}; "
              f"fingerprint {adapter.metadata.fingerprint})")
    return 0
