"""bitsandbytes checkpoints (`quant_method: bitsandbytes`), dequantized at load: NF4 / FP4 (what QLoRA adapters are
trained on) are codebooks, not linear codes, so they cannot stay in the canonical form; they load at the
memory of a 16-bit model, with the weights the files define.

4-bit (`load_in_4bit`), per projection `P` (N x K, block size B, usually 64):
  P.weight             uint8 [N K / 2, 1]  two codes a byte, the first in the high nibble
  P.weight.quant_map   float32 [16]        the codebook (NF4 or FP4 values)
  P.weight.absmax      float32 [N K / B]   one scale a block of B values (flattened row-major), or, with
                                           double quantization, uint8 codes of those scales:
  P.weight.nested_quant_map  float32 [256], P.weight.nested_absmax float32 [ceil(N K / B / B2)]:
                                           absmax = nested_quant_map[code] * nested_absmax[i // B2] + offset
  P.weight.quant_state.bitsandbytes__nf4 (or __fp4)  uint8: JSON with blocksize, shape, and for double
                                           quantization nested_blocksize (B2) and nested_offset
  w.flat[j] = quant_map[code j] * absmax[j // B]
8-bit (`load_in_8bit`, LLM.int8): P.weight int8 [N, K], P.SCB float32 [N] (each row's absolute maximum):
  w[n, k] = weight[n, k] * SCB[n] / 127
"""
from __future__ import annotations

import json
from typing import Any, Callable

import torch

from compute_service.engine.errors import ModelLoadError
from compute_service.engine.quant_formats.dequantized import DequantizingSource

FORMAT = "bitsandbytes"
_STATE = ("quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")


def is_bnb(qcfg: dict[str, Any]) -> bool:
    return str(qcfg.get("quant_method", "")).lower() == FORMAT


def _four_bit(name: str, packed: torch.Tensor, state: dict[str, Any],
              raw: Callable[[str], torch.Tensor | None]) -> torch.Tensor:
    def need(suffix: str) -> torch.Tensor:
        t = raw(f"{name}.{suffix}")
        if t is None:
            raise ModelLoadError(f"4-bit bitsandbytes weight {name!r} lacks {name}.{suffix}")
        return t

    shape, block = [int(d) for d in state["shape"]], int(state["blocksize"])
    numel = shape[0] * shape[1]
    b = packed.reshape(-1)
    codes = torch.stack([b >> 4, b & 15], dim=1).reshape(-1)[:numel].long()
    absmax = need("absmax")
    if "nested_blocksize" in state:
        nested = need("nested_absmax").float().repeat_interleave(int(state["nested_blocksize"]))[:absmax.numel()]
        absmax = need("nested_quant_map").float()[absmax.long()] * nested + float(state["nested_offset"])
    scales = absmax.float().repeat_interleave(block)[:numel]
    if scales.numel() != numel:
        raise ModelLoadError(f"{name}: {absmax.numel()} block scales of {block} do not cover shape {shape}")
    return (need("quant_map").float()[codes] * scales).reshape(shape)


def dequantize(name: str, t: torch.Tensor, raw: Callable[[str], torch.Tensor | None],
               place: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """A bitsandbytes weight as float32 (module docstring); None for tensors stored otherwise."""
    if not name.endswith(".weight"):
        return None
    if t.dtype == torch.uint8:
        state = next((s for s in (raw(f"{name}.{key}") for key in _STATE) if s is not None), None)
        if state is None:
            return None
        return _four_bit(name, place(t), json.loads(bytes(state.cpu().tolist())), raw)
    scb = raw(name.removesuffix(".weight") + ".SCB") if t.dtype == torch.int8 else None
    if scb is None:
        return None
    return place(t).float() * (scb.float() / 127.0)[:, None]


def bnb_source(raw: Callable[[str], torch.Tensor | None], qcfg: dict[str, Any]) -> DequantizingSource:
    kind = ("4-bit " + str(qcfg.get("bnb_4bit_quant_type", "nf4")).upper() if qcfg.get("load_in_4bit")
            else "8-bit" if qcfg.get("load_in_8bit") else "")
    return DequantizingSource(raw, dequantize, f"bitsandbytes {kind} checkpoint".replace("  ", " "))
