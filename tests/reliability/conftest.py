"""Fixtures of the reliability tests: a tiny random model with a tokenizer and PEFT adapters for it.

The systems themselves (bench/soak_stack.py) and the scenarios (bench/soak_scenarios.py) are the ones
bench/soak.py runs at scale; here they run small enough for CI. LORAPLEX_SOAK_STREAMS sets the number of
concurrent streams of the soak (default 1000).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from soak_stack import make_model, write_adapters  # noqa: E402

NUM_ADAPTERS = 6


@pytest.fixture(scope="session")
def soak_model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("soak") / "model")


@pytest.fixture(scope="session")
def soak_adapters(soak_model, tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("soak-adapters")
    return root, write_adapters(root, soak_model, NUM_ADAPTERS)
