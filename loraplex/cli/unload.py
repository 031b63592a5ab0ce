"""`loraplex unload`: remove an adapter; requests already running with it finish."""
from __future__ import annotations

import argparse

from loraplex.cli._gateway_client import add_client_flags, client_options, print_json, reports_errors
from loraplex.client import Client


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("unload", help="Remove an adapter from the caches.", description=__doc__)
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--task-id", "--lora-task-id", dest="task_id", type=int, help="the adapter's task id")
    who.add_argument("--name", "--lora-name", dest="name", default="", help="the adapter's name")
    add_client_flags(p)
    p.set_defaults(func=run)


@reports_errors("unload")
def run(args: argparse.Namespace) -> int:
    with Client(args.url, **client_options(args)) as client:
        unloaded = client.unload_lora(task_id=args.task_id, name=args.name or "")
    what = f"task id {args.task_id}" if args.task_id is not None else f"name {args.name!r}"
    if args.json:
        print_json({"unloaded": unloaded})
    else:
        print(f"unloaded {what}" if unloaded else f"nothing to unload: {what} was not cached")
    return 0
