"""One LoRA backend per device type over the one adapter pool, chosen here.

"auto": the Triton kernels (`PagedLoraBackend`) on CUDA, batched torch matmuls
(`DenseLoraBackend`) elsewhere. "kernels" / "torch" force one (tests compare
them; the torch one keeps fp32 checks on a GPU free of TF32).
"""
from __future__ import annotations

from compute_service.adapter_cache.dense_backend import DenseLoraBackend
from compute_service.adapter_cache.paged_backend import PagedLoraBackend
from compute_service.adapter_cache.paged_slots import PagedAdapterSlots

BACKENDS = ("auto", "kernels", "torch")


def lora_backend_for(slots: PagedAdapterSlots, max_num_batched_tokens: int,
                     kind: str = "auto") -> PagedLoraBackend | DenseLoraBackend:
    """The backend for `slots`' device (build it before CUDA graphs capture; `allocate()` once the pool is)."""
    if kind not in BACKENDS:
        raise ValueError(f"LoRA backend must be one of {BACKENDS}, got {kind!r}")
    if kind == "kernels" or (kind == "auto" and slots.device.type == "cuda"):
        return PagedLoraBackend(slots, max_num_batched_tokens)
    return DenseLoraBackend(slots, max_num_batched_tokens)
