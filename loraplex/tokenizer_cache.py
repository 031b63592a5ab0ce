"""The tokenizer of a GGUF model, converted once and kept on disk.

Building a tokenizer from a GGUF file's metadata is slow pure-Python work
(about 7 s for the default SmolLM2 on an idle machine, 20+ s while the compute
service compiles its kernels beside it), and every gateway start did it. The
converted tokenizer is saved (tokenizer.json, its config with the chat template,
the special tokens) under `~/.cache/loraplex/tokenizers/<key>/` (or
`$LORAPLEX_CACHE_DIR/tokenizers/`, else `$XDG_CACHE_HOME/loraplex/tokenizers/`)
and loaded from there in well under a second. The key covers the GGUF file
(resolved path, size, modification time) and the transformers and tokenizers
versions. A missing or unreadable entry is converted again; a failed save is a
warning. Processes that start together (several gateways) take turns on a lock
file beside the entry, so one converts and the others read its result.
`LORAPLEX_TOKENIZER_CACHE=0` turns it off.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
DONE_MARK = "loraplex-converted-from.txt"      # written last: an entry without it is incomplete


def cache_root() -> Path:
    """Folder of the converted tokenizers."""
    base = os.environ.get("LORAPLEX_CACHE_DIR")
    if base:
        return Path(base) / "tokenizers"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "loraplex" / "tokenizers"


def enabled() -> bool:
    return os.environ.get("LORAPLEX_TOKENIZER_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def entry_key(gguf: Path) -> str:
    """sha256 of what the converted tokenizer depends on: the file (path, size, mtime) and the libraries."""
    import tokenizers
    import transformers

    st = gguf.stat()
    parts = [str(gguf.resolve()), str(st.st_size), str(st.st_mtime_ns), transformers.__version__,
             tokenizers.__version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _convert(gguf: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _load(folder: Path) -> Any | None:
    from transformers import AutoTokenizer

    if not (folder / DONE_MARK).is_file():
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        log.warning("tokenizer cache entry %s is unreadable (%s): converting again", folder, exc)
        return None


def _save(tokenizer: Any, folder: Path, gguf: Path) -> None:
    """Saves into a temporary sibling, then renames it into place (another process may race us)."""
    tmp: Path | None = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        tokenizer.save_pretrained(str(tmp))
        (tmp / DONE_MARK).write_text(f"{gguf.resolve()}\n")
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError as exc:
        log.warning("could not keep the converted tokenizer in %s (%s); the next start converts it again",
                    folder, exc)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _converting(folder: Path) -> Iterator[None]:
    """Held while one process converts into `folder`: processes that start together (several gateways)
    wait for the first one's conversion and read it instead of each converting. No lock where the folder
    cannot be made (the conversion then runs unshared and its save warns)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(folder) + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)           # closing releases the lock


def gguf_tokenizer(gguf: Path) -> Any:
    """The tokenizer of a GGUF file: from the cache when it holds it, else converted (and kept)."""
    if not enabled():
        return _convert(gguf)
    folder = cache_root() / entry_key(gguf)
    t = time.perf_counter()
    tok = _load(folder)
    if tok is None:
        with _converting(folder):
            tok = _load(folder)          # another process may have converted it while we waited
            if tok is None:
                tok = _convert(gguf)
                log.info("tokenizer of %s converted in %.1f s; kept in %s", gguf.name, time.perf_counter() - t,
                         folder)
                _save(tok, folder, gguf)
                return tok
    log.info("tokenizer of %s from %s in %.2f s", gguf.name, folder, time.perf_counter() - t)
    return tok
