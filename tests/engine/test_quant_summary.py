"""The start-up summary's warning for large models kept 4-bit in groups under 128 (their decode of many
sequences is slower than 16 bits: bench/results/quant_decode_g32.json)."""
import logging

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
