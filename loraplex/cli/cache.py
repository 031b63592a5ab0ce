"""`loraplex cache`: Run the host adapter cache service (loraplex.v1.AdapterCache)."""
from __future__ import annotations

import argparse

from loraplex.cli._service import register_service


def register(subparsers: argparse._SubParsersAction) -> None:
    register_service(subparsers, "cache", "cache_service", "CacheConfig", "Run the host adapter cache service (loraplex.v1.AdapterCache).")
