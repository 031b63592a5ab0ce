"""`loraplex gateway`: Run the public gateway (loraplex.v1.Gateway, and the OpenAI-compatible HTTP API)."""
from __future__ import annotations

import argparse

from loraplex.cli._service import register_service


def register(subparsers: argparse._SubParsersAction) -> None:
    register_service(subparsers, "gateway", "gateway", "GatewayConfig",
                     "Run the public gateway (loraplex.v1.Gateway; with --http-listen also the OpenAI-compatible "
                     "HTTP API, docs/openai.md).")
