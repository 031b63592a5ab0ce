"""GGUF files give Llama-3 RoPE scaling as per-frequency divisors of the angles (`rope_freqs`, Llama 3.1 and
later) or as a linear factor; the engine reads them back as the Llama-3 scaling with the same angles."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from compute_service.engine import UnsupportedModelError, load_model
from compute_service.engine.quant_formats.export import quantize_checkpoint
from compute_service.engine.rope import inv_frequencies, llama3_scaling_from_divisors
from compute_service.engine.spec import RopeScaling
from helpers import TINY_DIMS, rel_err
from quant_helpers import write_tiny_gguf
from test_loader import prefill_logits

LLAMA_31 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def converter_divisors(s: RopeScaling, head_dim: int, theta: float) -> np.ndarray:
    """float32 divisors as a GGUF converter writes them, from the scaling's definition: 1 below the short
    wavelength bound, `factor` above the long one, 1 / ((1 - t) / factor + t) between (t the blend)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
            out.append(1.0)
        elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
            out.append(s.factor)
        else:
            t = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                 / (s.high_freq_factor - s.low_freq_factor))
            out.append(1 / ((1 - t) / s.factor + t))
    return np.asarray(out, dtype=np.float32)


def angles_equal(scaling: RopeScaling | None, divisors: np.ndarray, head_dim: int, theta: float) -> bool:
    want = inv_frequencies(head_dim, theta, None).double() / torch.from_numpy(divisors.astype(np.float64))
    return bool(torch.allclose(inv_frequencies(head_dim, theta, scaling).double(), want, rtol=1e-5, atol=0))


@pytest.mark.parametrize("scaling,head_dim,theta", [
    (LLAMA_31, 128, 500000.0),                                                     # Llama 3.1 8B / 70B
    (RopeScaling(32.0, 1.0, 4.0, 8192), 64, 500000.0),                             # Llama 3.2 1B
    (RopeScaling(16.0, 2.0, 8.0, 4096), 64, 1e6),
    (RopeScaling(8.0, 1.0, 4.0, 16), 16, 500000.0),                                # one blended frequency
    (RopeScaling(4.0, 1.0, 1.5, 64), 32, 10000.0),                                 # none blended
])
def test_divisors_read_back_as_a_scaling_with_the_same_angles(scaling, head_dim, theta):
    divisors = converter_divisors(scaling, head_dim, theta)
    got = llama3_scaling_from_divisors(divisors, head_dim, theta)
    assert got is not None and got.factor == pytest.approx(scaling.factor)
    assert angles_equal(got, divisors, head_dim, theta)
    assert not angles_equal(None, divisors, head_dim, theta)


def test_llama_31_divisors_give_its_own_parameters():
    got = llama3_scaling_from_divisors(converter_divisors(LLAMA_31, 128, 500000.0), 128, 500000.0)
    assert got.original_max_position_embeddings == 8192
    assert got.low_freq_factor == pytest.approx(1.0, rel=1e-4) and got.high_freq_factor == pytest.approx(4.0, rel=1e-4)


def test_uniform_divisors_are_linear_scaling_a_step_has_no_blend_and_ones_none():
    assert llama3_scaling_from_divisors(np.ones(32), 64, 10000.0) is None
    for divisors in (np.full(32, 4.0), np.r_[np.ones(9), np.full(23, 4.0)]):
        assert angles_equal(llama3_scaling_from_divisors(divisors, 64, 10000.0), divisors, 64, 10000.0)


@pytest.mark.parametrize("divisors", [
    np.linspace(8.0, 1.0, 32),                   # largest on the shortest wavelengths
    np.r_[np.ones(10), np.full(11, 3.0), np.full(11, 8.0)],          # a plateau no blend makes
    np.r_[np.ones(31), np.nan],
    np.ones(31),                                 # not head_dim / 2 of them
])
def test_divisors_that_are_no_llama3_scaling_are_refused(divisors):
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        llama3_scaling_from_divisors(divisors, 64, 500000.0)


def test_a_gguf_with_rope_freqs_gives_the_hf_model_s_logits(tiny_models, tmp_path):
    """The tiny Llama with Llama-3 scaling, as GGUF with the divisors tensor: its logits at every position are
    the HF model's (without the tensor the positions past the first differ)."""
    model, _ = tiny_models["llama"]
    cfg = model.config
    rope = cfg.rope_parameters
    scaling = RopeScaling(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                          rope["original_max_position_embeddings"])
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    tokens = torch.randint(0, TINY_DIMS["vocab_size"], (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0]
    with_freqs = load_model(write_tiny_gguf(model, tmp_path / "freqs.gguf", {},
                                            converter_divisors(scaling, head_dim, rope["rope_theta"])))
    assert with_freqs.spec.rope_scaling is not None
    assert rel_err(prefill_logits(with_freqs, tokens), ref) < 1e-4
    plain = load_model(write_tiny_gguf(model, tmp_path / "plain.gguf", {}))
    assert plain.spec.rope_scaling is None and rel_err(prefill_logits(plain, tokens), ref) > 1e-3
    # `loraplex quantize` of that file writes the scaling into its config.json, which loads back to it
    out = quantize_checkpoint(tmp_path / "freqs.gguf", tmp_path / "awq", fmt="awq", group_size=16, progress=False).out
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    assert load_model(out).spec.rope_scaling == with_freqs.spec.rope_scaling


def test_a_gguf_with_linear_scaling_divides_every_angle(tiny_models, tmp_path):
    model, _ = tiny_models["llama_tied"]
    path = write_tiny_gguf(model, tmp_path / "linear.gguf", {},
                           fields={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    spec = load_model(path).spec
    head_dim = spec.head_dim
    assert angles_equal(spec.rope_scaling, np.full(head_dim // 2, 4.0), head_dim, spec.rope_theta)
    yarn = write_tiny_gguf(model, tmp_path / "yarn.gguf", {}, fields={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(UnsupportedModelError, match="yarn.gguf: GGUF rope scaling 'yarn' is not supported"):
        load_model(yarn)
