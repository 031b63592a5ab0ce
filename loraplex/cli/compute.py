"""`loraplex compute`: Run the GPU compute service (loraplex.v1.Compute)."""
from __future__ import annotations

import argparse

from loraplex.cli._service import register_service


def register(subparsers: argparse._SubParsersAction) -> None:
    register_service(subparsers, "compute", "compute_service", "ComputeConfig", "Run the GPU compute service (loraplex.v1.Compute).")
