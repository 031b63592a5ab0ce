"""Fixtures of the compute service tests: a tiny random Llama saved as a HF folder, and it loaded."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from compute_service.engine.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from helpers import save_tiny, tiny_model  # noqa: E402  (the engine tests' tiny-model builder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny(tiny_model("llama", seed=3), tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def loaded_cuda(tiny_model_dir):
    return load_model(tiny_model_dir, device="cuda")
