"""The disk tier: one safetensors file per trie node plus a SQLite index, per model fingerprint.

Layout under the cache root (the platform cache dir unless configured)::

    <root>/<fingerprint>/index.sqlite3        one row per stored node (structure + file + crc)
    <root>/<fingerprint>/nodes/<id>.safetensors
    <root>/<fingerprint>/writer.lock          held (flock) by the one process that may write

* The fingerprint names the model, its compute dtype and the cache format version, so one
  model's states are never restored into another.
* Files are written to a temporary name and renamed into place; the index row is written after
  the rename, and deleted before the file. A file's CRC-32 is checked on every read: a torn,
  truncated, bit-flipped or missing file reads as ``None`` and the caller recomputes.
* Two processes may share a data dir: the first to take ``writer.lock`` writes; any other opens
  the index read-only (it sees what was stored when it started, and a file deleted since then
  reads as missing). Nothing here is ever corrupted by the second process.

Tensor names in a file are ``"<layer>.<array>"``; the safetensors metadata holds the per-layer
record metadata as JSON.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from backend.memory.records import LayerRecords, SnapshotRecord

try:  # POSIX advisory locks; on other platforms the disk tier is single-process
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    id TEXT PRIMARY KEY,
    parent TEXT,            -- NULL: a child of the root
    start INTEGER NOT NULL,
    tokens BLOB NOT NULL,   -- int32 little-endian token ids of the edge
    layers TEXT NOT NULL,   -- one '1'/'0' per cache layer: has a snapshot at this node
    nbytes INTEGER NOT NULL,
    crc INTEGER NOT NULL,
    last_used INTEGER NOT NULL
)
"""


@dataclass(frozen=True)
class DiskEntry:
    """Where a node's records are: the file and what it must hash to."""

    node_id: str
    nbytes: int
    crc: int


@dataclass(frozen=True)
class IndexRow:
    node_id: str
    parent_id: str | None
    start: int
    tokens: list[int]
    layers: tuple[bool, ...]
    entry: DiskEntry
    last_used: int


def new_node_id() -> str:
    return uuid.uuid4().hex


class DiskStore:
    """See the module docstring. Not thread-safe: one engine thread uses it."""

    def __init__(self, root: Path, fingerprint: str) -> None:
        self.dir = Path(root) / fingerprint
        self.files = self.dir / "nodes"
        self.files.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.dir / "writer.lock", "a+b")
        self.read_only = not _try_lock(self._lock_file)
        index = self.dir / "index.sqlite3"
        if self.read_only:
            uri = f"file:{index}?mode=ro"
            try:
                self._db = sqlite3.connect(uri, uri=True, check_same_thread=False)
                self._db.execute("SELECT 1 FROM nodes LIMIT 1")
            except sqlite3.Error:
                self._db = sqlite3.connect(":memory:", check_same_thread=False)
                self._db.execute(_SCHEMA)
        else:
            self._db = sqlite3.connect(index, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(_SCHEMA)
            self._db.commit()
            self._remove_stray_files()

    # -- index -----------------------------------------------------------------------------------
    def load_index(self) -> list[IndexRow]:
        rows = []
        for node_id, parent, start, tokens, layers, nbytes, crc, last_used in self._db.execute(
                "SELECT id, parent, start, tokens, layers, nbytes, crc, last_used FROM nodes"):
            rows.append(IndexRow(node_id, parent, int(start),
                                 np.frombuffer(tokens, dtype="<i4").tolist(),
                                 tuple(c == "1" for c in layers),
                                 DiskEntry(node_id, int(nbytes), int(crc)), int(last_used)))
        return rows

    def set_parent(self, node_id: str, parent_id: str | None) -> None:
        if not self.read_only:
            self._db.execute("UPDATE nodes SET parent = ? WHERE id = ?", (parent_id, node_id))
            self._db.commit()

    def touch(self, stamps: list[tuple[int, str]]) -> None:
        """Record recency (``(last_used, node id)`` pairs) so a restart keeps the LRU order."""
        if not self.read_only and stamps:
            self._db.executemany("UPDATE nodes SET last_used = ? WHERE id = ?", stamps)
            self._db.commit()

    # -- files -----------------------------------------------------------------------------------
    def path(self, node_id: str) -> Path:
        return self.files / f"{node_id}.safetensors"

    def write(self, node_id: str, parent_id: str | None, start: int, tokens: list[int],
              records: LayerRecords, last_used: int) -> DiskEntry | None:
        """Store a node's records; None when this process may not write or the write failed."""
        if self.read_only:
            return None
        tensors: dict[str, np.ndarray] = {}
        metas = []
        for j, record in enumerate(records):
            metas.append(None if record is None else record.meta)
            if record is not None:
                for name, array in record.arrays.items():
                    tensors[f"{j}.{name}"] = np.ascontiguousarray(array)
        header = {"format": str(FORMAT_VERSION), "layers": json.dumps(metas),
                  "start": str(start), "end": str(start + len(tokens))}
        data = save_safetensors(tensors, metadata=header)
        final = self.path(node_id)
        tmp = final.with_suffix(f".tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, final)
        except OSError as exc:
            log.warning("prefix cache: cannot write %s: %s", final, exc)
            tmp.unlink(missing_ok=True)
            return None
        entry = DiskEntry(node_id, len(data), zlib.crc32(data))
        self._db.execute(
            "INSERT OR REPLACE INTO nodes "
            "(id, parent, start, tokens, layers, nbytes, crc, last_used) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (node_id, parent_id, start, np.asarray(tokens, dtype="<i4").tobytes(),
             "".join("0" if r is None else "1" for r in records),
             entry.nbytes, entry.crc, last_used))
        self._db.commit()
        return entry

    def read(self, entry: DiskEntry, layers: int) -> LayerRecords | None:
        """The node's records, or None if the file is missing, torn or corrupt."""
        try:
            data = self.path(entry.node_id).read_bytes()
        except OSError:
            return None
        if len(data) != entry.nbytes or zlib.crc32(data) != entry.crc:
            log.warning("prefix cache: %s failed its checksum; recomputing", entry.node_id)
            return None
        try:
            metas = json.loads(_safetensors_metadata(data)["layers"])
            tensors = load_safetensors(data)
        except (ValueError, KeyError, TypeError, struct.error, SafetensorError) as exc:
            log.warning("prefix cache: %s unreadable (%s); recomputing", entry.node_id, exc)
            return None
        if len(metas) != layers:
            return None
        records: LayerRecords = []
        for j, meta in enumerate(metas):
            if meta is None:
                records.append(None)
                continue
            prefix = f"{j}."
            arrays = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            records.append(SnapshotRecord(meta, arrays))
        return records

    def delete(self, node_id: str) -> None:
        if self.read_only:
            return
        self._db.execute("DELETE FROM nodes WHERE id = ?", (node_id,))
        self._db.commit()
        self.path(node_id).unlink(missing_ok=True)

    def clear(self) -> None:
        if self.read_only:
            return
        self._db.execute("DELETE FROM nodes")
        self._db.commit()
        self._remove_stray_files()

    def close(self) -> None:
        try:
            self._db.close()
        finally:
            self._lock_file.close()  # releases the writer lock

    def _remove_stray_files(self) -> None:
        """Files without an index row (a crash between rename and insert, or temporaries)."""
        known = {row[0] for row in self._db.execute("SELECT id FROM nodes")}
        for path in self.files.iterdir():
            if path.suffix != ".safetensors" or path.stem not in known:
                path.unlink(missing_ok=True)


def _try_lock(f) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise ValueError("header longer than the file")
    return json.loads(data[8:8 + size]).get("__metadata__", {})
