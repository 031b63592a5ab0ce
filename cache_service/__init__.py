"""Level-1 host adapter cache: converted adapters in shared memory or Redis, byte-budget LRU."""
