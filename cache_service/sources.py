"""Adapters on disk: the llgtrt-style adapter root and the Triton-style prefetch folder.

Names are checked before they touch the filesystem: no path separators, no
`..`, nothing hidden, and the resolved path (symlinks followed) must stay
inside the root, so a request can never read a file outside it. A name maps
to a stable 63-bit task id, the same on every replica.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from loraplex.errors import InvalidArgumentError, NotFoundError

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=@-]{0,254}$")


def task_id_for_name(name: str) -> int:
    """Stable task id of a named adapter: 63 bits of sha256, so it fits int64 everywhere."""
    digest = hashlib.sha256(b"loraplex-adapter-name\0" + name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def check_name(name: str) -> None:
    """Refuses names that could leave the adapter root or hide a file."""
    if not name:
        raise InvalidArgumentError("adapter name is empty")
    if "/" in name or "\\" in name or ".." in name or "\0" in name:
        raise InvalidArgumentError(f"adapter name {name!r} must not contain path separators or '..'")
    if not _NAME_RE.match(name):
        raise InvalidArgumentError(
            f"adapter name {name!r} must start with a letter, digit or '_' and use only letters, "
            "digits and _ . + = @ - (at most 255 characters)")


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve(strict=True).relative_to(root.resolve(strict=True))
        return True
    except (ValueError, OSError):
        return False


def check_inside_root(path: Path, root: Path) -> Path:
    """`path` resolved, if it and every file under it stay inside `root` (symlinks followed)."""
    if not _inside(path, root):
        raise InvalidArgumentError(f"{path} is outside the adapter root {root} (or does not exist)")
    if path.is_dir():
        for child in path.rglob("*"):
            if not _inside(child, root):
                raise InvalidArgumentError(f"{child} links outside the adapter root {root}")
    return path.resolve()


def find_named(root: Path, name: str) -> Path:
    """`<root>/<name>/` or `<root>/<name>.safetensors`, checked; NotFoundError when neither exists."""
    check_name(name)
    for candidate in (root / name, root / f"{name}.safetensors"):
        if candidate.is_symlink() or candidate.exists():
            if candidate.is_file() and candidate.suffix != ".safetensors":
                continue
            return check_inside_root(candidate, root)
    raise NotFoundError(f"no adapter named {name!r} under the adapter root {root} "
                        f"(looked for {name}/ and {name}.safetensors)")


def resolve_load_path(root: Path, path: str) -> Path:
    """A LoadPath request's path (relative to the root, or absolute inside it), checked."""
    if not path:
        raise InvalidArgumentError("path is empty")
    candidate = Path(path)
    if not candidate.is_absolute():
        if ".." in candidate.parts:
            raise InvalidArgumentError(f"path {path!r} must not contain '..'")
        candidate = root / candidate
    return check_inside_root(candidate, root)


def default_name_for(path: Path) -> str:
    """`<root>/foo/` and `<root>/foo.safetensors` are both named `foo`."""
    return path.stem if path.is_file() else path.name


def signature(path: Path) -> str:
    """Hash of the relative names, sizes and mtimes of an adapter's files."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(path) if f != path else f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]
