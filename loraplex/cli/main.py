"""`loraplex <command>`: one entry point for the services and the tools.

Each subcommand lives in `loraplex/cli/<name>.py` and exposes
`register(subparsers)`, which adds its parser and sets `func` to a callable
taking the parsed arguments and returning an exit code.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order of `loraplex --help`.
SUBCOMMANDS = (
    "serve", "gateway", "cache", "compute",
    "generate", "load", "unload", "list", "info",
    "convert", "quantize", "inspect", "keys",
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """All subcommands, or just `only`: then the others' modules are not imported (`loraplex generate`
    does not pay for `convert`'s torch import)."""
    parser = argparse.ArgumentParser(
        prog="loraplex",
        description="A multi-LoRA LLM server: one base model, many adapters, one batch.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        if only is not None and name != only:
            continue
        try:
            module = importlib.import_module(f"loraplex.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"loraplex.cli.{name}":
                raise
            continue  # not built yet; it simply does not appear in --help
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
