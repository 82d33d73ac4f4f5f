"""The prefix cache's tier budgets as an app setting (MiB per tier), and their defaults.

Stored under ``CACHE_BUDGETS_KEY`` as ``{"device": MiB, "host": MiB, "disk": MiB}``. The first
read writes the machine's defaults there (``backend.memory.budgets.CacheBudgets.defaults``) for
any tier that has no readable value: the disk default follows the free space, and a budget that
moved with it at every start would disagree with what the engine was given. They are derived
again only when the user asks ("Restore defaults"). No MLX here: the budgets module is plain
Python.
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
    """The budgets in use: the user's, else the defaults written on first use (see the module
    docstring)."""
    value = store.app_setting(CACHE_BUDGETS_KEY, {})
    value = value if isinstance(value, dict) else {}
    mb = {t: value[t] for t in TIERS
          if isinstance(value.get(t), int) and not isinstance(value.get(t), bool) and value[t] >= 0}
    if len(mb) == len(TIERS):
        return CacheBudgets(mb["device"] * MIB, mb["host"] * MIB, mb["disk"] * MIB)
    budgets = default_budgets().with_mb(mb.get("device"), mb.get("host"), mb.get("disk"))
    save_budgets(store, budgets)  # fixed from now on
    return budgets


def save_budgets(store: Any, budgets: CacheBudgets) -> None:
    store.set_app_setting(CACHE_BUDGETS_KEY, {
        "device": budgets.device_bytes // MIB, "host": budgets.host_bytes // MIB,
        "disk": budgets.disk_bytes // MIB})
