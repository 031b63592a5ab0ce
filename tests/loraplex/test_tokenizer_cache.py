"""A GGUF model's tokenizer converted once and kept on disk (`loraplex.tokenizer_cache`).

The real default SmolLM2 GGUF is converted once per module; the cached copy must
tokenize, template and name special tokens exactly as the converted one. The
miss paths (another file, an incomplete or corrupt entry, the cache turned off,
an unwritable folder) count conversions through a stand-in converter that hands
out that same tokenizer.
"""
from __future__ import annotations

import logging
import os

import pytest

from loraplex import tokenizer_cache
from loraplex.model_files import default_model_path, load_tokenizer

TEXTS = ["The capital of France is", "héllo wörld 🙂\n\n  tabs\tand  spaces", "<|im_start|>user\nhi<|im_end|>",
         "1234567890 +-*/ ```code```"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def converted():
    return tokenizer_cache._convert(default_model_path())


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LORAPLEX_TOKENIZER_CACHE", raising=False)
    return tmp_path / "tokenizers"


@pytest.fixture
def conversions(converted, monkeypatch):
    calls = []

    def convert(gguf):
        calls.append(gguf)
        return converted
    monkeypatch.setattr(tokenizer_cache, "_convert", convert)
    return calls


def same_tokenizer(a, b) -> None:
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))
    assert a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        b.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert (a.eos_token_id, a.bos_token_id, len(a), a.all_special_ids) == \
        (b.eos_token_id, b.bos_token_id, len(b), b.all_special_ids)


def test_the_kept_tokenizer_equals_the_converted_one(cache_dir, converted, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "loraplex.tokenizer_cache")
    first = load_tokenizer("")                        # converts (the real conversion) and keeps it
    assert "converted in" in caplog.text
    entries = [p for p in cache_dir.iterdir() if p.is_dir()]      # beside each: its lock file
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    monkeypatch.setattr(tokenizer_cache, "_convert", lambda gguf: pytest.fail("converted although kept"))
    kept = load_tokenizer("")
    assert "from " + str(entries[0]) in caplog.text
    same_tokenizer(first, converted)
    same_tokenizer(kept, converted)


def test_another_file_or_a_touched_one_is_converted_again(cache_dir, conversions, tmp_path):
    gguf = tmp_path / "model.gguf"
    os.link(default_model_path(), gguf) if os.stat(default_model_path()).st_dev == os.stat(tmp_path).st_dev \
        else gguf.write_bytes(default_model_path().read_bytes())
    tokenizer_cache.gguf_tokenizer(gguf)
    tokenizer_cache.gguf_tokenizer(gguf)
    assert len(conversions) == 1
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))      # a new file under the same name
    tokenizer_cache.gguf_tokenizer(gguf)
    assert len(conversions) == 2 and len([p for p in cache_dir.iterdir() if p.is_dir()]) == 2


@pytest.mark.parametrize("damage", ["no_mark", "corrupt"])
def test_an_incomplete_or_corrupt_entry_is_converted_and_rewritten(cache_dir, conversions, damage):
    gguf = default_model_path()
    tokenizer_cache.gguf_tokenizer(gguf)
    folder = cache_dir / tokenizer_cache.entry_key(gguf)
    if damage == "no_mark":
        (folder / tokenizer_cache.DONE_MARK).unlink()
    else:
        (folder / "tokenizer.json").write_text("{ not json")
    tok = tokenizer_cache.gguf_tokenizer(gguf)
    assert len(conversions) == 2 and (folder / tokenizer_cache.DONE_MARK).is_file()
    tokenizer_cache.gguf_tokenizer(gguf)
    assert len(conversions) == 2                       # the rewritten entry serves
    assert tok.encode(TEXTS[0])


def test_turned_off_it_neither_reads_nor_writes(cache_dir, conversions, monkeypatch):
    monkeypatch.setenv("LORAPLEX_TOKENIZER_CACHE", "0")
    tokenizer_cache.gguf_tokenizer(default_model_path())
    tokenizer_cache.gguf_tokenizer(default_model_path())
    assert len(conversions) == 2 and not cache_dir.exists()


def test_an_unwritable_cache_is_a_warning(tmp_path, conversions, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(blocker))      # tokenizers/ cannot be made under a file
    caplog.set_level(logging.WARNING, "loraplex.tokenizer_cache")
    tok = tokenizer_cache.gguf_tokenizer(default_model_path())
    assert tok.encode(TEXTS[0]) and "could not keep the converted tokenizer" in caplog.text
    assert len(conversions) == 1


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("LORAPLEX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tokenizer_cache.cache_root() == tmp_path / "xdg" / "loraplex" / "tokenizers"
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "mine"))
    assert tokenizer_cache.cache_root() == tmp_path / "mine" / "tokenizers"


def test_processes_starting_together_convert_once(cache_dir, tmp_path):
    """Four processes (as `serve --gateway-workers 4` starts) load the same new GGUF's tokenizer at once:
    one converts, the others wait on the lock and read what it kept."""
    import subprocess
    import sys

    script = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s');"
              "from loraplex.model_files import load_tokenizer; print(load_tokenizer('').encode('hi'))")
    env = dict(os.environ, LORAPLEX_CACHE_DIR=str(cache_dir.parent))
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(4)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum("converted in" in o for o in outs) == 1, outs
    assert sum(" from " in o for o in outs) == 3, outs
    assert len({o.strip().splitlines()[-1] for o in outs}) == 1
