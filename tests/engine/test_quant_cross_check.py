"""A checkpoint made by the compressed-tensors project's own quantization tool loads and serves in loraplex.

The tool (installed by `scripts/setup.sh --test` beside .venv, its pins apart from ours:
`LORAPLEX_QUANT_TOOL_SITE`) quantizes a tiny Llama to int4, symmetric, group 16, round-to-nearest,
in a subprocess, and writes the weights its own forward uses (fake-quantized) as the reference. Then:
every projection loads kept quantized with exactly those values, the logits equal the same checkpoint
dequantized, and `loraplex quantize`'s own round-to-nearest of the same model lands within one
quantization step of the tool's (the two differ in the symmetric range: the tool divides the absolute
maximum by 7.5, loraplex by 7, so the codes are compared by their error, not for equality).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from compute_service.engine import load_model
from compute_service.engine.quant_formats.export import quantize_checkpoint
from compute_service.engine.quant_linear import QuantLinear
from helpers import rel_err
from quant_helpers import projection_weights
from test_loader import prefill_logits

SITE = os.environ.get("LORAPLEX_QUANT_TOOL_SITE", str(Path(__file__).resolve().parents[2] / ".venv-side"
                                                      / "quant-tool"))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (Path(SITE) / "llmcompressor").is_dir(),
                                                   reason=f"the quantization tool is not installed in {SITE}")]
G = 16
FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
TOKENS = torch.randint(0, 96, (13,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def made_by_the_tool(tiny_models, tmp_path_factory):
    """(transformers model, its folder, the tool's quantized folder, the tool's dequantized weights)."""
    model, src = tiny_models["llama"]
    root = tmp_path_factory.mktemp("tool")
    out, ref = root / "q", root / "reference.safetensors"
    env = dict(os.environ, PYTHONPATH=SITE)
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("cross_check_quantize.py")), str(src),
                          str(out), str(G), str(ref)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return model, src, out, load_file(str(ref))


def test_the_tools_checkpoint_loads_kept_quantized_with_its_own_values(made_by_the_tool):
    _, _, folder, reference = made_by_the_tool
    kept = load_model(folder, quantization="keep")
    for i, lw in enumerate(kept.model.weights.layers):
        for proj, parts in FUSED.items():
            layer = getattr(lw, proj)
            assert isinstance(layer, QuantLinear) and layer.bits == 4 and layer.group_size == G
            expected = torch.cat([reference[f"model.layers.{i}.{p}.weight"] for p in parts])
            assert torch.equal(layer.dequantize().float(), expected), (i, proj)


def test_the_tools_checkpoint_serves_as_its_dequantized_weights(made_by_the_tool):
    model, _, folder, _ = made_by_the_tool
    kept, dense = load_model(folder, quantization="keep"), load_model(folder, quantization="none")
    a, b = prefill_logits(kept, TOKENS), prefill_logits(dense, TOKENS)
    assert rel_err(a, b) < 1e-5
    with torch.no_grad():
        original = model(torch.tensor([TOKENS])).logits[0]
    assert rel_err(a, original) < 0.5        # still the model it came from, within 4-bit error


def test_loraplex_quantize_lands_within_a_step_of_the_tool(made_by_the_tool, tmp_path):
    model, src, _, reference = made_by_the_tool
    ours = quantize_checkpoint(src, tmp_path / "ours", fmt="compressed-tensors", bits=4, symmetric=True,
                               group_size=G, progress=False).out
    kept = load_model(ours, quantization="keep")
    weights = projection_weights(model)
    for i, lw in enumerate(kept.model.weights.layers):
        for proj, parts in FUSED.items():
            original = torch.cat([weights[f"model.layers.{i}.{p}"] for p in parts]).float()
            tool = torch.cat([reference[f"model.layers.{i}.{p}.weight"] for p in parts])
            mine = getattr(lw, proj).dequantize().float()
            step = original.abs().view(original.shape[0], -1, G).amax(-1, keepdim=True) / 7
            gap = ((mine - tool).abs().view(original.shape[0], -1, G) / step).amax()
            assert gap <= 1.0 + 1e-3, (i, proj, float(gap))
            err_mine, err_tool = rel_err(mine, original), rel_err(tool, original)
            assert err_mine < 1.5 * err_tool and err_tool < 1.5 * err_mine, (i, proj, err_mine, err_tool)
