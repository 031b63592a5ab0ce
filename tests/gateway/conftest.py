"""Gateway test fixtures: the default model's real tokenizer, loaded once."""
import pytest

from loraplex.model_files import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer (byte-level BPE: CJK characters span several tokens)."""
    return load_tokenizer("")
