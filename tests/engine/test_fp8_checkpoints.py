"""FP8 checkpoints load dequantized: block-wise `quant_method: fp8` (scale_inv per 16 x 16 block here) and
compressed-tensors float weights (a scale per channel), each giving the logits of the same model with the
weights the file defines (FP8 value times its scale), in `keep` and `none` modes alike."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from compute_service.engine import UnsupportedModelError, load_model
from compute_service.engine.linear import Linear
from compute_service.engine.model import LAYER_PROJECTIONS
from helpers import TINY_DIMS, rel_err
from quant_helpers import projection_weights
from test_loader import prefill_logits

TOKENS = torch.randint(0, TINY_DIMS["vocab_size"], (13,), generator=torch.Generator().manual_seed(8)).tolist()
FP8_MAX = 448.0
CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                               "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
CONFIGS = {
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]},
    "ct-channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                   "config_groups": {"group_0": CT_GROUP}, "ignore": ["lm_head"]},
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


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tiny_models, tmp_path_factory):
    model, src = tiny_models["llama"]
    tensors = load_file(str(src / "model.safetensors"))
    reference = copy.deepcopy(model)
    sd = reference.state_dict()
    for prefix, w in projection_weights(model).items():
        part, defined = fp8_tensors(w, request.param)
        del tensors[prefix + ".weight"]
        tensors.update({prefix + suffix: t for suffix, t in part.items()})
        sd[prefix + ".weight"].copy_(defined)
    folder = tmp_path_factory.mktemp(request.param)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = CONFIGS[request.param]
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder, reference


def test_fp8_loads_dequantized_with_the_file_s_weights(checkpoint, caplog):
    folder, reference = checkpoint
    with torch.no_grad():
        want = reference(torch.tensor([TOKENS])).logits[0]
    for mode in ("keep", "none"):
        with caplog.at_level("INFO"):
            loaded = load_model(folder, quantization=mode)
        assert all(isinstance(getattr(lw, n), Linear) for lw in loaded.model.weights.layers for n in LAYER_PROJECTIONS)
        assert rel_err(prefill_logits(loaded, TOKENS), want) < 1e-5, mode
    assert "FP8 checkpoint" in caplog.text and "dequantized at load" in caplog.text


def test_fp8_and_int_groups_mixed_are_refused():
    from compute_service.engine.quant_formats.fp8 import is_fp8

    mixed = copy.deepcopy(CONFIGS["ct-channel"])
    mixed["config_groups"]["group_1"] = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}
    with pytest.raises(UnsupportedModelError, match="mixing FP8 and other weights"):
        is_fp8(mixed)
    assert not is_fp8({"quant_method": "awq"}) and is_fp8(CONFIGS["fp8-block"])
    int_only = copy.deepcopy(CONFIGS["ct-channel"])
    int_only["config_groups"]["group_0"]["weights"] = {"num_bits": 4, "type": "int"}
    assert not is_fp8(int_only)         # the int reader's own check refuses naive-quantized int weights


@pytest.mark.gpu
def test_gpu_load_dequantizes_fp8_there_with_the_host_s_weights(checkpoint):
    """On a GPU the FP8 weights are dequantized there (`work_device`): the same float32 products as the host's,
    so the same weights (cast alike) and fingerprint."""
    folder, _ = checkpoint
    host, gpu = load_model(folder), load_model(folder, device="cuda")
    assert host.fingerprint == gpu.fingerprint
    for a, b in zip(host.model.weights.layers, gpu.model.weights.layers):
        for name in LAYER_PROJECTIONS:
            assert torch.equal(getattr(a, name).weight, getattr(b, name).weight.cpu()), name
