"""Helpers for the compose tests: run docker-compose, merge an override like Compose does."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
COMPOSE_CPU = ROOT / "compose.cpu.yaml"


def docker_compose_bin() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        pytest.fail("docker-compose not on PATH: `bash scripts/setup.sh --test` installs Debian's "
                    "docker-compose (apt-get install --no-install-recommends docker-compose)")
    return path


def compose_config(*files: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`docker-compose -f F... config` (validated, variables substituted) as a dict.

    Relative paths resolve against the repository root, wherever the files are."""
    args = [docker_compose_bin(), "--project-directory", str(ROOT)]
    for f in files:
        args += ["-f", str(f)]
    if env is None:  # the defaults, whatever the caller's shell has set
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    out = subprocess.run([*args, "config"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env=env)
    assert out.returncode == 0, f"docker-compose config failed:\n{out.stderr}"
    return yaml.safe_load(out.stdout)


class _Reset:
    """The value of a `!reset` tag: Compose removes the key when merging."""


class _ComposeLoader(yaml.SafeLoader):
    """SafeLoader that also reads Compose's `!reset` tag."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: _Reset())


def load_with_reset(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)  # noqa: S506 (a SafeLoader subclass)


def merge(base: Any, override: Any) -> Any:
    """Compose's merge rules for the keys our files use: mappings merge key by
    key, `!reset` removes, `command`/`healthcheck.test`/scalars are replaced,
    other sequences are appended."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if isinstance(value, _Reset):
                out.pop(key, None)
            elif key in out and key not in ("command", "entrypoint", "test"):
                out[key] = merge(out[key], value)
            else:
                out[key] = value
        return out
    if isinstance(base, list) and isinstance(override, list):
        return base + [v for v in override if v not in base]
    return override


def service_env(config: dict[str, Any], service: str) -> dict[str, str]:
    env = config["services"][service].get("environment", {})
    if isinstance(env, list):  # KEY=VALUE form
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}
