"""Checkpoints whose weights load dequantized (no kernels for their stored form), each giving the logits of the
same model with the weights the files define, in `keep` and `none` modes alike:
- FP8: block-wise `quant_method: fp8` (scale_inv per 16 x 16 block here) and compressed-tensors float weights
  (a scale per channel);
- bitsandbytes: 4-bit (a 16-value codebook a block of 64, with and without double quantization of the block
  scales) and 8-bit (int8 rows with their absolute maxima); where the library itself is installed, its own
  dequantization of its own quantized tensors equals ours."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from compute_service.engine import UnsupportedModelError, load_model
from compute_service.engine.model import LAYER_PROJECTIONS
from compute_service.engine.quant_formats import bnb
from helpers import TINY_DIMS
from quant_helpers import check_loads_dequantized, with_weights, write_stored_folder

TOKENS = torch.randint(0, TINY_DIMS["vocab_size"], (13,), generator=torch.Generator().manual_seed(8)).tolist()
FP8_MAX = 448.0
CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                               "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
FP8_CONFIGS = {
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]},
    "ct-channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                   "config_groups": {"group_0": CT_GROUP}, "ignore": ["lm_head"]},
}
BLOCK, NESTED_BLOCK = 64, 256
BNB_CONFIGS = {
    "nf4": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": False},
    "nf4-double": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                   "bnb_4bit_use_double_quant": True},
    "int8": {"quant_method": "bitsandbytes", "load_in_8bit": True},
}


def fp8_tensors(w: torch.Tensor, layout: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the projection's tensors by suffix, the weight they define)."""
    n, k = w.shape
    if layout == "fp8-block":
        blocks = w.reshape(n // 16, 16, k // 16, 16).abs().amax((1, 3))                  # [N/16, K/16]
        scale = (blocks / FP8_MAX).clamp_min(1e-8)
        full = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
        names = (".weight", ".weight_scale_inv")
    else:
        scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp_min(1e-8)                # [N, 1]
        full = scale.expand(n, k)
        names = (".weight", ".weight_scale")
    q = (w / full).to(torch.float8_e4m3fn)
    return {names[0]: q, names[1]: scale, ".input_scale": torch.ones(1)}, q.float() * full


def nearest(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return (values[..., None] - table).abs().argmin(-1)


def bnb_tensors(w: torch.Tensor, kind: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the projection's tensors by suffix, as the format lays them out; the weight they define)."""
    if kind == "int8":
        scb = w.abs().amax(1)
        cb = torch.round(w / scb[:, None] * 127).to(torch.int8)
        return {".weight": cb, ".SCB": scb}, cb.float() * (scb / 127)[:, None]
    table = torch.sort(torch.rand(16, generator=torch.Generator().manual_seed(1)) * 2 - 1).values
    blocks = w.reshape(-1, BLOCK)
    absmax = blocks.abs().amax(1)
    codes = nearest(blocks / absmax[:, None], table).reshape(-1)
    out = {".weight": ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8)[:, None], ".weight.quant_map": table}
    state = {"quant_type": "nf4", "blocksize": BLOCK, "dtype": "float32", "shape": list(w.shape)}
    if kind == "nf4-double":
        nested_map = torch.linspace(-1, 1, 256)
        offset = float(absmax.mean())
        chunks = torch.nn.functional.pad(absmax - offset, (0, -absmax.numel() % NESTED_BLOCK)).reshape(-1, NESTED_BLOCK)
        nested_absmax = chunks.abs().amax(1)
        absmax_codes = nearest(chunks / nested_absmax[:, None], nested_map).reshape(-1)[:absmax.numel()]
        absmax = nested_map[absmax_codes] * nested_absmax.repeat_interleave(NESTED_BLOCK)[:absmax.numel()] + offset
        out.update({".weight.absmax": absmax_codes.to(torch.uint8), ".weight.nested_absmax": nested_absmax,
                    ".weight.nested_quant_map": nested_map})
        state.update(nested_blocksize=NESTED_BLOCK, nested_offset=offset, nested_dtype="float32")
    else:
        out[".weight.absmax"] = absmax
    out[".weight.quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    return out, (table[codes].reshape(-1, BLOCK) * absmax[:, None]).reshape(w.shape)


CASES = {**{name: (cfg, fp8_tensors, "FP8 checkpoint") for name, cfg in FP8_CONFIGS.items()},
         **{name: (cfg, bnb_tensors, "bitsandbytes") for name, cfg in BNB_CONFIGS.items()}}


def folder_of(name: str, tiny_models, tmp_path):
    """(the folder of the tiny Llama stored as case `name`, the model with the weights it defines)."""
    model, src = tiny_models["llama"]
    cfg, stored, _ = CASES[name]
    folder, defined = write_stored_folder(model, src, tmp_path / name, cfg, lambda _, w: stored(w, name))
    return folder, with_weights(model, defined)


@pytest.mark.parametrize("name", sorted(CASES))
def test_loads_dequantized_with_the_file_s_weights(name, tiny_models, tmp_path, caplog):
    check_loads_dequantized(*folder_of(name, tiny_models, tmp_path), TOKENS, caplog, CASES[name][2])


def test_fp8_and_int_groups_mixed_are_refused():
    from compute_service.engine.quant_formats.fp8 import is_fp8

    mixed = copy.deepcopy(FP8_CONFIGS["ct-channel"])
    mixed["config_groups"]["group_1"] = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}
    with pytest.raises(UnsupportedModelError, match="mixing FP8 and other weights"):
        is_fp8(mixed)
    assert not is_fp8({"quant_method": "awq"}) and is_fp8(FP8_CONFIGS["fp8-block"])
    int_only = copy.deepcopy(FP8_CONFIGS["ct-channel"])
    int_only["config_groups"]["group_0"]["weights"] = {"num_bits": 4, "type": "int"}
    assert not is_fp8(int_only)         # the int reader's own check refuses naive-quantized int weights


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double", [False, True])
def test_the_library_s_own_tensors_dequantize_as_it_does(quant_type, double):
    """(Runs where bitsandbytes is installed; it is not in the test dependencies.)"""
    functional = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(96, 320, generator=torch.Generator().manual_seed(4))
    q, state = functional.quantize_4bit(w, blocksize=BLOCK, quant_type=quant_type, compress_statistics=double)
    raw = {"p.weight": q, **{f"p.weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
    got = bnb.dequantize("p.weight", q, raw.get, lambda t: t)
    assert torch.equal(got, functional.dequantize_4bit(q, state).float())
    cb, scb, _ = functional.int8_vectorwise_quant(w)
    got8 = bnb.dequantize("p.weight", cb, {"p.SCB": scb}.get, lambda t: t)
    assert torch.allclose(got8, functional.int8_vectorwise_dequant(cb, scb), rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FP8_CONFIGS))
def test_gpu_load_dequantizes_fp8_there_with_the_host_s_weights(name, tiny_models, tmp_path):
    """On a GPU the FP8 weights are dequantized there (`work_device`): the same float32 products as the host's,
    so the same weights (cast alike) and fingerprint."""
    folder, _ = folder_of(name, tiny_models, tmp_path)
    host, gpu = load_model(folder), load_model(folder, device="cuda")
    assert host.fingerprint == gpu.fingerprint
    for a, b in zip(host.model.weights.layers, gpu.model.weights.layers):
        for name in LAYER_PROJECTIONS:
            assert torch.equal(getattr(a, name).weight, getattr(b, name).weight.cpu()), name
