"""The start-up summary's warning for large models kept 4-bit in groups under 128 (their decode of many
sequences is slower than 16 bits: bench/results/quant_decode_g32.json), and its note on the float16-pairs
path's range."""
import logging

import torch

from compute_service.engine.quant_formats.summary import SLOW_GROUPS_MIN_BF16_BYTES, QuantSummary


def summary(kinds: dict[str, int], bf16_bytes: int) -> QuantSummary:
    s = QuantSummary("gguf")
    s.kinds.update(kinds)
    s.bf16_bytes = bf16_bytes
    return s


def test_large_models_in_groups_of_32_are_warned(caplog) -> None:
    big = 14 * 2**30                    # an 8B's projections in bf16
    s = summary({"4-bit group 32": 224}, big)
    with caplog.at_level(logging.WARNING):
        s.log()
    assert "4-bit group 32 projections (14.0 GiB in bf16)" in caplog.text and "--quantization none" in caplog.text
    assert "group 64" in summary({"4-bit group 64 act-order": 3, "4-bit group 128": 221}, big).slow_groups_note()


def test_groups_of_128_small_models_and_8_bits_are_not() -> None:
    assert summary({"4-bit group 128": 224}, 14 * 2**30).slow_groups_note() == ""
    assert summary({"4-bit group 32": 120}, SLOW_GROUPS_MIN_BF16_BYTES - 1).slow_groups_note() == ""   # SmolLM2-size
    assert summary({"8-bit group 32": 224}, 14 * 2**30).slow_groups_note() == ""
    assert summary({}, 14 * 2**30).slow_groups_note() == ""


def test_float16_pairs_range_is_stated_where_that_path_runs(caplog, monkeypatch) -> None:
    """bf16 on a GPU with 4-bit groups of 128+: the start-up log states the range and the switch; not in float16,
    on the CPU, in groups of 32, or with LORAPLEX_FP16_PAIRS=0."""
    s = summary({"4-bit group 128": 224}, 14 * 2**30)
    cuda = torch.device("cuda")
    with caplog.at_level(logging.INFO):
        s.log(torch.bfloat16, cuda)
    assert "below 32768" in caplog.text and "LORAPLEX_FP16_PAIRS=0" in caplog.text
    assert s.fp16_pairs_note(torch.float16, cuda) == ""
    assert s.fp16_pairs_note(torch.bfloat16, torch.device("cpu")) == ""
    assert summary({"4-bit group 32": 120}, 14 * 2**30).fp16_pairs_note(torch.bfloat16, cuda) == ""
    monkeypatch.setenv("LORAPLEX_FP16_PAIRS", "0")
    assert s.fp16_pairs_note(torch.bfloat16, cuda) == ""
