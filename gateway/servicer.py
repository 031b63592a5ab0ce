"""loraplex.v1.Gateway: protobuf <-> domain objects.

NOT FINISHED: this is the foundation's skeleton; every RPC still answers
UNIMPLEMENTED (the generated base class) until its issue lands.
"""
from __future__ import annotations

from loraplex.v1 import gateway_pb2_grpc


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Skeleton: RPCs are UNIMPLEMENTED until their issue lands."""
