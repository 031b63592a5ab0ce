"""Protobuf <-> engine values shared by the Compute servicer and its token-stream sessions."""
from __future__ import annotations

from compute_service.engine import errors as engine_errors
from compute_service.engine.outputs import RequestOutput
from compute_service.engine.sampling_params import SamplingParams
from loraplex import errors
from loraplex.v1 import common_pb2

DEFAULT_MAX_TOKENS = 16
FINISH_REASONS = {"stop": common_pb2.STOP, "length": common_pb2.LENGTH, "abort": common_pb2.CANCELLED}


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Zero values mean the documented defaults; stop strings are the gateway's business."""
    try:
        return SamplingParams(
            max_tokens=p.max_tokens or DEFAULT_MAX_TOKENS, temperature=p.temperature, top_k=p.top_k,
            top_p=p.top_p or 1.0, seed=p.seed or None, stop_token_ids=tuple(p.stop_token_ids),
            ignore_eos=p.ignore_eos)
    except engine_errors.InvalidRequestError as exc:
        raise errors.InvalidArgumentError(f"sampling: {exc}") from None


def finish_of(out: RequestOutput) -> tuple[common_pb2.FinishReason, common_pb2.Usage]:
    """The finish reason and usage of a request's last delta."""
    reason = FINISH_REASONS.get(out.finish_reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)
    return reason, common_pb2.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens)
