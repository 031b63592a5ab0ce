"""Gateway settings (flags and LORAPLEX_* environment variables)."""
from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.settings import SettingsError


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of `loraplex gateway`."""

    listen: str = field(default="127.0.0.1:50051", metadata={"help": "address to serve the public API on"})
    cache_address: str = field(default="127.0.0.1:50052", metadata={"help": "host cache service address"})
    compute_addresses: tuple[str, ...] = field(
        default=("127.0.0.1:50053",), metadata={"help": "compute service addresses, comma-separated"})
    max_message_bytes: int = field(
        default=1 << 30, metadata={"help": "largest request accepted, in bytes (inline adapters can be ~335 MB)"})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})

    def __post_init__(self) -> None:
        if not self.compute_addresses:
            raise SettingsError("compute_addresses: give at least one compute service address")
        if self.max_message_bytes < 4 << 20:
            raise SettingsError("max_message_bytes: must be at least 4 MiB")
