"""The prefix cache's tier budgets as an app setting (MiB per tier), and their defaults.

Stored under ``CACHE_BUDGETS_KEY`` as ``{"device": MiB, "host": MiB, "disk": MiB}``; a missing or
unreadable value means the machine's defaults (``backend.memory.budgets.CacheBudgets.defaults``).
No MLX here: the budgets module is plain Python.
"""

from __future__ import annotations

from typing import Any

from backend.memory.budgets import MIB, CacheBudgets
from backend.paths import cache_dir

CACHE_BUDGETS_KEY = "cache_budgets_mb"
TIERS = ("device", "host", "disk")


def default_budgets() -> CacheBudgets:
    return CacheBudgets.defaults(cache_dir())


def stored_budgets(store: Any) -> CacheBudgets:
    """The budgets the user chose (tiers they did not set keep the defaults)."""
    value = store.app_setting(CACHE_BUDGETS_KEY, {})
    defaults = default_budgets()
    if not isinstance(value, dict):
        return defaults
    mb = {t: value[t] for t in TIERS
          if isinstance(value.get(t), int) and not isinstance(value.get(t), bool) and value[t] >= 0}
    return defaults.with_mb(mb.get("device"), mb.get("host"), mb.get("disk"))


def save_budgets(store: Any, budgets: CacheBudgets) -> None:
    store.set_app_setting(CACHE_BUDGETS_KEY, {
        "device": budgets.device_bytes // MIB, "host": budgets.host_bytes // MIB,
        "disk": budgets.disk_bytes // MIB})
