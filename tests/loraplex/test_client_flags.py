"""The CLI's connection flags: LORAPLEX_TLS is read as the services read every boolean setting."""
from __future__ import annotations

import argparse

import pytest

from loraplex.cli._gateway_client import add_client_flags, client_options
from loraplex.settings import SettingsError


def _options(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_client_flags(parser)
    return client_options(parser.parse_args(argv))


@pytest.mark.parametrize("value, tls", [("", False), ("0", False), ("false", False), ("Off", False),
                                        ("1", True), ("true", True), ("YES", True)])
def test_loraplex_tls_env_is_a_boolean(monkeypatch, value, tls):
    monkeypatch.setenv("LORAPLEX_TLS", value)
    assert _options([])["tls"] is tls
    assert _options(["--tls"])["tls"] is True


def test_a_bad_loraplex_tls_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("LORAPLEX_TLS", "maybe")
    with pytest.raises(SettingsError, match="LORAPLEX_TLS"):
        _options([])
