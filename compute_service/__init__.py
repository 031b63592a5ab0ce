"""The GPU compute service: the engine, the level-2 paged adapter cache, the Compute API."""
