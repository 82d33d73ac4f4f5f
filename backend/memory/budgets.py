"""Byte budgets of the prefix cache's tiers, and their defaults from this machine.

Defaults: device 1/16 of physical memory (256 MiB .. 4 GiB), host 1/8 (512 MiB .. 8 GiB), disk a
tenth of the free space where the cache lives (1 GiB .. 32 GiB). On Apple silicon device and
host memory are the same RAM; the split still matters there (MLX arrays count against MLX's
memory limit, numpy copies do not) and it keeps the numbers the same on every platform.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 1 << 20


def physical_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - exotic platforms
        return 8 << 30


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


@dataclass(frozen=True)
class CacheBudgets:
    """Most bytes each tier may hold (0 disables a tier)."""

    device_bytes: int
    host_bytes: int
    disk_bytes: int

    @classmethod
    def defaults(cls, cache_dir: Path | None = None) -> "CacheBudgets":
        ram = physical_memory_bytes()
        free = _free_disk_bytes(cache_dir)
        return cls(device_bytes=_clamp(ram // 16, 256 * MIB, 4096 * MIB),
                   host_bytes=_clamp(ram // 8, 512 * MIB, 8192 * MIB),
                   disk_bytes=_clamp(free // 10, 1024 * MIB, 32768 * MIB))

    def with_mb(self, device: int | None = None, host: int | None = None,
                disk: int | None = None) -> "CacheBudgets":
        """These budgets with the given tiers replaced (in MiB; None keeps the current one)."""
        return CacheBudgets(
            self.device_bytes if device is None else int(device) * MIB,
            self.host_bytes if host is None else int(host) * MIB,
            self.disk_bytes if disk is None else int(disk) * MIB)

    def describe(self) -> str:
        return (f"device {self.device_bytes // MIB} MiB, host {self.host_bytes // MIB} MiB, "
                f"disk {self.disk_bytes // MIB} MiB")


def _free_disk_bytes(path: Path | None) -> int:
    probe = Path(path) if path is not None else Path.home()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return 10 << 30


@dataclass(frozen=True)
class CacheConfig:
    """How an engine's prefix cache is set up. ``directory`` None: no disk tier.
    ``disk_retry``: how soon a disk tier that failed tries again (``disk.RetryPolicy``; None:
    its default); ``disk_io``: the disk tier's file and SQLite calls (``disk.DiskIO``; tests
    inject faults there)."""

    budgets: CacheBudgets
    directory: Path | None
    capture_interval: int = 4096  # a prefill capture every this many tokens
    pre_end: int = 4  # and this many tokens before the end of each prompt
    disk_retry: Any = None
    disk_io: Any = None

    @classmethod
    def default(cls, device_mb: int | None = None, host_mb: int | None = None,
                disk_mb: int | None = None, directory: Path | None = None) -> "CacheConfig":
        """The machine's default budgets (any of them overridden, in MiB) under the platform
        cache dir (``backend.paths.cache_dir()``) unless ``directory`` is given."""
        from backend.paths import cache_dir

        directory = Path(directory) if directory is not None else cache_dir() / "prefix-cache"
        budgets = CacheBudgets.defaults(directory).with_mb(device_mb, host_mb, disk_mb)
        return cls(budgets, directory)

    @classmethod
    def memory_only(cls, device_mb: int = 1024, host_mb: int = 0) -> "CacheConfig":
        return cls(CacheBudgets(device_mb * MIB, host_mb * MIB, 0), None)
