"""API key entries as stored: SHA-256 hashes with a name, scopes and limits, in key files and the env.

A key file is `.toml` (`[[keys]]` tables), `.json` (`{"keys": [...]}` or a
list) or, under any other name, one entry per line `NAME sha256:HEX
[adapters=a-,b-] [manage=true] [rate=R] [burst=B] [max_streams=S]` with `#`
comments. `LORAPLEX_API_KEYS` holds comma-separated keys (hashed on load) or
`sha256:` hashes, with every scope. `loraplex keys add/hash` writes entries;
`gateway.auth` enforces them. docs/security.md.
"""
from __future__ import annotations

import hashlib
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.settings import SettingsError, parse_bool

HASH_SCHEME = "sha256:"
MIN_KEY_CHARS = 16


@dataclass(frozen=True)
class KeyEntry:
    """One API key as stored: its hash, its name (what logs and refusals show) and its scope."""

    name: str
    key_hash: str                                   # "sha256:<64 hex>"
    adapters: tuple[str, ...] | None = None         # adapter-name prefixes; None: every adapter
    manage: bool = False                            # LoadLora/UnloadLora allowed
    rate: float | None = None                       # requests per second; None: the gateway's default
    burst: int | None = None                        # bucket size; None: the gateway's default
    max_streams: int | None = None                  # concurrent streams; None: the gateway's default

    def __post_init__(self) -> None:
        digest = self.key_hash[len(HASH_SCHEME):]
        if not self.key_hash.startswith(HASH_SCHEME) or len(digest) != 64 or not _is_hex(digest):
            raise SettingsError(f"api key {self.name!r}: hash must be sha256:<64 hex digits> "
                                "(make one with `loraplex keys hash`)")
        if not self.name or any(c.isspace() for c in self.name):
            raise SettingsError(f"api key entry {self.name!r}: a name is required, without spaces")
        if self.rate is not None and not (self.rate >= 0 and math.isfinite(self.rate)):
            raise SettingsError(f"api key {self.name!r}: rate must be a finite number >= 0")
        for what in ("burst", "max_streams"):
            value = getattr(self, what)
            if value is not None and value < 0:
                raise SettingsError(f"api key {self.name!r}: {what} must be >= 0")


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def hash_key(key: str) -> str:
    """The stored form of a key."""
    return HASH_SCHEME + hashlib.sha256(key.encode()).hexdigest()


def load_keys(path: str, env_keys: str) -> list[KeyEntry]:
    """Entries of the key file (if any) and of LORAPLEX_API_KEYS (comma-separated keys or sha256: hashes;
    these have every scope and the gateway's default limits)."""
    entries = load_key_file(Path(path)) if path else []
    for i, item in enumerate(k.strip() for k in env_keys.split(",") if k.strip()):
        if item.startswith(HASH_SCHEME):
            key_hash = item
        elif len(item) < MIN_KEY_CHARS:
            raise SettingsError(f"LORAPLEX_API_KEYS: key {i + 1} is shorter than {MIN_KEY_CHARS} characters "
                                "(make keys with `loraplex keys add`)")
        else:
            key_hash = hash_key(item)
        entries.append(KeyEntry(f"env-{i + 1}", key_hash, manage=True))
    return entries


_FIELDS = ("name", "hash", "adapters", "manage", "rate", "burst", "max_streams")


def entry_from_dict(raw: dict[str, Any], where: str) -> KeyEntry:
    """A TOML/JSON table or a parsed line as an entry."""
    unknown = set(raw) - set(_FIELDS)
    if unknown:
        raise SettingsError(f"{where}: unknown field(s) {sorted(unknown)}; known: {', '.join(_FIELDS)}")
    if "hash" not in raw:
        raise SettingsError(f"{where}: no hash (make an entry with `loraplex keys add` or `loraplex keys hash`)")
    adapters = raw.get("adapters")
    if isinstance(adapters, str):
        adapters = [a for a in adapters.split(",") if a]
    try:
        return KeyEntry(
            name=str(raw.get("name", "")), key_hash=str(raw["hash"]),
            adapters=None if adapters is None or adapters == ["*"] else tuple(str(a) for a in adapters),
            manage=_as_bool(raw.get("manage", False)),
            rate=None if raw.get("rate") is None else float(raw["rate"]),
            burst=None if raw.get("burst") is None else int(raw["burst"]),
            max_streams=None if raw.get("max_streams") is None else int(raw["max_streams"]))
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{where}: {exc}") from None


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    try:
        return parse_bool(str(value))
    except SettingsError:
        raise ValueError(f"manage: expected true or false, got {value!r}") from None


def load_key_file(path: Path) -> list[KeyEntry]:
    """Entries of a key file: `.toml` (`[[keys]]` tables), `.json` (a list, or {"keys": [...]}), or lines
    `NAME sha256:HEX [adapters=a-,b-] [manage=true] [rate=R] [burst=B] [max_streams=S]` (# comments)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"api_keys_file: cannot read {path}: {exc.strerror}") from None
    try:
        if path.suffix == ".toml":
            tables = tomllib.loads(text).get("keys", [])
        elif path.suffix == ".json":
            data = json.loads(text)
            tables = data.get("keys", []) if isinstance(data, dict) else data
        else:
            return [entry_from_dict(_parse_line(line), f"{path}:{n}")
                    for n, line in enumerate(text.splitlines(), 1) if line.split("#", 1)[0].strip()]
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise SettingsError(f"api_keys_file {path}: {exc}") from None
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise SettingsError(f"api_keys_file {path}: expected a list of key tables")
    return [entry_from_dict(t, f"{path}: key {i + 1}") for i, t in enumerate(tables)]


def _parse_line(line: str) -> dict[str, Any]:
    words = line.split("#", 1)[0].split()
    if len(words) < 2:
        raise ValueError("expected NAME sha256:HEX [field=value ...]")
    raw: dict[str, Any] = {"name": words[0], "hash": words[1]}
    for word in words[2:]:
        k, sep, v = word.partition("=")
        if not sep:
            raise ValueError(f"expected field=value, got {word!r}")
        raw[k] = v
    return raw


def format_entry(entry: KeyEntry, fmt: str = "line") -> str:
    """The entry as a key-file line, a TOML `[[keys]]` table or a JSON object (what load_key_file reads)."""
    raw: dict[str, Any] = {"name": entry.name, "hash": entry.key_hash}
    if entry.adapters is not None:
        raw["adapters"] = list(entry.adapters)
    raw["manage"] = entry.manage
    for k in ("rate", "burst", "max_streams"):
        if getattr(entry, k) is not None:
            raw[k] = getattr(entry, k)
    if fmt == "json":
        return json.dumps(raw)
    if fmt == "toml":
        return "[[keys]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in raw.items())
    extra = [f"{k}={','.join(v) if isinstance(v, list) else str(v).lower()}"
             for k, v in raw.items() if k not in ("name", "hash")]
    return " ".join([entry.name, entry.key_hash, *extra])
