"""Which compute replica serves a request: adapter affinity, load spill, health.

Pure book-keeping (no gRPC, no asyncio, no clock), so every rule is unit-tested;
`gateway/replica_router.py` drives it from health checks and calls.

- A request with an adapter goes to the adapter's *home*: the healthy replica
  with the highest rendezvous (highest-random-weight) score for the adapter's
  key. Every gateway computes the same home, and adding or removing a replica
  moves only the adapters homed on it, so each adapter stays warm in the GPU
  cache of few replicas.
- When the home is saturated (`spill_threshold` requests or more in flight)
  the request spills to the least-loaded replica, ties going to the adapter's
  next replicas in rendezvous order so spills also land on few replicas.
- A base-model request goes to the least-loaded replica, ties taken in turn
  so a trickle of requests still spreads.
- A replica that fails a call or a health check is out; routing skips it until
  a health check finds it serving again. If every replica is out, requests
  try them anyway (health can lag a restart; trying beats a certain error).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Sequence

DNS_SCHEME = "dns:///"


class NoReplicaError(LookupError):
    """No compute replica is left to try for a request."""


def rendezvous_score(key: str, address: str) -> int:
    """A stable pseudo-random weight of (key, replica), equal in every process.

    Python's hash() is salted per process; gateways must agree on homes."""
    digest = hashlib.blake2b(f"{key}\x00{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, addresses: Iterable[str]) -> list[str]:
    """Replicas from the key's home down, by descending score (ties by address)."""
    return sorted(addresses, key=lambda a: (-rendezvous_score(key, a), a))


def format_address(host: str, port: int | str) -> str:
    """`host:port`, with IPv6 literals in brackets as gRPC targets want them."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_target(target: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` (after any `dns:///`) -> (host, port); ValueError says why."""
    rest = target[len(DNS_SCHEME):] if target.startswith(DNS_SCHEME) else target
    host, sep, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"compute address {target!r}: expected HOST:PORT or dns:///NAME:PORT")
    return host, int(port)


def is_dns_target(target: str) -> bool:
    """`dns:///name:port`: every address the name resolves to is a replica."""
    return target.startswith(DNS_SCHEME)


@dataclass
class ReplicaState:
    """What routing knows of one replica."""

    address: str
    healthy: bool = True
    num_in_flight: int = 0
    reason: str = ""  # why it is out, for logs and errors


class ReplicaSet:
    """The replicas, their health and load, and the routing rule over them."""

    def __init__(self, addresses: Sequence[str], spill_threshold: int = 32) -> None:
        if spill_threshold < 1:
            raise ValueError("spill_threshold: must be at least 1")
        self.spill_threshold = spill_threshold
        self._states: dict[str, ReplicaState] = {}
        self._turn = 0  # rotates ties among equally loaded replicas for base requests
        self.set_addresses(addresses)

    # --- membership -------------------------------------------------------
    def set_addresses(self, addresses: Iterable[str], *, healthy: bool = True) -> tuple[list[str], list[str]]:
        """Makes the set exactly `addresses`; returns (added, removed).

        Replicas that stay keep their health and load; new ones start `healthy`
        (a caller that has not checked them yet may pass False)."""
        wanted = list(dict.fromkeys(addresses))
        removed = [a for a in self._states if a not in wanted]
        added = [a for a in wanted if a not in self._states]
        for a in removed:
            del self._states[a]
        for a in added:
            self._states[a] = ReplicaState(a, healthy=healthy, reason="" if healthy else "not checked yet")
        return added, removed

    @property
    def addresses(self) -> list[str]:
        return list(self._states)

    def state(self, address: str) -> ReplicaState:
        return self._states[address]

    def healthy(self) -> list[str]:
        return [a for a, s in self._states.items() if s.healthy]

    # --- health -----------------------------------------------------------
    def mark_down(self, address: str, reason: str) -> bool:
        """Takes a replica out; True if it was in (so the caller logs once)."""
        state = self._states.get(address)
        if state is None:
            return False
        was_up = state.healthy
        state.healthy, state.reason = False, reason
        return was_up

    def mark_up(self, address: str) -> bool:
        """Puts a replica back; True if it was out."""
        state = self._states.get(address)
        if state is None or state.healthy:
            return False
        state.healthy, state.reason = True, ""
        return True

    # --- load -------------------------------------------------------------
    def acquire(self, address: str) -> None:
        self._states[address].num_in_flight += 1

    def release(self, address: str) -> None:
        """Ends a request; a replica that left the set meanwhile is ignored."""
        state = self._states.get(address)
        if state is not None and state.num_in_flight > 0:
            state.num_in_flight -= 1

    # --- routing ----------------------------------------------------------
    def choose(self, adapter_key: str | None, exclude: Iterable[str] = ()) -> str:
        """The replica for a request with adapter `adapter_key` (None: the base model),
        skipping `exclude` (replicas this request already failed on)."""
        skip = set(exclude)
        candidates = [a for a in self.healthy() if a not in skip]
        if not candidates:
            candidates = [a for a in self._states if a not in skip]
        if not candidates:
            raise NoReplicaError(self._why_none(skip))
        load = {a: self._states[a].num_in_flight for a in candidates}
        if adapter_key is None:
            least = min(load.values())
            ties = [a for a in candidates if load[a] == least]
            self._turn += 1
            return ties[self._turn % len(ties)]
        order = rendezvous_order(adapter_key, candidates)
        home = order[0]
        if load[home] < self.spill_threshold:
            return home
        rank = {a: i for i, a in enumerate(order)}
        return min(order, key=lambda a: (load[a], rank[a]))

    def _why_none(self, skip: set[str]) -> str:
        if not self._states:
            return "no compute replica is known (a dns:/// address that resolved to nothing?)"
        tried = ", ".join(sorted(skip))
        return f"every compute replica failed this request ({tried})"
