"""`loraplex load`: store an adapter in the host cache through the gateway.

From a path on the server (`--path`, under the cache's adapter root), from a
path on this machine (`--local-path`, read here and sent inline), or by name
alone (an adapter under the server's adapter root).
"""
from __future__ import annotations

import argparse

from loraplex.cli._gateway_client import add_client_flags, client_options, message_dict, print_json, reports_errors
from loraplex.cli.list import format_adapter
from loraplex.client import Client


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("load", help="Load an adapter into the host cache.", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task-id", "--lora-task-id", dest="task_id", type=int,
                   help="task id to store it under (derived from the name when absent, for --path)")
    p.add_argument("--name", "--lora-name", dest="name", default="", help="name to refer to it by")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--path", default="", help="adapter on the server, under its adapter root")
    src.add_argument("--local-path", "--lora-path", dest="local_path",
                     help="adapter on this machine, sent inline (needs --task-id)")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                   help="storage dtype to convert a --local-path adapter to before sending")
    p.add_argument("--replace", action="store_true", help="replace an adapter with the same task id or name")
    add_client_flags(p)
    p.set_defaults(func=run)


@reports_errors("load")
def run(args: argparse.Namespace) -> int:
    if not (args.path or args.local_path or args.name):
        raise ValueError("give --path (on the server), --local-path (on this machine) or --name")
    if args.local_path and args.task_id is None:
        raise ValueError("--local-path needs --task-id: the adapter is stored under that id")
    with Client(args.url, **client_options(args)) as client:
        info = client.load_lora(task_id=args.task_id, name=args.name, path=args.path,
                                local_path=args.local_path, replace=args.replace, dtype=args.dtype)
    if args.json:
        print_json(message_dict(info))
    else:
        print("loaded " + format_adapter(info))
    return 0
