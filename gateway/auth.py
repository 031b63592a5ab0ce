"""Access control of the public gateway: API keys, their scopes, request-rate and stream limits.

A key is a random string a client sends as `authorization: Bearer <key>` (gRPC
metadata or an HTTP header). The gateway keeps only its SHA-256 (keys are
random, 256 bits from `loraplex keys add`, so a salted slow hash would buy
nothing but a per-request cost); entries (`gateway.api_keys`) come from
`--api-keys-file` and from `LORAPLEX_API_KEYS`. No entry at all means the
gateway is open, as before.

An entry may restrict its key to adapters whose names start with given
prefixes (the base model is always allowed; a scoped key names adapters, it
cannot reach them by bare task id), allow management (LoadLora/UnloadLora,
off unless `manage`), and limit its request rate (a token bucket) and its
concurrent streams. `AccessControl.authorize` and `stream_slot` are the whole
check; `AuthInterceptor` applies them to gRPC calls and `http_guard` to the
HTTP API. The adapter scope is checked where the servicer resolves adapters,
through the principal this module puts in a context variable.

Keys never reach a log line or an error message: refusals name the entry.
"""
from __future__ import annotations

import contextlib
import contextvars
import ipaddress
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Sequence

import grpc

from loraplex.errors import LoraplexError, ResourceExhaustedError
from loraplex.grpc_errors import bounded
from loraplex.settings import SettingsError
from gateway.api_keys import KeyEntry, hash_key, load_keys

log = logging.getLogger(__name__)

ACTIONS = ("generate", "manage", "read")
_MANAGEMENT_METHODS = frozenset({"LoadLora", "UnloadLora"})
# Reachable without a key: container and load-balancer probes speak plain health checks.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


class UnauthenticatedError(LoraplexError):
    """No API key, or one the gateway does not know."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(LoraplexError):
    """The key is known but may not do this (an adapter outside its prefixes, a management call)."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class RateLimitedError(ResourceExhaustedError):
    """Over a key's request rate or stream limit (HTTP 429, with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Principal:
    """Who a call runs as: a key's name and scope (OPEN when the gateway has no keys)."""

    name: str
    adapters: tuple[str, ...] | None = None
    manage: bool = True

    def allows_adapter(self, name: str) -> bool:
        return self.adapters is None or any(name.startswith(p) for p in self.adapters)

    def check_adapter(self, name: str, what: str = "adapter") -> None:
        """Raises PERMISSION_DENIED unless the key may use the adapter called `name`."""
        if not self.allows_adapter(name):
            raise PermissionDeniedError(f"{what}: key {self.name!r} may not use adapter {bounded(name, 200)!r} "
                                        f"(its adapters start with {', '.join(map(repr, self.adapters or ()))})")

    def check_lora_specs(self, specs: Iterable[Any]) -> None:
        """The adapters of a request's LoraSpecs: the base model always, names in scope; a scoped key
        cannot reach an adapter by bare task id (its name is what the scope is about). Inline weights
        store an adapter in the shared host cache (ALWAYS replaces the one others use): management."""
        for i, spec in enumerate(specs):
            if spec.HasField("weights") and not self.manage:
                raise PermissionDeniedError(f"loras[{i}]: key {self.name!r} may not send inline weights: they "
                                            "store an adapter in the shared cache (its entry needs manage = true)")
            if spec.name:
                self.check_adapter(spec.name, f"loras[{i}]")
            elif spec.HasField("task_id") and self.adapters is not None:
                raise PermissionDeniedError(f"loras[{i}]: key {self.name!r} may use adapters by name only "
                                            f"(task id {spec.task_id} given without one)")

    def check_may_manage(self) -> None:
        """Raises PERMISSION_DENIED unless the key may load and unload adapters at all."""
        if not self.manage:
            raise PermissionDeniedError(f"key {self.name!r} may not load or unload adapters "
                                        "(its entry needs manage = true)")

    def check_management(self, name: str, has_task_id: bool) -> None:
        """LoadLora/UnloadLora of the adapter `name` (or a bare task id)."""
        self.check_may_manage()
        if self.adapters is not None:
            if not name:
                raise PermissionDeniedError(f"key {self.name!r} may manage adapters by name only"
                                            + (" (a task id was given without one)" if has_task_id else ""))
            self.check_adapter(name)


OPEN = Principal("open")
_CURRENT: contextvars.ContextVar[Principal] = contextvars.ContextVar("loraplex_principal", default=OPEN)


def current_principal() -> Principal:
    """The principal of the call being served (OPEN when the gateway has no keys)."""
    return _CURRENT.get()


def set_principal(principal: Principal) -> None:
    """Makes `principal` the current call's (each gRPC call and HTTP request runs in its own task)."""
    _CURRENT.set(principal)


def action_of(method: str) -> str:
    """'generate', 'manage' or 'read' for an action name or a gRPC method ('/pkg.Service/Method')."""
    if method in ACTIONS:
        return method
    short = method.rsplit("/", 1)[-1]
    if short in _MANAGEMENT_METHODS:
        return "manage"
    return "generate" if short == "Generate" else "read"


