"""`loraplex quantize`: a base model -> a weight-only quantized HF folder (round to nearest).

Reads a HF safetensors folder or a GGUF file, quantizes every projection (q, k, v, o, gate, up,
down) group-wise to `--bits` with round-to-nearest, and writes a folder in the AWQ (GEMM),
compressed-tensors (pack-quantized) or GPTQ layout: config.json with its `quantization_config`,
model.safetensors, and the tokenizer files. `loraplex serve --model OUT` serves it kept quantized
on a GPU; other engines that read those formats read it too. Embeddings, norms and the LM head
are copied as they are. See docs/quantization.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

FORMATS = ("compressed-tensors", "awq", "gptq")      # export.FORMATS, without importing torch here


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="quantize a base model to 4 or 8 bits (AWQ, compressed-tensors or GPTQ)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="HF safetensors folder or .gguf file")
    p.add_argument("out", type=Path, help="output folder (new or empty)")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4, help="bits a weight (default 4; AWQ holds 4 only)")
    p.add_argument("--group-size", type=int, default=128,
                   help="input features sharing one scale and zero point (default 128; the GPU kernel takes "
                        "multiples of 32 dividing or divisible by 256)")
    p.add_argument("--format", choices=FORMATS, default="compressed-tensors",
                   help="output layout (default compressed-tensors; gptq: channels in the model's order, desc_act "
                        "false, as round-to-nearest has no activation order to follow)")
    p.add_argument("--symmetric", action="store_true",
                   help="symmetric quantization (zero point at mid-range; default asymmetric, min-max)")
    p.add_argument("--device", default="auto",
                   help="where to round and pack: auto, cpu or cuda[:N] (default auto: a GPU if there is one)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.group_size < 1:
        print("loraplex quantize: --group-size must be positive", file=sys.stderr)
        return 2
    # The engine's modules load torch: imported here, so `loraplex --help` stays fast.
    from compute_service.build import resolve_device
    from compute_service.engine.errors import ModelLoadError
    from compute_service.engine.quant_formats.export import quantize_checkpoint

    error = None if args.model.exists() else f"{args.model} does not exist (want a HF folder or a .gguf file)"
    if error is None:
        try:
            result = quantize_checkpoint(args.model, args.out, bits=args.bits, group_size=args.group_size,
                                         fmt=args.format, symmetric=args.symmetric, progress=not args.quiet,
                                         device=resolve_device(args.device))
        except (ModelLoadError, ValueError, OSError, RuntimeError) as exc:
            error = str(exc)
            if "out of memory" in error.lower():
                error += f" (quantizing on {args.device}: --device cpu quantizes in host memory instead)"
    if error is not None:
        print(f"loraplex quantize: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.format} {args.bits}-bit group {args.group_size} {result.out}: {result.num_quantized} "
          f"projections quantized ({result.quantized_bytes / 2**20:.1f} MiB), "
          f"{result.dense_bytes / 2**20:.1f} MiB dense; tokenizer: {result.tokenizer}")
    if result.not_converted:
        print(f"  kept dense (group size does not divide their in features): {', '.join(result.not_converted)}")
    return 0
