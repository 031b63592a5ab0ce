"""Gateway settings (flags and LORAPLEX_* environment variables)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from gateway.token_stream import DEFAULT_MAX_BUFFERED_TOKENS
from loraplex.settings import SettingsError


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of `loraplex gateway`."""

    listen: str = field(default="127.0.0.1:50051", metadata={"help": "address to serve the public API on"})
    cache_address: str = field(default="127.0.0.1:50052", metadata={"help": "host cache service address"})
    compute_addresses: tuple[str, ...] = field(
        default=("127.0.0.1:50053",),
        metadata={"help": "compute service addresses, comma-separated; dns:///NAME:PORT means every "
                          "address NAME resolves to"})
    replica_spill_threshold: int = field(
        default=32, metadata={"help": "requests in flight on an adapter's home replica at which new ones "
                                      "spill to the least-loaded replica"})
    replica_health_interval_s: float = field(
        default=1.0, metadata={"help": "seconds between health checks (and DNS lookups) of compute replicas"})
    model: str = field(
        default="", metadata={"help": "base model whose tokenizer the gateway uses (GGUF file or HF folder); "
                                      "default SmolLM2-135M-Instruct; must match the compute service's"})
    default_max_tokens: int = field(
        default=16, metadata={"help": "new tokens generated when a request leaves max_tokens at 0"})
    max_message_bytes: int = field(
        default=1 << 30, metadata={"help": "largest request accepted, in bytes (inline adapters can be ~335 MB)"})
    max_buffered_tokens: int = field(
        default=DEFAULT_MAX_BUFFERED_TOKENS,
        metadata={"help": "tokens of one request the gateway holds for a client that is not reading; past them it "
                          "cancels the request on compute (RESOURCE_EXHAUSTED)"})
    downstream_timeout_s: float = field(
        default=30.0, metadata={"help": "deadline of calls to the cache and of non-streaming compute calls"})
    http_listen: str = field(
        default="", metadata={"help": "address of the OpenAI-compatible HTTP API, e.g. 127.0.0.1:8000 (empty: off)"})
    served_model_name: str = field(
        default="", metadata={"help": "the base model's name in the HTTP API (default: the model file's or "
                                      "folder's name, e.g. SmolLM2-135M-Instruct)"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus metrics port (0 = off; the HTTP API's "
                                                           "port serves /metrics too)"})
    tls_cert: str = field(default="", metadata={"help": "PEM certificate chain: serve the public API over TLS "
                                                        "(with --tls-key); docs/security.md"})
    tls_key: str = field(default="", metadata={"help": "PEM private key of --tls-cert"})
    tls_client_ca: str = field(default="", metadata={"help": "PEM CA: clients must present a certificate it "
                                                             "signed (mutual TLS)"})
    api_keys_file: str = field(default="", metadata={"help": "hashed API keys with their scopes and limits (lines, "
                                                             ".toml or .json; `loraplex keys add`); none: open"})
    api_keys: str = field(default="", repr=False, metadata={
        "help": "comma-separated API keys with every scope, hashed on load: set it in the environment, "
                "not as a flag (flags show in the process list)"})
    api_key_rate: float = field(default=0.0, metadata={"help": "requests per second per key, for entries that "
                                                                "set no rate (0: no limit)"})
    api_key_burst: int = field(default=0, metadata={"help": "requests a key may send at once above its rate "
                                                             "(0: the rate rounded up)"})
    api_key_max_streams: int = field(default=0, metadata={"help": "concurrent Generate streams per key, for "
                                                                   "entries that set none (0: no limit)"})
    adapter_resolve_ttl_s: float = field(default=1.0, metadata={
        "help": "seconds this gateway reuses the host cache's answer for an adapter name or task id without "
                "asking again (0: ask on every request); a load or unload through this gateway takes effect at "
                "once, one through another gateway within this time"})
    reuse_port: bool = field(default=False, metadata={
        "help": "share the listen addresses with other gateway processes on this host (SO_REUSEPORT; the kernel "
                "spreads connections over them); `loraplex serve --gateway-workers N` starts N such gateways"})
    gil_switch_interval_us: int = field(default=500, metadata={
        "help": "Python thread switch interval while serving, in microseconds (0 = Python's 5000): the link to "
                "compute hands every message between threads, each hand-off waiting up to this long for the GIL"})
    log_requests: bool = field(default=False, metadata={
        "help": "log one line per generate request (gRPC) and per completion (HTTP) at INFO: its id, prompt "
                "tokens, entries; off, the line is DEBUG: under bursts of short requests it took 2-8% of a "
                "gateway process's time"})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})
    log_format: str = field(default="text", metadata={"help": "text, or json: one JSON object per line, with "
                                                              "request ids"})

    @property
    def request_log_level(self) -> int:
        """The level of the one line logged per request (gRPC generate, HTTP completion): `log_requests`."""
        return logging.INFO if self.log_requests else logging.DEBUG

    def __post_init__(self) -> None:
        if self.log_format not in ("text", "json"):
            raise SettingsError(f"log_format: expected text or json, got {self.log_format!r}")
        if not 0 <= self.metrics_port <= 65535:
            raise SettingsError("metrics_port: must be in 0..65535")
        if not self.compute_addresses:
            raise SettingsError("compute_addresses: give at least one compute service address")
        if self.replica_spill_threshold < 1 or self.replica_health_interval_s <= 0:
            raise SettingsError("replica_spill_threshold must be >= 1 and replica_health_interval_s positive")
        if self.max_message_bytes < 4 << 20:
            raise SettingsError("max_message_bytes: must be at least 4 MiB")
        if self.adapter_resolve_ttl_s < 0:
            raise SettingsError("adapter_resolve_ttl_s must be >= 0")
        if self.gil_switch_interval_us < 0:
            raise SettingsError("gil_switch_interval_us must be >= 0")
        if self.max_buffered_tokens < 1:
            raise SettingsError("max_buffered_tokens: must be at least 1")
        if self.default_max_tokens < 1:
            raise SettingsError("default_max_tokens: must be at least 1")
        if self.downstream_timeout_s <= 0:
            raise SettingsError("downstream_timeout_s: must be positive")
        if self.api_key_rate < 0 or self.api_key_burst < 0 or self.api_key_max_streams < 0:
            raise SettingsError("api_key_rate, api_key_burst and api_key_max_streams must be >= 0")
        from gateway.api_keys import load_keys
        from gateway.tls import check_tls_settings
        check_tls_settings(self.tls_cert, self.tls_key, self.tls_client_ca)
        load_keys(self.api_keys_file, self.api_keys)     # a bad key file fails the start, naming the line
        if self.http_listen and ":" not in self.http_listen:
            raise SettingsError(f"http_listen: expected HOST:PORT, got {self.http_listen!r}")
