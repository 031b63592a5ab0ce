"""A checkpoint whose projections may be stored quantized, seen two ways at once.

`source(name)` is the usual tensor source by Hugging Face name (float tensors): a quantized
projection's `.weight` comes back dequantized in float32, so every dense consumer (a
`--quantization none` load, tensor-parallel sharding, the fingerprint) works unchanged.
`source.quantized(prefix)` gives the projection `prefix` (e.g. `model.layers.0.self_attn.q_proj`)
in the canonical quantized form, or None where the checkpoint keeps it dense.

`work_device` (set by the loader on a GPU) is where a reader works: the packed words, scales and zero
points go there as read, and the unpacking, the zero points' offsets and the fusion of parts run there
instead of on the host's cores (which unpack an 8B compressed-tensors checkpoint's 7 G codes in 4.9-5.6 s
on 2 cores; see docs/quantization.md, "Loading and writing").
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from compute_service.engine.errors import UnsupportedModelError
from compute_service.engine.quantized import QuantizedWeight

RawSource = Callable[[str], "torch.Tensor | None"]
Reader = Callable[[str], "QuantizedWeight | None"]
_DENSE_ALWAYS = ("model.embed_tokens", "lm_head")      # gathered / the head: kept in the model dtype


class QuantizedSource:
    """Tensor source by HF name over a quantized checkpoint (see the module docstring)."""

    def __init__(self, raw: RawSource, make_reader: Callable[[RawSource], Reader], format_name: str) -> None:
        self._raw = raw
        self.format_name = format_name
        self.work_device: torch.device | None = None     # where readers unpack (None: where `raw` puts tensors)
        self._read = make_reader(self._raw_on_work_device)

    def _raw_on_work_device(self, name: str) -> torch.Tensor | None:
        t = self._raw(name)
        return t if t is None or self.work_device is None else t.to(self.work_device)

    def __call__(self, name: str) -> torch.Tensor | None:
        t = self._raw(name)
        if t is not None or not name.endswith(".weight"):
            return t
        qw = self.quantized(name.removesuffix(".weight"))
        return None if qw is None else qw.dequantize(torch.float32)

    def quantized(self, prefix: str) -> QuantizedWeight | None:
        if prefix in _DENSE_ALWAYS:
            return None
        return self._read(prefix)


def hf_quantized_source(qcfg: dict[str, Any], raw: RawSource) -> Any:
    """The reader for a HF folder's `quantization_config` (AWQ, GPTQ, compressed-tensors), or for FP8 and
    bitsandbytes weights the source that dequantizes them at load (`dequantized.DequantizingSource`)."""
    from compute_service.engine.quant_formats import awq, bnb, compressed_tensors, fp8, gptq

    if fp8.is_fp8(qcfg):
        return fp8.fp8_source(raw, qcfg)
    if bnb.is_bnb(qcfg):
        return bnb.bnb_source(raw, qcfg)
    method = str(qcfg.get("quant_method", "")).lower()
    modules = {m.FORMAT: m for m in (awq, gptq, compressed_tensors)}
    if method not in modules:
        raise UnsupportedModelError(f"quantization_config quant_method {method!r} is not supported; "
                                    f"supported: {sorted(modules)} (or load the unquantized model)")
    return QuantizedSource(raw, lambda on_device: modules[method].reader(qcfg, on_device), method)
