"""What the user commands (`generate`, `load`, `unload`, `list`, `info`) share.

The gateway address flag (`-u/--url`; env LORAPLEX_URL), the API key and
TLS flags (docs/security.md), the call timeout, and turning a failed call into
one line on stderr and exit code 1.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Any, Callable

from google.protobuf.json_format import MessageToDict

from loraplex.errors import LoraplexError
from loraplex.settings import SettingsError, parse_bool

DEFAULT_URL = "127.0.0.1:50051"


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-u", "--url", default=os.environ.get("LORAPLEX_URL", DEFAULT_URL),
                        help=f"gateway address (default {DEFAULT_URL}) [env LORAPLEX_URL]")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the call gives up")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    env = os.environ.get
    parser.add_argument("--api-key", default=env("LORAPLEX_API_KEY"),
                        help="API key sent as `authorization: Bearer` (prefer the env variable: flags show in "
                             "the process list) [env LORAPLEX_API_KEY]")
    parser.add_argument("--tls", action="store_true", default=None,
                        help="connect with TLS, trusting the system's roots [env LORAPLEX_TLS]")
    parser.add_argument("--tls-ca", default=env("LORAPLEX_TLS_CA"),
                        help="PEM CA to trust for the gateway's certificate (implies --tls) [env LORAPLEX_TLS_CA]")
    parser.add_argument("--tls-cert", default=env("LORAPLEX_TLS_CLIENT_CERT"),
                        help="PEM client certificate, for a gateway that requires one (mutual TLS) "
                             "[env LORAPLEX_TLS_CLIENT_CERT]")
    parser.add_argument("--tls-key", default=env("LORAPLEX_TLS_CLIENT_KEY"),
                        help="PEM private key of --tls-cert [env LORAPLEX_TLS_CLIENT_KEY]")


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `Client` keywords of the connection flags (a bad LORAPLEX_TLS is a ValueError naming it)."""
    tls = args.tls
    if tls is None:
        try:
            tls = parse_bool(os.environ.get("LORAPLEX_TLS", ""))
        except SettingsError as exc:
            raise SettingsError(f"LORAPLEX_TLS: {exc}") from None
    return dict(timeout=args.timeout, api_key=args.api_key or None, tls=tls, tls_ca=args.tls_ca,
                tls_cert=args.tls_cert, tls_key=args.tls_key)


def reports_errors(command: str) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """Wraps a command: a failed call prints `loraplex <command>: CODE: message` and returns 1."""
    def wrap(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        @functools.wraps(fn)
        def run(args: argparse.Namespace) -> int:
            try:
                return fn(args)
            except LoraplexError as exc:
                print(f"loraplex {command}: {exc}", file=sys.stderr)
                return 1
            except (ValueError, OSError) as exc:  # bad local files or values given on the command line
                print(f"loraplex {command}: {exc}", file=sys.stderr)
                return 2
            except KeyboardInterrupt:
                return 130
        return run
    return wrap


def message_dict(message: Any) -> dict[str, Any]:
    """A protobuf message as a JSON-ready dict (field names as in the .proto, zeros included)."""
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def print_json(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False, indent=2))
