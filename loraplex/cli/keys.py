"""`loraplex keys`: make API keys for the gateway (`--api-keys-file`).

`loraplex keys add --file keys.toml --name alice [--adapters alice-,shared-]
[--manage] [--rate 5] [--burst 10] [--max-streams 4]` makes a random key,
appends its hashed entry to the file (created readable by its owner only;
the format follows the extension: .toml, .json, else one entry per line) and
prints the key once on stdout: the file never holds it. `loraplex keys hash`
reads a key you already have from stdin and prints its entry. docs/security.md.
"""
from __future__ import annotations

import argparse
import getpass
import json
import os
import secrets
import sys
from pathlib import Path

KEY_PREFIX = "lpx-"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("keys", help="Make API keys for the gateway.", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    add = sub.add_parser("add", help="make a key, append its hashed entry to a key file, print the key")
    add.add_argument("--file", required=True, help="the gateway's --api-keys-file (.toml, .json or lines)")
    _scope_flags(add)
    add.set_defaults(func=run_add)
    hashed = sub.add_parser("hash", help="read a key from stdin, print its hashed entry")
    hashed.add_argument("--format", choices=("line", "toml", "json"), default="line", help="entry format")
    _scope_flags(hashed)
    hashed.set_defaults(func=run_hash)


def _scope_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", required=True, help="what logs and refusals call the key (no spaces)")
    p.add_argument("--adapters", default=None,
                   help="comma-separated adapter-name prefixes the key may use (default: every adapter)")
    p.add_argument("--manage", action="store_true", help="allow LoadLora/UnloadLora (default: not)")
    p.add_argument("--rate", type=float, default=None, help="requests per second (default: the gateway's)")
    p.add_argument("--burst", type=int, default=None, help="requests at once above the rate")
    p.add_argument("--max-streams", type=int, default=None, help="concurrent streams (default: the gateway's)")


def _entry(args: argparse.Namespace, key: str):  # type: ignore[no-untyped-def]
    from gateway.api_keys import KeyEntry, hash_key
    adapters = None if args.adapters is None else tuple(a for a in args.adapters.split(",") if a)
    return KeyEntry(args.name, hash_key(key), adapters, args.manage, args.rate, args.burst, args.max_streams)


def _format_of(path: Path) -> str:
    return {".toml": "toml", ".json": "json"}.get(path.suffix, "line")


def append_entry(path: Path, entry) -> None:  # type: ignore[no-untyped-def]
    """Adds `entry` to a key file (made mode 0600 when new), refusing a name already there."""
    from gateway.api_keys import format_entry, load_key_file
    existing = load_key_file(path) if path.exists() else []
    if any(e.name == entry.name for e in existing):
        raise ValueError(f"{path} already has a key named {entry.name!r}")
    fmt = _format_of(path)
    if fmt == "json":
        raw = [json.loads(format_entry(e, "json")) for e in [*existing, entry]]
        text = json.dumps({"keys": raw}, indent=2) + "\n"
    else:
        old = path.read_text() if path.exists() else ""
        sep = "\n" if old and not old.endswith("\n") else ""
        text = old + sep + ("\n" if fmt == "toml" and old else "") + format_entry(entry, fmt) + \
            ("" if fmt == "toml" else "\n")
    # a new file beside it, then renamed over it: a failed write leaves the old keys whole
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)      # the file keeps its own mode
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def run_add(args: argparse.Namespace) -> int:
    from loraplex.settings import SettingsError
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    path = Path(args.file)
    try:
        append_entry(path, _entry(args, key))
    except (SettingsError, ValueError, OSError) as exc:
        print(f"loraplex keys add: {exc}", file=sys.stderr)
        return 2
    print(key)
    print(f"loraplex keys add: added {args.name!r} to {path}; the key above is shown only now", file=sys.stderr)
    return 0


def run_hash(args: argparse.Namespace) -> int:
    from gateway.api_keys import MIN_KEY_CHARS, format_entry
    from loraplex.settings import SettingsError
    if sys.stdin.isatty():
        key = getpass.getpass("key (not echoed): ", stream=sys.stderr).strip()
    else:
        key = sys.stdin.readline().strip()
    if len(key) < MIN_KEY_CHARS:
        print(f"loraplex keys hash: a key needs at least {MIN_KEY_CHARS} characters (make one with "
              "`loraplex keys add`)", file=sys.stderr)
        return 2
    try:
        print(format_entry(_entry(args, key), args.format))
    except SettingsError as exc:
        print(f"loraplex keys hash: {exc}", file=sys.stderr)
        return 2
    return 0
