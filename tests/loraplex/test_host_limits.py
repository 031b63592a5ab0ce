"""CPUs and memory within a container's cgroup limits (v2 and v1 layouts), as the compile pool sizes itself."""
from __future__ import annotations

from pathlib import Path

from loraplex.host_limits import available_memory, cgroup_cpu_quota, cgroup_memory_left, usable_cpus

GiB = 1 << 30


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


def test_cgroup_v2_quota_and_memory(tmp_path):
    root = _write(tmp_path, {"cpu.max": "150000 100000", "memory.max": str(8 * GiB), "memory.current": str(GiB)})
    assert cgroup_cpu_quota(root) == 1.5
    assert usable_cpus(root) <= 2                          # 1.5 CPUs of quota: two workers at most run at once
    assert cgroup_memory_left(root) == 7 * GiB
    assert available_memory(root) <= 7 * GiB


def test_cgroup_v2_without_limits(tmp_path):
    root = _write(tmp_path, {"cpu.max": "max 100000", "memory.max": "max", "memory.current": "123"})
    assert cgroup_cpu_quota(root) is None and cgroup_memory_left(root) is None
    assert usable_cpus(root) >= 1


def test_cgroup_v1_layout(tmp_path):
    root = _write(tmp_path, {"cpu/cpu.cfs_quota_us": "200000", "cpu/cpu.cfs_period_us": "100000",
                             "memory/memory.limit_in_bytes": str(4 * GiB),
                             "memory/memory.usage_in_bytes": str(5 * GiB)})
    assert cgroup_cpu_quota(root) == 2.0
    assert cgroup_memory_left(root) == 0                  # over its limit: nothing left, never negative
    unlimited = _write(tmp_path / "u", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000",
                                        "memory/memory.limit_in_bytes": str(1 << 63),
                                        "memory/memory.usage_in_bytes": "0"})
    assert cgroup_cpu_quota(unlimited) is None and cgroup_memory_left(unlimited) is None


def test_no_cgroup_files_means_the_machine_s_figures(tmp_path):
    assert cgroup_cpu_quota(tmp_path) is None and cgroup_memory_left(tmp_path) is None
    assert usable_cpus(tmp_path) >= 1
