"""Plain-Python values of the loraplex client: adapters, stream chunks, results, errors.

Shared by the sync and asyncio clients (`loraplex.client`) and the CLI.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import grpc

from loraplex import errors
from loraplex.v1 import common_pb2, gateway_pb2

_LOAD_MODES = {"auto": common_pb2.LOAD_MODE_AUTO, "always": common_pb2.LOAD_MODE_ALWAYS,
               "never": common_pb2.LOAD_MODE_NEVER}
_FINISH = {common_pb2.STOP: "stop", common_pb2.LENGTH: "length", common_pb2.CANCELLED: "cancelled",
           common_pb2.ERROR: "error"}


@dataclass
class Lora:
    """An adapter reference: a task id, a name, and (first use only) inline tensors.

    `Lora()` is the base model. `Lora.from_path` reads a local adapter (PEFT
    folder, TensorRT-LLM `.npy` folder or llgtrt `.safetensors`) to send inline,
    like the `--lora-path` of Triton's client.
    """

    task_id: int | None = None
    name: str = ""
    weights: Any = None   # numpy/torch [N, W] or [1, N, W]
    config: Any = None    # int32 [N, 3] or [1, N, 3]
    load_mode: str = "auto"

    @classmethod
    def from_path(cls, path: str | Path, task_id: int, *, dtype: str | None = None,
                  load_mode: str = "auto") -> "Lora":
        from loraplex.formats import load_adapter
        adapter = load_adapter(path, dtype=dtype)
        return cls(task_id=task_id, weights=adapter.weights, config=adapter.config, load_mode=load_mode)

    def to_proto(self) -> common_pb2.LoraSpec:
        """A name or task id needs no tensor code: torch is imported only for inline weights."""
        if self.load_mode not in _LOAD_MODES:
            raise ValueError(f"load_mode must be one of {sorted(_LOAD_MODES)}, got {self.load_mode!r}")
        spec = common_pb2.LoraSpec(name=self.name, load_mode=_LOAD_MODES[self.load_mode])
        if self.task_id is not None:
            spec.task_id = int(self.task_id)
        if (self.weights is None) != (self.config is None):
            raise ValueError("give both weights and config, or neither")
        if self.weights is not None:
            from loraplex.tensor_proto import tensor_to_proto
            spec.weights.CopyFrom(tensor_to_proto(self.weights))
            spec.config.CopyFrom(tensor_to_proto(self.config))
        return spec


LoraLike = Lora | int | str | None


def as_lora(x: LoraLike) -> Lora:
    """None -> base model, int -> task id, str -> name, Lora -> itself."""
    if x is None:
        return Lora()
    if isinstance(x, Lora):
        return x
    if isinstance(x, bool):
        raise TypeError("a LoRA reference is a Lora, a task id (int) or a name (str)")
    if isinstance(x, int):
        return Lora(task_id=x)
    if isinstance(x, str):
        return Lora(name=x)
    raise TypeError(f"a LoRA reference is a Lora, a task id (int) or a name (str), got {type(x).__name__}")


@dataclass
class Chunk:
    """One message of a Generate stream."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None   # "stop", "length", "cancelled", "error" on the last chunk
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    task_id: int | None = None

    @classmethod
    def from_proto(cls, m: gateway_pb2.GenerateResponse) -> "Chunk":
        return cls(index=m.index, text=m.text, token_ids=list(m.token_ids),
                   finish_reason=_FINISH.get(m.finish_reason), prompt_tokens=m.usage.prompt_tokens,
                   completion_tokens=m.usage.completion_tokens, error=m.error,
                   task_id=m.task_id if m.has_task_id else None)


@dataclass
class Completion:
    """One entry's whole output."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    task_id: int | None = None

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        if chunk.task_id is not None:
            self.task_id = chunk.task_id
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.prompt_tokens, self.completion_tokens = chunk.prompt_tokens, chunk.completion_tokens
            self.error = chunk.error


def collect(chunks: Iterable[Chunk], num_entries: int) -> list[Completion]:
    """Assembles chunks of a (possibly fanned-out) stream into one Completion per entry."""
    out = [Completion(index=i) for i in range(num_entries)]
    for c in chunks:
        out[c.index].add(c)
    return out


def build_generate_request(prompt: str | Sequence[int], loras: Sequence[LoraLike], *, max_tokens: int = 0,
                           temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0, seed: int = 0,
                           stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                           ignore_eos: bool = False, chat: bool = False,
                           request_id: str = "") -> gateway_pb2.GenerateRequest:
    """A GenerateRequest; `prompt` is text or token ids; `loras` empty means the base model."""
    req = gateway_pb2.GenerateRequest(chat=chat, request_id=request_id)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.input_ids.extend(int(t) for t in prompt)
    s = req.sampling
    s.max_tokens, s.temperature, s.top_k, s.top_p, s.seed = max_tokens, temperature, top_k, top_p, seed
    s.stop.extend(stop)
    s.stop_token_ids.extend(stop_token_ids)
    s.ignore_eos = ignore_eos
    for lora in loras:
        req.loras.append(as_lora(lora).to_proto())
    return req


class RequestError(errors.LoraplexError):
    """A call failed with a status that has no more specific class (CANCELLED, DEADLINE_EXCEEDED ...)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.grpc_code = code


def error_from_rpc(exc: grpc.RpcError) -> errors.LoraplexError:
    """A failed call as a `loraplex.errors` exception (`.grpc_code` holds the status)."""
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    message = f"{code.name}: {details}"
    cls = errors.BY_GRPC_CODE.get(code)
    if cls is None:
        return RequestError(code, message)
    return cls(message)
