"""`python -m cache_service`: Run the host adapter cache service (loraplex.v1.AdapterCache)."""
import sys

from loraplex.cli._service import service_main

if __name__ == "__main__":
    sys.exit(service_main("cache_service", "CacheConfig", "Run the host adapter cache service (loraplex.v1.AdapterCache)."))
