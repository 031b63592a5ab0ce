"""The paged KV cache tensors and their sizing from a memory budget."""
from __future__ import annotations

import torch

from compute_service.engine.errors import CapacityError
from compute_service.engine.spec import ModelSpec


def kv_block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, keys and values."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem


def num_blocks_for_budget(spec: ModelSpec, block_size: int, dtype: torch.dtype, budget_bytes: int,
                          max_model_len: int) -> int:
    """Blocks that fit in `budget_bytes`; refuses a budget that cannot hold one max-length sequence."""
    per_block = kv_block_bytes(spec, block_size, dtype)
    num_blocks = budget_bytes // per_block
    need = -(-max_model_len // block_size)
    if num_blocks < need:
        raise CapacityError(
            f"KV cache budget {budget_bytes / 2**20:.1f} MiB holds {num_blocks} blocks of {block_size} tokens, "
            f"but one sequence of max_model_len={max_model_len} needs {need} "
            f"({need * per_block / 2**20:.1f} MiB): raise the KV budget or lower max_model_len")
    return int(num_blocks)


def cuda_kv_budget(device: torch.device, fraction: float, reserve_bytes: int = 0) -> int:
    """`fraction` of the GPU memory that is free now (after the weights are loaded), less `reserve_bytes`
    for what is allocated from the same share after the KV cache (an adapter pool of a fixed size)."""
    free, _total = torch.cuda.mem_get_info(device)
    budget = int(free * fraction) - reserve_bytes
    if budget <= 0:
        raise CapacityError(
            f"{fraction:.2f} of the {free / 2**30:.2f} GiB of GPU memory free after the weights is "
            f"{free * fraction / 2**30:.2f} GiB, which the {reserve_bytes / 2**30:.2f} GiB adapter pool "
            f"fills, leaving no KV cache: lower the adapter pool size or raise the memory fraction")
    return budget


def allocate_kv_cache(spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v), each [num_blocks, block_size, num_kv_heads, head_dim], one allocation.

    Zeroed: attention reads whole blocks and masks the unwritten slots, and a
    masked NaN left over from earlier use of the memory would still poison the
    softmax (0 * NaN); written slots always hold finite values.
    """
    cache = torch.zeros(spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim,
                        dtype=dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(spec.num_layers)]
