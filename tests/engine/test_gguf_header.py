"""The start-up GGUF reader agrees with the gguf package's reader on every field and tensor it keeps."""
from __future__ import annotations

import numpy as np
import pytest

from loraplex.formats.gguf_header import read_header


def _default_gguf():
    from compute_service.engine.loader import default_model_path

    try:
        return default_model_path()
    except Exception:  # noqa: BLE001 - the default model is an optional install
        pytest.skip("the default SmolLM2 GGUF is not installed")


@pytest.mark.slow
def test_header_matches_the_gguf_reader_on_the_default_model():
    from gguf import GGUFReader

    path = _default_gguf()
    ours, ref = read_header(path), GGUFReader(str(path))
    assert ours.array_lengths == {"tokenizer.ggml.tokens": 49152, "tokenizer.ggml.merges": 48900}
    for key, f in ref.fields.items():
        if key.startswith("GGUF.") or key in ours.array_lengths:
            continue
        assert ours.fields[key] == f.contents(), key
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.tensor_type == t.tensor_type and mine.data.shape == t.data.shape, t.name
        assert np.array_equal(mine.data, t.data), t.name


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="bad magic"):
        read_header(bad)


@pytest.mark.slow
def test_gguf_adapter_fingerprint_matches_the_host_cache_s():
    """The compute service derives it from the loaded spec (no second header read); the cache reads the file."""
    from compute_service.build import adapter_fingerprint
    from compute_service.engine.gguf_loader import read_gguf
    from compute_service.engine.loader import LoadedModel
    from loraplex.formats import ModelSpec

    path = _default_gguf()
    loaded = LoadedModel(read_gguf(path)[0], None, "", path, None)  # type: ignore[arg-type]  (shapes only)
    assert adapter_fingerprint(loaded) == ModelSpec.from_path(path).fingerprint
