"""What this process may use of the host: CPUs and memory, within its container's cgroup limits.

`os.sched_getaffinity` and `sysconf` describe the whole machine; a container (a Kubernetes pod with
`limits`, `docker run --cpus/--memory`) is held to less by its cgroup: a CPU quota (cgroup v2 `cpu.max`,
v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`) and a memory limit (v2 `memory.max` less `memory.current`,
v1 `memory.limit_in_bytes` less `memory.usage_in_bytes`). A process sizing a pool of workers from the
machine's figures alone would spawn more than its quota runs at once, or more than its limit holds.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup's quota allows (fractional), or None where there is no quota."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        if quota != "max" and period:
            return int(quota) / int(period)
        return None
    quota, period = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
    if quota is not None and period is not None and int(quota) > 0 and int(period) > 0:
        return int(quota) / int(period)
    return None


def cgroup_memory_left(root: Path = CGROUP_ROOT) -> int | None:
    """Bytes the cgroup may still take before its limit, or None where there is no limit."""
    limit, used = _read(root / "memory.max"), _read(root / "memory.current")
    if limit is None:
        limit = _read(root / "memory" / "memory.limit_in_bytes")
        used = _read(root / "memory" / "memory.usage_in_bytes")
    if limit is None or limit == "max" or used is None:
        return None
    if int(limit) >= 1 << 60:                   # v1 writes "no limit" as a huge number
        return None
    return max(0, int(limit) - int(used))


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may run on at once: its affinity, capped by the cgroup's quota (rounded up)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:                      # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else max(1, cpus)


def available_memory(root: Path = CGROUP_ROOT) -> int | None:
    """Bytes of memory available now: the host's free memory (free pages only: page cache and other
    reclaimable memory are not counted), capped by what the cgroup's limit leaves; None where neither can be
    read."""
    host = None
    try:
        host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        pass
    left = cgroup_memory_left(root)
    known = [b for b in (host, left) if b is not None]
    return min(known) if known else None
