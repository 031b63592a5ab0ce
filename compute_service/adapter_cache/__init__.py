"""Level 2 of the adapter cache: a paged pool of adapter weights on the compute device.

- `pages`: the free list of pool pages;
- `residency`: loading, pinning and LRU eviction of adapters (plain Python);
- `loader`: the host-cache fetch signature and adapter keys;
- `paged_slots`: the pool itself, loraplex's only one (engine, service and benchmarks);
- `backends`: one LoRA backend per device type over it: `paged_backend` (Triton
  kernels reading the pages, CUDA) and `dense_backend` (batched torch matmuls
  over per-adapter copies from `dense_views`, CPU).
"""
