"""Gateway settings that are not about keys or TLS."""
import pytest

from gateway.config import GatewayConfig
from loraplex.settings import SettingsError, settings_from_args


def test_switch_interval_defaults_to_half_a_millisecond_and_reads_the_environment():
    assert GatewayConfig().gil_switch_interval_us == 500
    cfg = settings_from_args(GatewayConfig, environ={"LORAPLEX_GIL_SWITCH_INTERVAL_US": "0"})
    assert cfg.gil_switch_interval_us == 0            # 0: Python's own interval is left alone
    with pytest.raises(SettingsError, match="gil_switch_interval_us"):
        GatewayConfig(gil_switch_interval_us=-1)
