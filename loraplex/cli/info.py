"""`loraplex info`: the base model the system serves."""
from __future__ import annotations

import argparse

from loraplex.cli._gateway_client import add_client_flags, client_options, message_dict, print_json, reports_errors
from loraplex.client import Client


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("info", help="Describe the base model.", description=__doc__)
    add_client_flags(p)
    p.set_defaults(func=run)


@reports_errors("info")
def run(args: argparse.Namespace) -> int:
    with Client(args.url, **client_options(args)) as client:
        model = client.model_info()
    fields = message_dict(model)
    if args.json:
        print_json(fields)
        return 0
    for key, value in fields.items():
        print(f"{key}: {value}")
    return 0
