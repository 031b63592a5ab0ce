"""transformers' own load of a GGUF model (the independent reference of the SmolLM2 tests), kept between processes.

transformers reads a GGUF file slowly (the file parsed twice, tensor names mapped one by one: ~30 s for the default
model on a CI core, ~10 s more for its tokenizer). The first test process that asks builds the model and tokenizer
that way and stores what it built (the float32 state dict, config, generation config and tokenizer files: ~0.5 GB
for the default model) under the system's temporary folder, keyed by the file's contents and the library versions
(so checkouts share it); later processes (xdist workers, `make test`'s second part) load that in a few seconds.
Nothing else goes in: a stored copy is exactly transformers' own conversion of the same file.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch


def _folder(gguf: Path) -> Path:
    import transformers

    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    key = f"{digest.hexdigest()}|{transformers.__version__}|{torch.__version__}"
    return Path(tempfile.gettempdir()) / "loraplex-hf-reference" / hashlib.sha256(key.encode()).hexdigest()[:20]


def _build(gguf: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    part = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        model.config.save_pretrained(part)
        model.generation_config.save_pretrained(part)
        torch.save(model.state_dict(), part / "state_dict.pt")
        tok.save_pretrained(part)
        os.replace(part, folder)            # whole or not at all (a racing process may have stored it first)
    except OSError:
        if not (folder / "state_dict.pt").exists():
            raise
    finally:
        shutil.rmtree(part, ignore_errors=True)


@functools.cache        # once a process: the model and its tokenizer ask for the same folder (the file hashed once)
def _stored(gguf: Path) -> Path:
    folder = _folder(gguf)
    if not (folder / "state_dict.pt").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        _build(gguf, folder)
    return folder


def reference_model(gguf: Path) -> torch.nn.Module:
    """transformers' float32 model of the GGUF file `gguf` (eval mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    folder = _stored(gguf)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    model.load_state_dict(torch.load(folder / "state_dict.pt", weights_only=True))
    model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()


def reference_tokenizer(gguf: Path):
    """transformers' tokenizer of the GGUF file `gguf`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_stored(gguf))
