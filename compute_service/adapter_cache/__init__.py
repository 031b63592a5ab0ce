"""Level 2 of the adapter cache: a paged pool of adapter weights on the compute device.

- `pages`: the free list of pool pages;
- `residency`: loading, pinning and LRU eviction of adapters (plain Python);
- `loader`: asynchronous fetch from the host cache and copy into the pool;
- `paged_backend`: the engine's LoRA backend reading weights from the pool.
"""
