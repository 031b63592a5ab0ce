"""loraplex.v1.Compute: protobuf <-> domain objects.

NOT FINISHED: this is the foundation's skeleton; every RPC still answers
UNIMPLEMENTED (the generated base class) until its issue lands.
"""
from __future__ import annotations

from loraplex.v1 import compute_pb2_grpc


class ComputeServicer(compute_pb2_grpc.ComputeServicer):
    """Skeleton: RPCs are UNIMPLEMENTED until their issue lands."""
