"""Run in a subprocess whose path holds the quantization tool (tests/engine/test_quant_cross_check.py):
quantizes a saved transformers model (loaded in bfloat16, so scales are bfloat16 as in published
checkpoints) to int4 weights, symmetric, group-wise, round-to-nearest (no calibration data), writes it in
the compressed-tensors "pack-quantized" format, then reads the saved codes back with the tool's own
unpacking and writes (q - zero point) * scale in float32 per projection, as the reference.

    python cross_check_quantize.py SRC OUT GROUP_SIZE REFERENCE.safetensors
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier


def dequantized(saved: dict[str, torch.Tensor], group: int) -> dict[str, torch.Tensor]:
    out = {}
    for key in saved:
        if not key.endswith(".weight_packed"):
            continue
        base = key.removesuffix("_packed")
        shape = torch.Size(saved[f"{base}_shape"].tolist())
        q = unpack_from_int32(saved[key], 4, shape).float()
        scale = saved[f"{base}_scale"].float()
        zero = saved.get(f"{base}_zero_point")
        n, k = shape
        grouped = q.view(n, k // group, group)
        if zero is not None:
            grouped = grouped - zero.float().view(n, k // group, 1)
        out[base] = (grouped * scale.view(n, k // group, 1)).view(n, k)
    return out


def main() -> None:
    src, out, group, ref = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                 "strategy": "group", "group_size": group}}
    oneshot(model=model, recipe=QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    model.save_pretrained(out, save_compressed=True)
    saved = {}
    for f in sorted(out.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    reference = dequantized(saved, group)
    save_file({k: v.contiguous() for k, v in reference.items()}, str(ref))
    print(f"quantized {len(reference)} projections into {out}")


if __name__ == "__main__":
    main()
