"""Settings: flags over environment over defaults, validated."""
import argparse
from dataclasses import dataclass, field

import pytest

from loraplex.settings import SettingsError, add_dataclass_flags, parse_size, settings_from_args


@dataclass(frozen=True)
class Demo:
    listen: str = field(default="127.0.0.1:1", metadata={"help": "where"})
    size: int = 10
    ratio: float = 0.5
    flag: bool = False
    hosts: tuple[str, ...] = ("a",)

    def __post_init__(self):
        if self.size < 0:
            raise SettingsError("size: must be >= 0")


def parse(argv, env):
    p = argparse.ArgumentParser()
    add_dataclass_flags(p, Demo)
    return settings_from_args(Demo, p.parse_args(argv), environ=env)


def test_precedence_flag_env_default():
    assert parse([], {}) == Demo()
    assert parse([], {"LORAPLEX_SIZE": "7"}).size == 7
    assert parse(["--size", "9"], {"LORAPLEX_SIZE": "7"}).size == 9
    s = parse(["--flag", "--hosts", "x:1,y:2", "--ratio", "0.25"], {})
    assert s.flag is True and s.hosts == ("x:1", "y:2") and s.ratio == 0.25
    assert parse([], {"LORAPLEX_FLAG": "true"}).flag is True


def test_bad_values_are_clear():
    with pytest.raises(SettingsError, match="size"):
        parse(["--size", "abc"], {})
    with pytest.raises(SettingsError, match="must be >= 0"):
        parse(["--size", "-1"], {})


def test_byte_fields_take_sizes():
    @dataclass(frozen=True)
    class WithBytes:
        cache_bytes: int = 1

    p = argparse.ArgumentParser()
    add_dataclass_flags(p, WithBytes)
    assert settings_from_args(WithBytes, p.parse_args(["--cache-bytes", "1GiB"]), environ={}).cache_bytes == 1 << 30
    assert settings_from_args(WithBytes, p.parse_args([]), environ={"LORAPLEX_CACHE_BYTES": "2M"}).cache_bytes == 2 << 20


def test_parse_size():
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("512M") == 512 << 20
    assert parse_size(1024) == 1024
    with pytest.raises(SettingsError):
        parse_size("lots")