def bearer_token(value: str | bytes | None) -> str | None:
    """The key of an `authorization: Bearer <key>` value (None when absent or of another scheme)."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


@dataclass
class _Usage:
    """A key's token bucket and open streams."""

    tokens: float
    stamp: float
    streams: int = 0


@dataclass(frozen=True)
class Limits:
    """The gateway's defaults for entries that set no limits of their own (0: no limit)."""

    rate: float = 0.0
    burst: int = 0
    max_streams: int = 0


@dataclass
class _Key:
    principal: Principal
    rate: float
    burst: int
    max_streams: int
    usage: _Usage = field(default_factory=lambda: _Usage(0.0, 0.0))


class AccessControl:
    """Checks keys, scopes and limits. With no entries every call is allowed, as the OPEN principal."""

    def __init__(self, entries: Sequence[KeyEntry], limits: Limits = Limits(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._limits = limits
        self._lock = threading.Lock()
        self._by_hash, self._by_name = self._build(entries, {})

    def _build(self, entries: Sequence[KeyEntry], old: dict[str, _Key]) -> tuple[dict[str, _Key], dict[str, _Key]]:
        """Keys by hash and by name; a key already in `old` (same hash) keeps its bucket and open streams."""
        by_hash: dict[str, _Key] = {}
        by_name: dict[str, _Key] = {}
        limits = self._limits
        for e in entries:
            if e.name in by_name or e.key_hash in by_hash:
                raise SettingsError(f"api key {e.name!r}: its name or its key appears twice")
            rate = limits.rate if e.rate is None else e.rate
            burst = limits.burst if e.burst is None else e.burst
            burst = burst or max(1, math.ceil(rate))
            key = _Key(Principal(e.name, e.adapters, e.manage), rate, burst,
                       limits.max_streams if e.max_streams is None else e.max_streams)
            kept = old.get(e.key_hash)
            key.usage = kept.usage if kept is not None else _Usage(float(burst), self._clock())
            by_hash[e.key_hash] = by_name[e.name] = key
        return by_hash, by_name

    def replace(self, entries: Sequence[KeyEntry]) -> None:
        """Swaps in a new set of keys (a reload): calls that come after see only these; streams already
        open finish under the key they started with; a key that stays keeps its rate bucket. Refuses
        (SettingsError) an empty set while keys are in force: that would open the gateway to anyone."""
        if self.enabled and not entries:
            raise SettingsError("the reloaded key set is empty: refusing to open the gateway to anyone "
                                "(restart without keys to run it open)")
        by_hash, by_name = self._build(entries, self._by_hash)
        with self._lock:
            self._by_hash, self._by_name = by_hash, by_name

    @property
    def enabled(self) -> bool:
        return bool(self._by_hash)

    def key_names(self) -> list[str]:
        return list(self._by_name)

    def authorize(self, token: str | None, method: str) -> Principal:
        """The principal of `token` if it may call `method` (a gRPC method or 'generate'/'manage'/'read');
        takes one request from its rate. Raises UNAUTHENTICATED, PERMISSION_DENIED or RESOURCE_EXHAUSTED
        (over its rate). Adapter scopes are checked later, where the servicer resolves adapters."""
        if not self.enabled:
            return OPEN
        if not token:
            raise UnauthenticatedError("this gateway needs an API key: send `authorization: Bearer <key>` "
                                       "(gRPC metadata or HTTP header)")
        key = self._by_hash.get(hash_key(token))
        if key is None:
            raise UnauthenticatedError("the API key is not one this gateway knows")
        principal = key.principal
        if action_of(method) == "manage":
            principal.check_may_manage()
        self._take(key)
        return principal

    def _take(self, key: _Key) -> None:
        if key.rate <= 0:
            return
        with self._lock:
            now = self._clock()
            u = key.usage
            u.tokens = min(float(key.burst), u.tokens + (now - u.stamp) * key.rate)
            u.stamp = now
            if u.tokens < 1.0:
                wait = (1.0 - u.tokens) / key.rate
                raise RateLimitedError(f"key {key.principal.name!r} is over its rate of {key.rate:g} requests "
                                       f"per second (burst {key.burst}); retry in {wait:.2f} s", wait)
            u.tokens -= 1.0

    @contextlib.contextmanager
    def stream_slot(self, principal: Principal) -> Iterator[None]:
        """Holds one of the key's concurrent streams for the block (RESOURCE_EXHAUSTED when all are open)."""
        key = self._key_of(principal)
        if key is None or key.max_streams <= 0:
            yield
            return
        with self._lock:
            if key.usage.streams >= key.max_streams:
                raise RateLimitedError(f"key {principal.name!r} already has {key.max_streams} streams open, "
                                       "its limit: wait for one to end", 1.0)
            key.usage.streams += 1
        try:
            yield
        finally:
            with self._lock:
                key.usage.streams -= 1

    def _key_of(self, principal: Principal) -> _Key | None:
        key = self._by_name.get(principal.name)
        return key if key is not None and key.principal is principal else None


# -- gRPC ------------------------------------------------------------------------------------------

def _metadata_token(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return bearer_token(value)
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authorizes every call but health checks; a Generate stream holds a stream slot while it runs."""

    def __init__(self, access: AccessControl) -> None:
        self._access = access

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        handler = await continuation(details)
        if handler is None or not self._access.enabled or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler      # an open gateway's calls run as OPEN (the default) without a wrapper
        try:
            principal: Principal | None = self._access.authorize(_metadata_token(details.invocation_metadata),
                                                                 details.method)
            refusal: LoraplexError | None = None
        except LoraplexError as exc:
            principal, refusal = None, exc
            log.info("refused %s: %s: %s", details.method, exc.grpc_code.name, exc)
        return _guarded(handler, self._access, principal, refusal)


async def _refuse(context: grpc.aio.ServicerContext, exc: LoraplexError) -> None:
    await context.abort(exc.grpc_code, bounded(str(exc)))


def _guarded(handler: grpc.RpcMethodHandler, access: AccessControl, principal: Principal | None,
             refusal: LoraplexError | None) -> grpc.RpcMethodHandler:
    """The same handler, refusing the call or running it as `principal`; a Generate stream (unary
    request, streamed answer) holds one of the key's stream slots while it runs."""
    async def admit(context: grpc.aio.ServicerContext) -> Principal:
        if refusal is not None or principal is None:
            await _refuse(context, refusal or UnauthenticatedError("refused"))
        assert principal is not None
        set_principal(principal)
        return principal

    def answering(inner: Any) -> Any:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await admit(context)
            return await inner(request, context)
        return call

    def streaming(inner: Any, holds_slot: bool) -> Any:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            who = await admit(context)
            slot = access.stream_slot(who) if holds_slot else contextlib.nullcontext()
            try:
                slot.__enter__()
            except RateLimitedError as exc:
                await _refuse(context, exc)
            try:
                async for item in inner(request, context):
                    yield item
            finally:
                slot.__exit__(None, None, None)
        return call

    args = (handler.request_deserializer, handler.response_serializer)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(answering(handler.unary_unary), *args)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(answering(handler.stream_unary), *args)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream, True), *args)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream, False), *args)  # reflection


