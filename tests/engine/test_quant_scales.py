"""Checkpoint scales that float16 (the kernels' scale type) cannot hold: said once, or refused."""
from __future__ import annotations

import logging

import pytest
import torch

from compute_service.engine.errors import ModelLoadError
from compute_service.engine.quant_formats import common
from compute_service.engine.quant_formats.common import from_zero_points


@pytest.fixture(autouse=True)
def fresh_reports(monkeypatch):
    monkeypatch.setattr(common, "_reported", set())


def _load(scale: float, dtype: torch.dtype = torch.float32, name: str = "p"):
    q = torch.full((2, 8), 9, dtype=torch.uint8)
    scales = torch.full((2, 2), scale, dtype=dtype)
    return from_zero_points(name, q, scales, torch.full((2, 2), 8.0), 4)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_exact_scales_say_nothing(caplog):
    with caplog.at_level(logging.DEBUG):
        w = _load(0.0078125)                       # a power of two: exact in float16
        _load(0.0078125, torch.bfloat16)
    assert _warnings(caplog) == [] and w.scales.dtype == torch.float16


def test_float32_scales_are_rounded_with_one_warning(caplog):
    with caplog.at_level(logging.DEBUG):
        w = _load(0.01)
        _load(0.01, name="q")
    assert len(_warnings(caplog)) == 1 and "11 significant bits" in _warnings(caplog)[0]
    assert any(r.levelno == logging.DEBUG and r.getMessage().startswith("q:") for r in caplog.records)
    assert abs(float(w.scales[0, 0]) - 0.01) <= 0.01 * 2 ** -11


def test_scales_below_float16s_normal_range_are_named(caplog):
    with caplog.at_level(logging.WARNING):
        _load(1e-6, torch.bfloat16)
    assert len(_warnings(caplog)) == 1 and "below float16's normal range" in _warnings(caplog)[0]


def test_scales_beyond_float16_are_refused():
    with pytest.raises(ModelLoadError, match="beyond float16's range"):
        _load(1e5)
