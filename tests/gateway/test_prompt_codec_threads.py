"""Long prompts are tokenized off the event loop; short ones inline; both give the same ids."""
import asyncio
import threading

from gateway.requests import INLINE_TOKENIZE_CHARS, PromptCodec
from loraplex.v1 import gateway_pb2


class _ThreadRecorder:
    """The real tokenizer, remembering which thread each encode ran on."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self.threads: list[threading.Thread] = []

    def __len__(self) -> int:
        return len(self._tok)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, *args, **kwargs):
        self.threads.append(threading.current_thread())
        return self._tok.encode(*args, **kwargs)


def _run(codec: PromptCodec, coro_fn):
    async def main():
        return threading.current_thread(), await coro_fn()
    return asyncio.run(main())


def test_a_long_prompt_is_tokenized_on_a_worker_thread_with_the_same_ids(tokenizer):
    rec = _ThreadRecorder(tokenizer)
    codec = PromptCodec(rec)
    text = "The quick brown fox jumps over the lazy dog. " * (INLINE_TOKENIZE_CHARS // 40)
    assert len(text) > INLINE_TOKENIZE_CHARS
    loop_thread, ids = _run(codec, lambda: codec.encode_async(gateway_pb2.GenerateRequest(text=text)))
    assert ids == tokenizer.encode(text)
    assert rec.threads[-1] is not loop_thread


def test_a_short_prompt_and_chat_stay_inline(tokenizer):
    rec = _ThreadRecorder(tokenizer)
    codec = PromptCodec(rec)
    loop_thread, ids = _run(codec, lambda: codec.encode_async(gateway_pb2.GenerateRequest(text="Where is Tokyo?")))
    assert ids == tokenizer.encode("Where is Tokyo?") and rec.threads[-1] is loop_thread
    loop_thread, _ = _run(codec, lambda: codec.encode_chat_async([{"role": "user", "content": "hi"}]))
    assert rec.threads[-1] is loop_thread


def test_a_long_chat_is_templated_on_a_worker_thread(tokenizer):
    rec = _ThreadRecorder(tokenizer)
    codec = PromptCodec(rec)
    long = "word " * INLINE_TOKENIZE_CHARS
    loop_thread, ids = _run(codec, lambda: codec.encode_chat_async([{"role": "user", "content": long}]))
    assert ids == codec.encode_chat([{"role": "user", "content": long}])
    assert rec.threads[-2] is not loop_thread