# -- HTTP ------------------------------------------------------------------------------------------

def http_guard(source: Any) -> Callable[..., contextlib.AbstractAsyncContextManager[None]]:
    """The HTTP API's access-control hook (`gateway.http.routes.Guard`) over an AccessControl (the
    gateway passes its own, so a key's rate and streams count both APIs) or the gateway's settings.
    Adapter names are checked by the servicer, where the routes' models become LoraSpecs."""
    access = source if isinstance(source, AccessControl) else access_from_config(source)

    @contextlib.asynccontextmanager
    async def guard(request: Any, action: str, models: Sequence[str]) -> AsyncIterator[None]:
        principal = access.authorize(bearer_token(request.headers.get("authorization")), action)
        set_principal(principal)
        if action != "generate":
            yield
            return
        with access.stream_slot(principal):
            yield
    return guard


# -- settings --------------------------------------------------------------------------------------

def access_from_config(config: Any) -> AccessControl:
    """The gateway's AccessControl: `api_keys_file` entries and `api_keys` (env) keys, with its limits."""
    entries = load_keys(config.api_keys_file, config.api_keys)
    return AccessControl(entries, Limits(config.api_key_rate, config.api_key_burst, config.api_key_max_streams))


def reload_keys(access: AccessControl, config: Any) -> bool:
    """Reads the key file (and LORAPLEX_API_KEYS as started) again into `access` (on SIGHUP). A file that
    does not load, or an empty set while keys are in force, leaves the keys as they were; logged either way."""
    try:
        entries = load_keys(config.api_keys_file, config.api_keys)
        access.replace(entries)
    except (SettingsError, OSError, ValueError) as e:
        log.error("API keys not reloaded, the previous %d stay in force: %s", len(access.key_names()), e)
        return False
    log.info("API keys reloaded from %s: %d key(s) (%s)", config.api_keys_file or "the environment",
             len(access.key_names()), ", ".join(access.key_names()))
    return True


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT listens on loopback only (127.0.0.0/8, ::1, localhost)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(listen: str, access: AccessControl, tls: bool, what: str = "gateway") -> None:
    """One startup warning when a non-loopback address is open to anyone, or carries keys in clear."""
    if is_loopback(listen):
        return
    if not access.enabled:
        log.warning("%s listens on %s with no API keys: anyone who can reach it can generate and load or "
                    "unload adapters (set --api-keys-file or LORAPLEX_API_KEYS; docs/security.md)", what, listen)
    elif not tls:
        log.warning("%s listens on %s without TLS: API keys and prompts cross the network in clear "
                    "(set --tls-cert and --tls-key; docs/security.md)", what, listen)
