"""Reading a model folder's files without loading tensors: config, weight files, headers.

Shared by the loader (checks before every load) and the model store (checks on import). No MLX.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"

_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors header."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def check_safetensors(path: Path) -> dict[str, TensorInfo]:
    """Validate a safetensors file from its header alone; return ``{name: TensorInfo}``.

    Checks that the header parses, every tensor's byte range matches its dtype and shape, and the
    file holds all the bytes the header promises. Reads only the header, so it is cheap enough to
    run before every load. Raises ``ModelLoadError`` (one line, naming the file) otherwise.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ModelLoadError(
                    f"{path}: truncated safetensors file ({size} bytes, no header)"
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise ModelLoadError(f"{path}: corrupt or truncated safetensors header")
            raw = handle.read(header_len)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: corrupt safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors header (not a JSON object)")
    available = size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = (
                entry["dtype"],
                tuple(int(d) for d in entry["shape"]),
                entry["data_offsets"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{path}: corrupt safetensors entry for {name!r}") from exc
        if dtype not in _DTYPE_BYTES:
            raise ModelLoadError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if end - begin != math.prod(shape) * _DTYPE_BYTES[dtype] or begin < 0:
            raise ModelLoadError(
                f"{path}: tensor {name!r} byte range does not match its shape {list(shape)}"
            )
        if end > available:
            raise ModelLoadError(
                f"{path}: truncated safetensors file "
                f"(tensor {name!r} needs {end} data bytes, file has {available})"
            )
        tensors[name] = TensorInfo(dtype, shape)
    return tensors


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: the index's shards, else every ``*.safetensors``.

    Raises ``ModelLoadError`` when there are none or the index names a missing shard.
    """
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index}: corrupt safetensors index") from exc
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shard {missing[0]} named in {INDEX_FILE} is missing")
        return [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{folder}: no .safetensors weights (PyTorch .bin checkpoints are not supported)"
        )
    return files


def read_config(folder: Path) -> dict[str, Any]:
    """``config.json`` of a model folder; ``ModelLoadError`` if missing, unreadable or lacking
    ``model_type``."""
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: not a model folder (no config.json)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: unreadable config ({exc})") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelLoadError(f"{path}: config has no model_type")
    return config
