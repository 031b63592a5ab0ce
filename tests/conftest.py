"""Shared test setup: Triton's interpreter on CPU, the gpu marker, free ports."""
import os

import torch

# Triton reads this when a @triton.jit function is defined, so it must be set
# before any kernel module is imported (TOOLCHAIN.md).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One gateway per `loraplex serve`, whatever the machine's cores, so tests that read the gateway's log lines
# find every request under `[gateway]` (tests/gateway/test_gateway_workers.py starts several on purpose).
os.environ.setdefault("LORAPLEX_GATEWAY_WORKERS", "1")

import socket  # noqa: E402

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
