"""loraplex.v1.AdapterCache: protobuf <-> domain objects.

NOT FINISHED: this is the foundation's skeleton; every RPC still answers
UNIMPLEMENTED (the generated base class) until its issue lands.
"""
from __future__ import annotations

from loraplex.v1 import cache_pb2_grpc


class AdapterCacheServicer(cache_pb2_grpc.AdapterCacheServicer):
    """Skeleton: RPCs are UNIMPLEMENTED until their issue lands."""
