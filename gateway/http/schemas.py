"""Checking the JSON bodies of /v1/completions and /v1/chat/completions.

A body becomes a `GenerationPlan`: the prompts (text or token ids, or chat
messages), the models it runs on (its `model`, or the `loras` extension for
fan-out), `n`, and the sampling values as the gRPC API's `SamplingParams`.
Every refusal is an HttpError 400 naming the field. Fields of the OpenAI API
this server does not implement are accepted only at their neutral value
(e.g. `logprobs: null`, `presence_penalty: 0`), so a client that sends
defaults works and one that relies on them is told; fields it does not know
are ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from loraplex.v1 import common_pb2, gateway_pb2
from gateway.http.errors import HttpError

MAX_CHOICES = 64          # prompts x models x n in one request (the gRPC fan-out limit)
MAX_STOP_STRINGS = 16
MAX_MESSAGES = 4096
UINT32 = 2**32
UINT64 = 2**64

# Fields this server does not implement, and the values that mean "not used".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logprobs": (None, False),
    "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
    "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class GenerationPlan:
    """What a completion request asks for, checked (prompts are encoded by the route)."""

    chat: bool
    model: str                                   # as sent; echoed in responses
    prompts: list[gateway_pb2.GenerateRequest] = field(default_factory=list)   # completions: text or ids
    messages: list[dict[str, str]] = field(default_factory=list)               # chat: the conversation
    models: list[str] = field(default_factory=list)   # one per fan-out entry: `loras`, else [model]
    fan_out: bool = False                        # `loras` was given
    n: int = 1
    sampling: common_pb2.SamplingParams = field(default_factory=common_pb2.SamplingParams)
    max_tokens: int | None = None                # None: the route's default
    stream: bool = False
    include_usage: bool = False

    @property
    def num_prompts(self) -> int:
        return 1 if self.chat else len(self.prompts)


def _bad(param: str, message: str) -> HttpError:
    return HttpError(400, f"{param}: {message}", param=param, code="invalid_value")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or not lo <= v <= hi:
        raise _bad(name, f"expected an integer in [{lo}, {hi}], got {_show(v)}")
    return v


def _number(body: dict, name: str, lo: float, hi: float, *, open_lo: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) \
            or not (lo < v if open_lo else lo <= v) or v > hi:
        raise _bad(name, f"expected a number in {'(' if open_lo else '['}{lo}, {hi}], got {_show(v)}")
    return float(v)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(name, f"expected true or false, got {_show(v)}")
    return v


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:80] + "..."


def _model_name(v: Any, param: str) -> str:
    if not isinstance(v, str) or not v:
        raise _bad(param, "expected a model name: the base model, an adapter's name, or task:<id> "
                          "(GET /v1/models lists them)")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "expected a non-empty string or a list of them")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"{len(stops)} stop strings; at most {MAX_STOP_STRINGS}")
    return stops


def _token_ids(v: Any, param: str) -> list[int] | None:
    """A list of token ids, or None when `v` is not one (the caller tries other forms)."""
    if not isinstance(v, list) or not v or not all(_is_int(t) for t in v):
        return None
    if any(not 0 <= t < UINT32 for t in v):
        raise _bad(param, "token ids must be integers >= 0 (and inside the vocabulary)")
    return v


def _prompts(body: dict) -> list[gateway_pb2.GenerateRequest]:
    v = body.get("prompt")
    if isinstance(v, str):
        return [gateway_pb2.GenerateRequest(text=v)]
    ids = _token_ids(v, "prompt")
    if ids is not None:
        return [gateway_pb2.GenerateRequest(input_ids=ids)]
    if isinstance(v, list) and v:
        if len(v) > MAX_CHOICES:
            raise _bad("prompt", f"{len(v)} prompts; at most {MAX_CHOICES} in one request")
        out = []
        for i, p in enumerate(v):
            if isinstance(p, str):
                out.append(gateway_pb2.GenerateRequest(text=p))
                continue
            ids = _token_ids(p, f"prompt[{i}]")
            if ids is None:
                raise _bad("prompt", f"prompt[{i}] is neither a string nor a non-empty list of token ids")
            out.append(gateway_pb2.GenerateRequest(input_ids=ids))
        return out
    raise _bad("prompt", "expected a string, a list of strings, a list of token ids, or a list of lists of "
                         "token ids")


def _content(v: Any, param: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for i, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{param}[{i}]", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(param, "expected a string or a list of text parts")


def _messages(body: dict) -> list[dict[str, str]]:
    v = body.get("messages")
    if not isinstance(v, list) or not v:
        raise _bad("messages", "expected a non-empty list of {\"role\", \"content\"} messages")
    if len(v) > MAX_MESSAGES:
        raise _bad("messages", f"{len(v)} messages; at most {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "expected an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise _bad(f"messages[{i}].role", f"expected one of {', '.join(_ROLES)} (tools are not supported), "
                                              f"got {_show(role)}")
        if m.get("tool_calls") or m.get("function_call"):
            raise _bad(f"messages[{i}]", "tool and function calls are not supported")
        out.append({"role": _ROLES[role], "content": _content(m.get("content"), f"messages[{i}].content")})
    return out


def _check_neutral(body: dict) -> None:
    for name, neutral in _NEUTRAL.items():
        if name in body and not any(body[name] == v for v in neutral):
            raise HttpError(400, f"{name}: not supported by this server; leave it out or at its default "
                                 f"({_show(neutral[-1])}), got {_show(body[name])}", param=name,
                            code="unsupported_parameter")


def _sampling(body: dict, plan: GenerationPlan) -> None:
    s = plan.sampling
    temperature = _number(body, "temperature", 0.0, 100.0)
    s.temperature = 1.0 if temperature is None else temperature    # the OpenAI default
    top_p = _number(body, "top_p", 0.0, 1.0, open_lo=True)
    s.top_p = 1.0 if top_p is None else top_p
    top_k = _int(body, "top_k", -1, UINT32 - 1)
    s.top_k = 0 if top_k is None or top_k < 0 else top_k               # -1 or 0: off
    seed = _int(body, "seed", -(2**63), UINT64 - 1)
    if seed is not None:
        s.seed = seed % UINT64 or 2**63     # 0 means "no seed" downstream: keep a given 0 reproducible
    s.stop.extend(_stop(body))
    s.ignore_eos = _bool(body, "ignore_eos")
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < UINT32 for t in ids):
            raise _bad("stop_token_ids", "expected a list of token ids")
        s.stop_token_ids.extend(ids)
    names = [n for n in ("max_tokens", "max_completion_tokens") if body.get(n) is not None]
    for name in names:
        plan.max_tokens = _int(body, name, 1, 2**62)


def parse_plan(body: Any, chat: bool) -> GenerationPlan:
    """A checked plan of a completions (chat false) or chat completions body."""
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object", code="invalid_json")
    plan = GenerationPlan(chat=chat, model=_model_name(body.get("model"), "model"))
    _check_neutral(body)
    if chat:
        plan.messages = _messages(body)
    else:
        plan.prompts = _prompts(body)
    loras = body.get("loras")
    if loras is None:
        plan.models = [plan.model]
    else:
        if not isinstance(loras, list) or not loras:
            raise _bad("loras", "expected a non-empty list of model names (base, adapter names, task:<id>)")
        plan.models = [_model_name(m, f"loras[{i}]") for i, m in enumerate(loras)]
        plan.fan_out = True
    plan.n = _int(body, "n", 1, MAX_CHOICES) or 1
    total = plan.n * len(plan.models) * plan.num_prompts
    if total > MAX_CHOICES:
        raise _bad("n", f"{plan.num_prompts} prompt(s) x {len(plan.models)} model(s) x n={plan.n} is {total} "
                        f"choices; at most {MAX_CHOICES} in one request")
    _sampling(body, plan)
    plan.stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not plan.stream:
            raise _bad("stream_options", "only with stream: true")
        if not isinstance(options, dict):
            raise _bad("stream_options", "expected an object such as {\"include_usage\": true}")
        plan.include_usage = _bool(options, "include_usage")
    return plan
