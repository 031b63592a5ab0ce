"""`loraplex list`: adapters known to the host cache, with their residency."""
from __future__ import annotations

import argparse

from loraplex.cli._gateway_client import add_client_flags, client_options, message_dict, print_json, reports_errors
from loraplex.client import Client
from loraplex.v1 import common_pb2


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("list", help="List adapters.", description=__doc__)
    add_client_flags(p)
    p.set_defaults(func=run)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def format_adapter(a: common_pb2.AdapterInfo) -> str:
    """One line: task id, name, rank, size, where it lives, modules."""
    where = ",".join(w for w, on in (("host", a.in_host_cache), ("gpu", a.in_gpu_cache)) if on) or "-"
    modules = " ".join(m.module_name for m in a.modules)
    return (f"task_id={a.task_id} name={a.name or '-'} max_rank={a.max_rank} size={_mib(a.num_bytes)} "
            f"cached={where} version={a.version or '-'} modules=[{modules}]")


@reports_errors("list")
def run(args: argparse.Namespace) -> int:
    with Client(args.url, **client_options(args)) as client:
        listing = client.list_loras()
    if args.json:
        print_json(message_dict(listing))
        return 0
    for a in listing.adapters:
        print(format_adapter(a))
    print(f"{len(listing.adapters)} adapter(s); host cache {_mib(listing.host_cache_bytes_used)} "
          f"of {_mib(listing.host_cache_bytes_total)}")
    return 0
