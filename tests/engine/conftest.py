"""Engine test fixtures: tiny random models saved once per session."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import save_tiny, tiny_model, w4_mid_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, tuple[object, Path]]:
    """kind -> (transformers model, saved folder) for "llama", "qwen2", "llama_tied"."""
    out = {}
    for i, kind in enumerate(("llama", "qwen2", "llama_tied")):
        model = tiny_model(kind, seed=i)
        out[kind] = (model, save_tiny(model, tmp_path_factory.mktemp(kind)))
    return out


@pytest.fixture(scope="session")
def w4_llama(tmp_path_factory) -> tuple[Path, Path]:
    """(a 4-bit MID_DIMS llama in groups of 128, the folder of its adapter "all"): `helpers.w4_mid_llama`, made
    once for the GPU tests of the engine's 4-bit kernels."""
    return w4_mid_llama(tmp_path_factory)
