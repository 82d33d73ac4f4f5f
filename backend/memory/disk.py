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

The tier is an optimization, so it is one fault boundary: no call here raises for a fault of
the disk (a full disk, a read-only mount, a directory it may not write, a corrupt index, I/O
errors). Instead the store degrades and says why once (``mode``, ``note``; one log line per
kind of failure and one when it first stores again, per process, however often a nearly full
disk makes it flap):

* ``"on"``: reads and writes.
* ``"read-only"``: stored states are read; nothing new is stored. Another process holds the
  writer lock (for this process's life), or writes failed: then every write call retries with
  a back-off (``RetryPolicy``) and the tier is ``"on"`` again once the disk takes writes.
  Deletes that could not run are kept and done then (and a ``clear`` too).
* ``"off"``: not even the index can be read (start-up found no usable directory); retried the
  same way.

A corrupt index (``database disk image is malformed``, ``file is not a database``) is moved
aside as ``index.sqlite3.corrupt-<time>`` (never deleted) and a fresh one started. At start-up
the writer removes leftover temporaries, files without an index row and rows without a file.

Every file-system and SQLite call goes through ``DiskIO`` (and the connection it opens), the
seam where tests inject faults call by call.

Tensor names in a file are ``"<layer>.<array>"``; the safetensors metadata holds the per-layer
record metadata as JSON.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sqlite3
import struct
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import numpy as np
from safetensors.numpy import save as save_safetensors

from backend.memory.records import LayerRecords, SnapshotRecord

try:  # POSIX advisory locks; on other platforms the disk tier is single-process
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
INDEX_NAME = "index.sqlite3"

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

DiskMode = Literal["on", "read-only", "off"]
# What can go wrong with the disk itself (sqlite3.Error covers the index, OSError the files).
DISK_FAULTS = (OSError, sqlite3.Error)


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


@dataclass(frozen=True)
class RetryPolicy:
    """How soon a degraded tier tries to write again: after ``first_s``, then doubling up to
    ``most_s`` while the disk keeps failing."""

    first_s: float = 1.0
    most_s: float = 60.0


def new_node_id() -> str:
    return uuid.uuid4().hex


class DiskIO:
    """Every file-system and SQLite call the disk tier makes. The store uses only ``execute``,
    ``executemany``, ``commit`` and ``close`` of the connections ``connect`` opens."""

    def connect(self, database: str, uri: bool = False) -> sqlite3.Connection:
        return sqlite3.connect(database, uri=uri, check_same_thread=False)

    def mkdir(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)

    def open_lock(self, path: Path):
        return open(path, "a+b")

    def write_file(self, path: Path, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)

    def replace(self, source: Path, target: Path) -> None:
        os.replace(source, target)

    def read_file(self, path: Path) -> bytes:
        return path.read_bytes()

    def unlink(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def listdir(self, path: Path) -> list[Path]:
        return list(path.iterdir())


class DiskStore:
    """See the module docstring. Not thread-safe: one engine thread uses it."""

    def __init__(self, root: Path, fingerprint: str, io: DiskIO | None = None,
                 retry: RetryPolicy = RetryPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dir = Path(root) / fingerprint
        self.files = self.dir / "nodes"
        self.index = self.dir / INDEX_NAME
        self.io = io or DiskIO()
        self.mode: DiskMode = "off"
        self.note = ""  # why the tier is not "on" (one line), "" when it is
        self._retry = retry
        self._clock = clock
        self._db: sqlite3.Connection | None = None
        self._lock_file = None
        self._other_writer = False  # another process holds the lock: read-only for good
        self._rows: list[IndexRow] = []
        self._readable = False  # an index was read: what it names can be read from the files
        self._logged: set[str] = set()  # kinds of failure (and 'back') logged: once each
        self._retry_at = 0.0
        self._backoff = retry.first_s
        self._pending_deletes: set[str] = set()
        self._pending_clear = False
        self._recovering = False
        self._moved_aside = False  # a corrupt index was replaced by a fresh one
        self._start()

    @property
    def read_only(self) -> bool:
        """True while nothing new can be stored (``mode`` is not "on")."""
        return self.mode != "on"

    # -- start-up --------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._become_writer():
            self._rows = self._read_rows() if self._db is not None else []
            if self.mode == "on":
                self._tidy()
            return
        self._open_reader()
        if self.mode == "off":
            return
        self._rows = self._read_rows()

    def _become_writer(self) -> bool:
        """Take the writer lock and open the index for writing; False (and a note) when this
        process cannot write now. A corrupt index is moved aside and started afresh."""
        try:
            self.io.mkdir(self.files)
            if self._lock_file is None:
                self._lock_file = self.io.open_lock(self.dir / "writer.lock")
            if not _try_lock(self._lock_file):
                self._other_writer = True
                self._degrade("read-only", "locked",
                              "another Arbor process is writing this cache; this one only reads it")
                return False
        except DISK_FAULTS as exc:
            self._fail(exc, "opening the cache dir")
            return False
        for attempt in range(2):
            try:
                self._db = self._open_writer_db()
                self._set_on()
                self._readable = True
                return True
            except DISK_FAULTS as exc:
                self._close_db()
                if attempt == 0 and _is_corrupt(exc):
                    if self._move_index_aside(exc):
                        continue
                    return False
                self._fail(exc, "opening the index")
                return False
        return False  # pragma: no cover - the loop returns

    def _open_writer_db(self) -> sqlite3.Connection:
        db = self.io.connect(str(self.index))
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(_SCHEMA)
            db.commit()
            db.execute("SELECT COUNT(*) FROM nodes").fetchall()  # the pages really read
        except BaseException:
            db.close()
            raise
        return db

    def _open_reader(self) -> None:
        """The index read-only (another writer, or this process cannot write): reads still
        serve. A WAL index on a read-only mount opens only as immutable."""
        try:
            exists = self.index.stat().st_size > 0  # an empty file: a store never written
        except FileNotFoundError:
            exists = False
        except OSError:
            exists = True  # let the connection say what is wrong
        if not exists:
            self.mode = "read-only" if self._other_writer else "off"
            return
        flavours = ["mode=ro"] if self._other_writer else ["mode=ro", "mode=ro&immutable=1"]
        last: BaseException | None = None
        for flavour in flavours:
            try:
                db = self.io.connect(f"file:{self.index}?{flavour}", uri=True)
                try:
                    db.execute("SELECT COUNT(*) FROM nodes").fetchall()
                except BaseException:
                    db.close()
                    raise
                self._db = db
                self._readable = True
                if self.mode == "off":
                    self.mode = "read-only"
                return
            except DISK_FAULTS as exc:
                if "no such table" in str(exc):
                    return  # an index never written: nothing to read, nothing wrong
                last = exc
        self._log_once("unreadable", f"prefix cache: the index {self.index} cannot be read "
                                     f"({_describe(last)}); the disk tier serves nothing")
        if not self._other_writer:
            self.mode = "off"

    def _read_rows(self) -> list[IndexRow]:
        try:
            return [IndexRow(node_id, parent, int(start),
                             np.frombuffer(tokens, dtype="<i4").tolist(),
                             tuple(c == "1" for c in layers),
                             DiskEntry(node_id, int(nbytes), int(crc)), int(last_used))
                    for node_id, parent, start, tokens, layers, nbytes, crc, last_used
                    in self._db.execute("SELECT id, parent, start, tokens, layers, nbytes, crc, "
                                        "last_used FROM nodes").fetchall()]
        except DISK_FAULTS as exc:
            if self.mode == "on" and _is_corrupt(exc) and self._move_index_aside(exc):
                try:
                    self._db = self._open_writer_db()
                    return []
                except DISK_FAULTS as again:
                    self._close_db()
                    self._fail(again, "opening a fresh index")
                    return []
            self._fail(exc, "reading the index")
            return []

    def _move_index_aside(self, exc: BaseException) -> bool:
        """Rename a corrupt index (and its -wal / -shm) out of the way, with a timestamp."""
        self._close_db()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.dir / f"{INDEX_NAME}.corrupt-{stamp}"
        try:
            for suffix in ("", "-wal", "-shm"):
                source = self.dir / (INDEX_NAME + suffix)
                if source.exists():
                    self.io.replace(source, aside.with_name(aside.name + suffix))
        except DISK_FAULTS as again:
            self._fail(again, "moving a corrupt index aside")
            return False
        message = (f"the index was corrupt ({_describe(exc)}); moved aside to {aside.name}, "
                   f"started afresh")
        self._log_once("corrupt", f"prefix cache: {message}")
        self._moved_aside = True
        return True

    def _tidy(self) -> None:
        """Start-up clean-up by the writer: temporaries, files without a row, rows without a
        file (their states recompute)."""
        try:
            known = {row.node_id for row in self._rows}
            present, strays = set(), 0
            for path in self.io.listdir(self.files):
                if path.suffix == ".safetensors" and path.stem in known:
                    present.add(path.stem)
                else:
                    strays += path.suffix == ".safetensors"  # temporaries are routine
                    self.io.unlink(path)
            missing = known - present
            if missing:
                self._rows = [row for row in self._rows if row.node_id in present]
                for node_id in missing:
                    self.delete(node_id)
            if missing or (strays and not self._moved_aside):  # that line said it already
                log.warning("prefix cache: %d stored states had no file and %d files no index "
                            "row at %s; both dropped (they recompute)", len(missing), strays,
                            self.dir)
        except DISK_FAULTS as exc:
            self._fail(exc, "cleaning up at start-up")

    # -- index -----------------------------------------------------------------------------------
    def load_index(self) -> list[IndexRow]:
        """The rows stored when this store opened."""
        return list(self._rows)

    def set_parent(self, node_id: str, parent_id: str | None) -> None:
        self._write_sql([("UPDATE nodes SET parent = ? WHERE id = ?", (parent_id, node_id))],
                        "re-parenting a stored node")

    def touch(self, stamps: list[tuple[int, str]]) -> None:
        """Record recency (``(last_used, node id)`` pairs) so a restart keeps the LRU order."""
        if stamps and self._writable():
            try:
                self._db.executemany("UPDATE nodes SET last_used = ? WHERE id = ?", stamps)
                self._db.commit()
                self._succeeded()
            except DISK_FAULTS as exc:
                self._fail(exc, "stamping recency")

    # -- files -----------------------------------------------------------------------------------
    def path(self, node_id: str) -> Path:
        return self.files / f"{node_id}.safetensors"

    def write(self, node_id: str, parent_id: str | None, start: int, tokens: list[int],
              records: LayerRecords, last_used: int) -> DiskEntry | None:
        """Store a node's records; None when nothing can be stored now or the write failed."""
        if not self._writable():
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
        entry = DiskEntry(node_id, len(data), zlib.crc32(data))
        placed = False
        try:
            self.io.write_file(tmp, data)
            self.io.replace(tmp, final)
            placed = True
            self._db.execute(
                "INSERT OR REPLACE INTO nodes "
                "(id, parent, start, tokens, layers, nbytes, crc, last_used) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (node_id, parent_id, start, np.asarray(tokens, dtype="<i4").tobytes(),
                 "".join("0" if r is None else "1" for r in records),
                 entry.nbytes, entry.crc, last_used))
            self._db.commit()
        except DISK_FAULTS as exc:
            self._fail(exc, f"writing {final.name}")
            self._discard(final if placed else tmp)
            return None
        self._succeeded()
        return entry

    def read(self, entry: DiskEntry, layers: int) -> LayerRecords | None:
        """The node's records, or None if the file is missing, torn or corrupt."""
        try:
            data = self.io.read_file(self.path(entry.node_id))
        except FileNotFoundError:
            return None
        except DISK_FAULTS as exc:
            self._log_once("read", f"prefix cache: cannot read {entry.node_id} "
                                   f"({_describe(exc)}); recomputing")
            return None
        if len(data) != entry.nbytes or zlib.crc32(data) != entry.crc:
            log.warning("prefix cache: %s failed its checksum; recomputing", entry.node_id)
            return None
        try:
            header, tensors = _safetensors_views(data)
            metas = json.loads(header["layers"])
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            log.warning("prefix cache: %s unreadable (%s); recomputing", entry.node_id, exc)
            return None
        if len(metas) != layers:
            return None
        by_layer: dict[str, dict[str, np.ndarray]] = {}  # "<layer>.<array>", grouped once
        for name, view in tensors.items():
            layer, _, array_name = name.partition(".")
            by_layer.setdefault(layer, {})[array_name] = view
        return [None if meta is None else SnapshotRecord(meta, by_layer.get(str(j), {}))
                for j, meta in enumerate(metas)]

    def delete(self, node_id: str) -> None:
        """Forget a stored node (row, then file). While the tier cannot write, the delete waits
        for it (a read-only second process never deletes)."""
        if self._other_writer:
            return
        if not self._writable():
            self._pending_deletes.add(node_id)
            return
        try:
            self._db.execute("DELETE FROM nodes WHERE id = ?", (node_id,))
            self._db.commit()
            self.io.unlink(self.path(node_id))
            self._pending_deletes.discard(node_id)
            self._succeeded()
        except DISK_FAULTS as exc:
            self._pending_deletes.add(node_id)
            self._fail(exc, "deleting a stored node")

    def clear(self) -> None:
        if self._other_writer:
            return
        self._pending_clear = True
        if not self._writable():
            return
        try:
            self._db.execute("DELETE FROM nodes")
            self._db.commit()
            for path in self.io.listdir(self.files):
                self.io.unlink(path)
            self._pending_clear = False
            self._pending_deletes.clear()
            self._succeeded()
        except DISK_FAULTS as exc:
            self._fail(exc, "clearing the disk tier")

    def close(self) -> None:
        self._close_db()
        if self._lock_file is not None:
            try:
                self._lock_file.close()  # releases the writer lock
            except OSError:
                pass
            self._lock_file = None

    # -- the fault boundary ----------------------------------------------------------------------
    def writable(self) -> bool:
        """Can a write go through now? (Past its back-off, a degraded tier tries again here.)"""
        return self._writable()

    @property
    def retrying(self) -> bool:
        """Degraded by a fault of the disk, and trying again from time to time (not the read-only
        second process, which never writes)."""
        return self.mode != "on" and not self._other_writer

    def _writable(self) -> bool:
        """True when a write may go ahead now; past a back-off, a degraded tier tries again."""
        if self.mode == "on":
            return True
        if self._other_writer or self._clock() < self._retry_at:
            return False
        self._close_db()
        if not self._become_writer():
            return False
        self._recovering = True  # declared recovered once a write goes through (_succeeded)
        if self._pending_clear:
            self.clear()
        for node_id in sorted(self._pending_deletes):
            if self.mode == "on":
                self.delete(node_id)
        return self.mode == "on"

    def _succeeded(self) -> None:
        """A write went through: a tier that was retrying is back for good."""
        if self._recovering:
            self._recovering = False
            self._backoff = self._retry.first_s
            self._log_once("back", f"prefix cache: the disk tier at {self.dir} stores states "
                                   f"again")

    def _write_sql(self, statements: list[tuple[str, tuple]], what: str) -> None:
        if not self._writable():
            return
        try:
            for sql, params in statements:
                self._db.execute(sql, params)
            self._db.commit()
            self._succeeded()
        except DISK_FAULTS as exc:
            self._fail(exc, what)

    def _fail(self, exc: BaseException, what: str) -> None:
        """A fault of the disk: log it once per kind, stop writing, retry after a back-off."""
        kind = _fault_kind(exc)
        note = f"{_KIND_NOTES.get(kind, 'the disk failed')} ({what}: {_describe(exc)})"
        self._degrade("read-only" if self._readable else "off", kind, note)
        if _is_corrupt(exc) and self._db is not None:
            self._close_db()  # the retry moves the corrupt index aside and starts afresh
        self._retry_at = self._clock() + self._backoff
        self._backoff = min(self._backoff * 2, self._retry.most_s)

    def _degrade(self, mode: DiskMode, kind: str, note: str) -> None:
        self.mode = mode
        self.note = note
        self._log_once(kind, f"prefix cache: disk tier {mode} at {self.dir}: {note}")

    def _set_on(self) -> None:
        self.mode = "on"
        self.note = ""

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("%s", message)

    def _discard(self, path: Path) -> None:
        try:
            self.io.unlink(path)
        except DISK_FAULTS:
            pass  # a stray file: the next start-up removes it

    def _close_db(self) -> None:
        if self._db is not None:
            try:
                self._db.close()
            except DISK_FAULTS:
                pass
            self._db = None


_KIND_NOTES = {
    "full": "the disk is full; new states are not stored until it has room",
    "read-only": "the cache dir is on a read-only file system; new states are not stored",
    "permission": "the cache dir is not writable; new states are not stored",
    "corrupt": "the index is corrupt; it is moved aside at the next try",
    "io": "the disk failed; new states are not stored",
}


def _fault_kind(exc: BaseException) -> str:
    if _is_corrupt(exc):
        return "corrupt"
    text = str(exc).lower()
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT) or "full" in text:
        return "full"
    if code == errno.EROFS or "readonly" in text or "read-only" in text:
        return "read-only"
    if code in (errno.EACCES, errno.EPERM) or isinstance(exc, PermissionError):
        return "permission"
    return "io"


def _is_corrupt(exc: BaseException) -> bool:
    """SQLite's own word that the index file is damaged (not that the disk refused a write)."""
    return isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError)


def _describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}" if exc is not None else "unknown"


def _try_lock(f) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


#: The safetensors dtypes the cache writes (numpy has no bfloat16: it travels as uint16 bits).
_SAFETENSORS_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I32": "<i4", "I64": "<i8",
                       "U16": "<u2", "I16": "<i2", "U8": "u1", "I8": "i1", "U32": "<u4"}


def _safetensors_views(data: bytes) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """A safetensors file's metadata and its tensors as read-only views into ``data`` (no
    copies: a restore copies each once, into the MLX array it becomes). Every offset and size is
    checked against the file, so a damaged file raises ``ValueError``."""
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise ValueError("header longer than the file")
    header = json.loads(data[8:8 + size])
    body = memoryview(data)[8 + size:]
    tensors: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
        shape = tuple(int(n) for n in info["shape"])
        lo, hi = (int(n) for n in info["data_offsets"])
        if not 0 <= lo <= hi <= len(body) or hi - lo != dtype.itemsize * math.prod(shape):
            raise ValueError(f"tensor {name} lies outside the file")
        tensors[name] = np.frombuffer(body[lo:hi], dtype=dtype).reshape(shape)
    return header.get("__metadata__", {}), tensors
