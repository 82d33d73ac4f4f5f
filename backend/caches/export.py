"""MLX arrays <-> numpy for snapshot records (the host and disk tiers), bit for bit.

numpy has no bfloat16, so bfloat16 arrays travel as their uint16 bit patterns with the dtype
name beside them; every other dtype maps directly. Both directions copy (a record owns its
memory, and an imported snapshot never aliases a record).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from backend.memory.records import SnapshotRecord


def to_numpy(array: mx.array) -> tuple[np.ndarray, str]:
    dtype = str(array.dtype).replace("mlx.core.", "")
    if array.dtype == mx.bfloat16:
        return np.array(array.view(mx.uint16)), dtype
    return np.array(array), dtype


def from_numpy(array: np.ndarray, dtype: str) -> mx.array:
    if dtype == "bfloat16":
        return mx.array(array).view(mx.bfloat16)
    out = mx.array(array)
    if str(out.dtype).replace("mlx.core.", "") != dtype:
        raise ValueError(f"record array is {out.dtype}, its metadata says {dtype}")
    return out


def make_record(kind: str, start: int, end: int, arrays: dict[str, mx.array],
                **meta: int) -> SnapshotRecord:
    converted = {name: to_numpy(a) for name, a in arrays.items()}
    return SnapshotRecord(
        {"kind": kind, "start": start, "end": end, **meta,
         "dtypes": {name: dtype for name, (_, dtype) in converted.items()}},
        {name: np_array for name, (np_array, _) in converted.items()})


def read_record(record: SnapshotRecord, kind: str) -> dict[str, mx.array]:
    """The record's arrays as MLX arrays, after checking it belongs to a ``kind`` cache."""
    if record.meta.get("kind") != kind:
        raise ValueError(f"a {record.meta.get('kind')!r} snapshot record cannot restore a "
                         f"{kind!r} cache")
    dtypes = record.meta["dtypes"]
    arrays = {name: from_numpy(record.arrays[name], dtypes[name]) for name in dtypes}
    mx.eval(list(arrays.values()))
    return arrays
