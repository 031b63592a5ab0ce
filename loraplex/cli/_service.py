"""Shared wiring for the `loraplex gateway|cache|compute` subcommands.

The service packages are imported only when the subcommand runs, so the
shared package depends on no service at import time.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import sys

from loraplex.settings import SettingsError, add_dataclass_flags, settings_from_args


def register_service(subparsers: argparse._SubParsersAction, command: str, package: str,
                     config_class: str, help_text: str) -> None:
    """Adds `loraplex <command>` whose flags are the fields of `<package>.config.<config_class>`."""
    config_cls = getattr(importlib.import_module(f"{package}.config"), config_class)
    parser = subparsers.add_parser(command, help=help_text, description=help_text)
    add_dataclass_flags(parser, config_cls)

    def run(args: argparse.Namespace) -> int:
        return run_service(package, config_cls, args)

    parser.set_defaults(func=run)


def run_service(package: str, config_cls: type, args: argparse.Namespace | None) -> int:
    """Builds the settings and runs `<package>.server.serve(config)` until SIGTERM."""
    try:
        config = settings_from_args(config_cls, args)
    except SettingsError as exc:
        print(f"loraplex {package}: {exc}", file=sys.stderr)
        return 2
    server = importlib.import_module(f"{package}.server")
    from loraplex.serving import configure_logging
    configure_logging(getattr(config, "log_level", "INFO"), getattr(config, "log_format", "text"), package)
    try:
        asyncio.run(server.serve(config))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"loraplex {package}: {exc}", file=sys.stderr)
        return 1
    return 0


def service_main(package: str, config_class: str, help_text: str) -> int:
    """`python -m <package>`: the same flags as `loraplex <command>`."""
    config_cls = getattr(importlib.import_module(f"{package}.config"), config_class)
    parser = argparse.ArgumentParser(prog=f"python -m {package}", description=help_text)
    add_dataclass_flags(parser, config_cls)
    return run_service(package, config_cls, parser.parse_args())
