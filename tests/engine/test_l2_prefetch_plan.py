"""LORAPLEX_L2_PREFETCH's plans (compute_service/engine/l2_prefetch.py): the rule syntax and its errors, the byte
ranges of a dense and of a quantized projection, and the per-layer chunk tables (the next layer's rules stop at the
last layer). The prefetch itself runs on the GPU only (tests/engine/test_l2_prefetch_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from compute_service.engine.l2_prefetch import Rule, linear_ranges, parse_plan, plan_tables, prefetcher_for
from compute_service.engine.linear import Linear
from compute_service.engine.model import LayerWeights
from compute_service.engine.quant_linear import QuantLinear
from compute_service.engine.quantized import quantize_rtn


def test_rules_parse():
    assert parse_plan("") == [] and parse_plan(" , ") == []
    assert parse_plan("post_qkv:o:1, pre_down:qkv+1:0.25-0.5") == [
        Rule("post_qkv", "o", False, 0.0, 1.0), Rule("pre_down", "qkv", True, 0.25, 0.5)]


@pytest.mark.parametrize("text, says", [
    ("post_qkv:o", "point:target:start-end"), ("after:o:1", "point must be"), ("pre_o:lm_head:1", "target must be"),
    ("pre_o:o:half", "fractions"), ("pre_o:o:0.5-0.2", "0 <= start < end <= 1"), ("pre_o:o:0-1.5", "start < end"),
    ("pre_o:o:0-0.2-0.4", "start < end")])
def test_bad_rules_say_what_is_wrong(text, says):
    with pytest.raises(ValueError, match="LORAPLEX_L2_PREFETCH") as e:
        parse_plan(text)
    assert says in str(e.value)


def _layers(n: int) -> list[LayerWeights]:
    def lin(rows: int, cols: int) -> Linear:
        return Linear(torch.zeros(rows, cols, dtype=torch.bfloat16))
    return [LayerWeights(torch.ones(8), lin(24, 8), lin(8, 16), torch.ones(8), lin(32, 8), lin(8, 16))
            for _ in range(n)]


def test_dense_ranges_are_weight_rows():
    w = _layers(1)[0].gate_up.weight
    assert linear_ranges(_layers(1)[0].gate_up, 0.0, 1.0)[0][1] == w.nbytes
    lin = Linear(w)
    assert linear_ranges(lin, 0.25, 0.5) == [(w.data_ptr() + 8 * 16, 8 * 16)]


def test_quantized_ranges_are_word_rows_and_scales_once():
    torch.manual_seed(0)
    ql = QuantLinear(quantize_rtn(torch.randn(64, 256), 4, 128), None, torch.device("cpu"), use_kernel=True)
    p = ql.packed
    first = linear_ranges(ql, 0.0, 0.5)
    assert first[0] == (p.words.data_ptr(), p.words.nbytes // 2)
    assert first[1:] == [(p.scales.data_ptr(), p.scales.nbytes), (p.offsets.data_ptr(), p.offsets.nbytes)]
    assert linear_ranges(ql, 0.5, 1.0) == [(p.words.data_ptr() + p.words.nbytes // 2, p.words.nbytes // 2)]


def test_tables_per_layer_and_point():
    layers = _layers(3)
    rules = parse_plan("post_qkv:o:1,post_qkv:gate_up:0.5,pre_down:qkv+1:1")
    tables = plan_tables(layers, rules, programs=2, device=torch.device("cpu"))
    assert set(tables) == {(0, "post_qkv"), (1, "post_qkv"), (2, "post_qkv"), (0, "pre_down"), (1, "pre_down")}
    assert tables[(1, "post_qkv")][:, 1].sum().item() == layers[1].o.weight.nbytes + layers[1].gate_up.weight.nbytes // 2
    assert tables[(1, "pre_down")][0, 0].item() == layers[2].qkv.weight.data_ptr()


def test_no_prefetcher_without_a_plan_or_on_the_cpu(monkeypatch):
    monkeypatch.delenv("LORAPLEX_L2_PREFETCH", raising=False)
    assert prefetcher_for(_layers(1), torch.device("cpu")) is None
    monkeypatch.setenv("LORAPLEX_L2_PREFETCH", "post_qkv:o:1")
    assert prefetcher_for(_layers(1), torch.device("cpu")) is None
    monkeypatch.setenv("LORAPLEX_L2_PREFETCH", "post_qkv:o")
    with pytest.raises(ValueError, match="point:target"):
        prefetcher_for(_layers(1), torch.device("cpu"))
