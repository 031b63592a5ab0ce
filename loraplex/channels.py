"""Options of every gRPC channel loraplex opens: to another service, or a client's to the gateway.

gRPC's reconnect backoff to a peer that is down grows to 2 minutes; a channel
whose peer restarts (a cache, compute or gateway process, a container) would
then fail calls with UNAVAILABLE for up to that long after the peer listens
again. loraplex's channels retry every 0.2-2 s instead.
"""
from __future__ import annotations

MAX_RECONNECT_BACKOFF_MS = 2000


def channel_options(max_message_bytes: int) -> tuple[tuple[str, int], ...]:
    """Message limits both ways, and reconnect attempts 0.2-2 s apart."""
    return (("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS))
