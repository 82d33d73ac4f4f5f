"""Snapshot records: a cache snapshot as plain numpy arrays plus metadata (the host-tier form).

A cache kind turns one of its snapshots into a ``SnapshotRecord`` (``Cache.export_snapshot``) and
back (``Cache.import_snapshot``); the tiers below the device only ever see records, so
``backend/memory`` needs no MLX. ``meta`` holds small JSON-able values (kind, start, end, dtypes);
``arrays`` hold compact, owned copies. Exporting and importing are exact (bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class SnapshotRecord:
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())

    def sliced(self, name: str, axis: int, lo: int, hi: int) -> np.ndarray:
        """A compact copy of ``arrays[name][lo:hi]`` along ``axis``."""
        index = [slice(None)] * self.arrays[name].ndim
        index[axis] = slice(lo, hi)
        return np.ascontiguousarray(self.arrays[name][tuple(index)])


LayerRecords = list["SnapshotRecord | None"]


def records_nbytes(records: LayerRecords) -> int:
    return sum(r.nbytes for r in records if r is not None)
