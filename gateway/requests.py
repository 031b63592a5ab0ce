"""Checking a GenerateRequest and turning its prompt into token ids.

Everything here is plain Python over the tokenizer, so it is unit-tested
without servers. Each refusal names the field and what to change.
"""
from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any, Sequence

from jinja2 import TemplateError

from loraplex.detokenize import IncrementalDetokenizer
from loraplex.errors import InvalidArgumentError
from loraplex.logging_setup import REQUEST_ID
from loraplex.v1 import common_pb2, gateway_pb2


REQUEST_ID_KEY = "x-request-id"   # gRPC metadata key and HTTP header of a caller's request id
MAX_REQUEST_ID = 128


def take_request_id(*given: str) -> str:
    """The call's request id: the first one the caller gave (cut to MAX_REQUEST_ID characters), else a
    new one; set as the log context, so every line logged for the call carries it (--log-format json)."""
    request_id = next((g[:MAX_REQUEST_ID] for g in given if g), "") or uuid.uuid4().hex[:16]
    REQUEST_ID.set(request_id)
    return request_id


# Prompts longer than this are tokenized on a worker thread: a megabyte of text takes the tokenizer
# about a second, which would stall every stream the event loop serves.
INLINE_TOKENIZE_CHARS = 16 << 10


class PromptCodec:
    """The base model's tokenizer: prompt -> token ids, token ids -> text."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id

    def encode(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        """The request's prompt as token ids (chat template applied when asked)."""
        has_text, has_ids = bool(request.text), bool(request.input_ids)
        if has_text and has_ids:
            raise InvalidArgumentError("give the prompt as text or as input_ids, not both")
        if not has_text and not has_ids:
            raise InvalidArgumentError("the prompt is empty: set text or input_ids")
        if has_ids:
            if request.chat:
                raise InvalidArgumentError("chat applies the chat template to text; with input_ids, "
                                           "send the templated ids and leave chat false")
            ids = list(request.input_ids)
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise InvalidArgumentError(f"input_ids: token id {bad} is outside the vocabulary "
                                           f"(size {self.vocab_size})")
            return ids
        if request.chat:
            return self.encode_chat([{"role": "user", "content": request.text}])
        return list(self._tok.encode(request.text))

    async def encode_async(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        """`encode`, on a worker thread when the prompt is long (the event loop keeps streaming)."""
        if len(request.text) <= INLINE_TOKENIZE_CHARS:
            return self.encode(request)
        return await asyncio.to_thread(self.encode, request)

    async def encode_chat_async(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """`encode_chat`, on a worker thread when the conversation is long."""
        if sum(len(str(m.get("content", ""))) for m in messages) <= INLINE_TOKENIZE_CHARS:
            return self.encode_chat(messages)
        return await asyncio.to_thread(self.encode_chat, messages)

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """A conversation ({"role", "content"} turns) in the model's chat template, with the assistant
        prompt after it, as token ids."""
        if not getattr(self._tok, "chat_template", None):
            raise InvalidArgumentError("chat: this model's tokenizer has no chat template; send plain text")
        try:
            text = self._tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        except TemplateError as exc:   # the template's own checks (e.g. roles that must alternate)
            raise InvalidArgumentError(f"chat: the model's chat template refused the messages: {exc}") from exc
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def detokenizer(self, prompt_ids: Sequence[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.decode, prompt_ids)


def check_sampling(sampling: common_pb2.SamplingParams, default_max_tokens: int) -> common_pb2.SamplingParams:
    """Validates sampling values; returns the copy sent to compute (defaults filled, stop strings removed:
    the gateway matches them on the decoded text)."""
    t = sampling.temperature
    if not math.isfinite(t) or t < 0:
        raise InvalidArgumentError(f"sampling.temperature must be a finite number >= 0 (0 is greedy), got {t}")
    p = sampling.top_p
    if not math.isfinite(p) or not 0 <= p <= 1:
        raise InvalidArgumentError(f"sampling.top_p must be in (0, 1] (0 means 1, disabled), got {p}")
    for s in sampling.stop:
        if not s:
            raise InvalidArgumentError("sampling.stop: stop strings must not be empty")
    out = common_pb2.SamplingParams()
    out.CopyFrom(sampling)
    del out.stop[:]
    if out.max_tokens == 0:
        out.max_tokens = default_max_tokens
    return out


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    """A prompt must leave room for at least one new token."""
    if max_model_len and num_prompt_tokens >= max_model_len:
        raise InvalidArgumentError(
            f"the prompt has {num_prompt_tokens} tokens; this model accepts at most {max_model_len - 1} "
            f"(max_model_len {max_model_len} counts prompt and output): shorten the prompt")


def check_loras(loras: Sequence[common_pb2.LoraSpec], max_entries: int = 64) -> None:
    if len(loras) > max_entries:
        raise InvalidArgumentError(f"loras: {len(loras)} entries; a fan-out request takes at most {max_entries}")
