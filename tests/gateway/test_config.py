"""Gateway settings that are not about keys or TLS."""
import argparse

import pytest

from gateway.config import GatewayConfig
from gateway.token_stream import DEFAULT_MAX_BUFFERED_TOKENS
from loraplex.settings import SettingsError, add_dataclass_flags, settings_from_args


def test_switch_interval_defaults_to_half_a_millisecond_and_reads_the_environment():
    assert GatewayConfig().gil_switch_interval_us == 500
    cfg = settings_from_args(GatewayConfig, environ={"LORAPLEX_GIL_SWITCH_INTERVAL_US": "0"})
    assert cfg.gil_switch_interval_us == 0            # 0: Python's own interval is left alone
    with pytest.raises(SettingsError, match="gil_switch_interval_us"):
        GatewayConfig(gil_switch_interval_us=-1)


def test_max_buffered_tokens_is_a_flag_defaulting_to_the_streams_bound_and_must_be_positive():
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, GatewayConfig)
    assert settings_from_args(GatewayConfig, parser.parse_args([]), environ={}).max_buffered_tokens == 4096
    assert DEFAULT_MAX_BUFFERED_TOKENS == 4096
    args = parser.parse_args(["--max-buffered-tokens", "256"])
    assert settings_from_args(GatewayConfig, args, environ={}).max_buffered_tokens == 256
    with pytest.raises(SettingsError, match="max_buffered_tokens"):
        GatewayConfig(max_buffered_tokens=0)
