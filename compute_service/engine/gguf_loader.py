"""GGUF reading: metadata -> ModelSpec, tensors dequantized to float32 with Hugging Face names.

llama.cpp's converter permutes the q and k rows of Llama checkpoints for its
interleaved RoPE; we undo it (as transformers does) to use the rotate-half
layout. Qwen2 GGUFs are not permuted. Q4_0 / Q4_1 / Q8_0 projections can also be
read kept quantized (`GGUFSource.quantized`), their rows un-permuted the same way
(a row is whole blocks along K, so moving rows is exact).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compute_service.engine.errors import ModelLoadError, UnsupportedModelError
from compute_service.engine.quantized import QuantizedWeight
from compute_service.engine.spec import ModelSpec, spec_from_gguf_fields

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    norm = m.group(2).endswith("norm")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}" + (".weight" if norm else f".{m.group(3)}")


def _unpermute(w: Any, n_head: int) -> Any:
    """Inverse of llama.cpp's `permute` (pairs interleaved -> halves), of a numpy array or a tensor."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _column_range(data: np.ndarray, tensor_type: Any, start: int, end: int) -> np.ndarray | None:
    """In features [start, end) of every row of a tensor's view: its values, or for a quantized type the
    bytes of their blocks; None when the cut does not fall on the type's block."""
    from gguf import GGML_QUANT_SIZES

    if data.dtype != np.uint8:                               # plain values [N, K]
        return data[:, start:end]
    block, nbytes = GGML_QUANT_SIZES[tensor_type]            # bytes per row: K / block blocks of nbytes
    if start % block or end % block:
        return None
    return data[:, start // block * nbytes:end // block * nbytes]


class GGUFSource:
    """Tensors by HF name: `source(name)` dequantized to float32, `source.quantized(prefix)` kept quantized
    (Q4_0 / Q4_1 / Q8_0 projections; None for other types, which are dequantized); `rows` / `columns`
    and `quantized_rows` / `quantized_columns` read only a slice (the tensors are views of the mapped
    file: a tensor-parallel rank touches its own rows or blocks)."""

    def __init__(self, spec: ModelSpec, by_hf: dict[str, Any]) -> None:
        from compute_service.engine.quant_formats.gguf import KEPT_TYPES

        self._spec = spec
        self._by_hf = by_hf
        self.work_device: torch.device | None = None     # where block types are dequantized (None: the host)
        self._permute = spec.architecture == "llama"
        kept = any(int(t.tensor_type) in KEPT_TYPES for name, t in by_hf.items() if name.startswith("model.layers."))
        # "gguf" when some projection can stay quantized; None (a dense checkpoint) otherwise
        self.format_name = "gguf" if kept else None

    def _heads(self, name: str) -> int | None:
        """Heads whose rows llama.cpp interleaved in this tensor, or None."""
        if self._permute and name.endswith("q_proj.weight"):
            return self._spec.num_heads
        if self._permute and name.endswith("k_proj.weight"):
            return self._spec.num_kv_heads
        return None

    def __call__(self, name: str) -> torch.Tensor | None:
        t = self._by_hf.get(name)
        return None if t is None else self._dense(t.data, t.tensor_type, self._heads(name))

    def rows(self, name: str, start: int, end: int) -> torch.Tensor | None:
        """Rows [start, end) of `name` in float32, reading only their bytes from the file (tensor-parallel
        ranks keep only theirs). A q/k range must be whole heads (llama.cpp interleaves rows within a
        head); any other range is cut from the whole tensor."""
        t = self._by_hf.get(name)
        if t is None:
            return None
        part = self._row_range(t, name, start, end)
        if part is None:
            return self._dense(t.data, t.tensor_type, self._heads(name))[start:end].contiguous()
        return self._dense(*part)

    def columns(self, name: str, start: int, end: int) -> torch.Tensor | None:
        """Columns [start, end) of `name` in float32, reading only their blocks of every row (a quantized
        type's cut must fall on its block size; any other range is cut from the whole tensor)."""
        t = self._by_hf.get(name)
        if t is None:
            return None
        data = _column_range(t.data, t.tensor_type, start, end)
        if data is None:
            return self._dense(t.data, t.tensor_type, self._heads(name))[:, start:end].contiguous()
        return self._dense(data, t.tensor_type, self._heads(name))

    def _row_range(self, t: Any, name: str, start: int, end: int) -> tuple[np.ndarray, Any, int | None] | None:
        """(rows [start, end) of the file's view, tensor type, heads to un-interleave in them); None when a
        q/k range is not whole heads."""
        heads = self._heads(name)
        if heads is not None:
            per_head = t.data.shape[0] // heads
            if start % per_head or end % per_head:
                return None
            heads = (end - start) // per_head
        return t.data[start:end], t.tensor_type, heads

    def _dense(self, data: np.ndarray, tensor_type: Any, heads: int | None) -> torch.Tensor:
        """float32 [N, K] of a tensor's rows (values, or bytes per row for quantized types); on `work_device`
        where one is set and the type is one of the block types."""
        from gguf import dequantize

        from compute_service.engine.quant_formats.gguf import block_weight

        # Q4_0 / Q4_1 / Q8_0 through the canonical form, in torch: the same float32 values (bit for bit
        # but for the sign of some zeros; tests/engine/test_gguf_dequant.py) in under half the time of the
        # per-block numpy path, which took most of a SmolLM2 load (0.91 of 1.3 s on 2 cores); other types
        # as before. With a GPU the products run there: on the host's threads they took 0.8 s of a SmolLM2
        # load alone, and 8.6 s beside the other services starting (an H200 host of 16 cores).
        qw = block_weight(data, tensor_type, exact_only=True) if data.ndim == 2 else None
        if qw is not None and self.work_device is not None:
            wt = qw.to(self.work_device).dequantize(torch.float32)
            return (_unpermute(wt, heads) if heads is not None else wt).contiguous()
        if qw is not None:
            w = qw.dequantize(torch.float32).numpy()
        else:
            w = np.asarray(dequantize(data, tensor_type), dtype=np.float32)
        if heads is not None:
            w = _unpermute(w, heads)
        return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # a writable copy

    def quantized(self, prefix: str) -> QuantizedWeight | None:
        return self._quantized(prefix, None, None)

    def quantized_rows(self, prefix: str, start: int, end: int) -> QuantizedWeight | None:
        """Output features [start, end) kept quantized, reading only their rows (q/k: whole heads, as
        `rows`; any other q/k range is cut from the whole tensor)."""
        return self._quantized(prefix, (start, end), None)

    def quantized_columns(self, prefix: str, start: int, end: int) -> QuantizedWeight | None:
        """In features [start, end) kept quantized, reading only their blocks of every row; None (read it
        dense) when the cut is not on the 32-value block."""
        return self._quantized(prefix, None, (start, end))

    def _quantized(self, prefix: str, rows: tuple[int, int] | None,
                   columns: tuple[int, int] | None) -> QuantizedWeight | None:
        from compute_service.engine.quant_formats.gguf import KEPT_TYPES, block_weight

        name = prefix + ".weight"
        t = self._by_hf.get(name)
        if t is None or not prefix.startswith("model.layers.") or int(t.tensor_type) not in KEPT_TYPES:
            return None
        data, heads = t.data, self._heads(name)
        if rows is not None:
            part = self._row_range(t, name, *rows)
            if part is None:
                whole = self._quantized(prefix, None, None)
                return None if whole is None else whole.rows(*rows)
            data, _, heads = part
        if columns is not None:
            cut = _column_range(data, t.tensor_type, *columns)
            if cut is None:
                return None
            data = cut
        qw = block_weight(data, t.tensor_type)
        if qw is None or heads is None:
            return qw
        order = torch.from_numpy(_unpermute(np.arange(qw.shape[0]), heads).copy())
        return QuantizedWeight(qw.q[order], qw.scales[order], qw.offsets[order], qw.bits, qw.group_size)


def read_gguf(path: Path) -> tuple[ModelSpec, GGUFSource, str | None]:
    """Returns (spec, get-by-HF-name, chat template)."""
    from loraplex.formats.gguf_header import read_header

    try:
        header = read_header(path)
    except Exception as e:  # bad files raise ValueErrors/struct errors from deep inside the parse
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from None
    fields = {k: v for k, v in header.fields.items()
              if k not in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores")}
    num_tokens = header.array_lengths.get("tokenizer.ggml.tokens", len(fields.pop("tokenizer.ggml.tokens", [])))
    tensors = header.tensors
    freqs = tensors.get("rope_freqs.weight")
    try:
        spec = spec_from_gguf_fields(fields, num_tokens, "output.weight" in tensors, path.stem,
                                     None if freqs is None else np.asarray(freqs.data, dtype=np.float64).ravel())
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{path.name}: {e}") from None
    by_hf = {h: t for t in tensors.values() if (h := _hf_name(t.name)) is not None}
    return spec, GGUFSource(spec, by_hf), fields.get("tokenizer.chat_template")
