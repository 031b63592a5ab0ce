"""Engine test fixtures: tiny random models saved once per session."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import save_tiny, tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, tuple[object, Path]]:
    """kind -> (transformers model, saved folder) for "llama", "qwen2", "llama_tied"."""
    out = {}
    for i, kind in enumerate(("llama", "qwen2", "llama_tied")):
        model = tiny_model(kind, seed=i)
        out[kind] = (model, save_tiny(model, tmp_path_factory.mktemp(kind)))
    return out
