"""`loraplex keys add` writes its key file whole or not at all."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.api_keys import KeyEntry, hash_key, load_key_file
from loraplex.cli.keys import append_entry


def _entry(name: str) -> KeyEntry:
    return KeyEntry(name, hash_key(f"lpx-{name}-" + "k" * 32))


def test_entries_are_appended_and_the_new_file_is_private(tmp_path: Path):
    path = tmp_path / "keys.txt"
    append_entry(path, _entry("a"))
    append_entry(path, _entry("b"))
    assert [e.name for e in load_key_file(path)] == ["a", "b"]
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="already has a key named 'b'"):
        append_entry(path, _entry("b"))


def test_a_failed_write_leaves_the_old_file_whole_and_no_temporary(tmp_path: Path, monkeypatch):
    path = tmp_path / "keys.toml"
    append_entry(path, _entry("a"))
    before = path.read_text()

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        append_entry(path, _entry("b"))
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["keys.toml"]
