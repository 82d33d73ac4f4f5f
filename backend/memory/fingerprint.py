"""The model fingerprint that keys the disk tier: a stored state is only ever restored into the
same weights, computed the same way.

It hashes the config, every weight file's bytes, the compute dtype, the compute path (native
kernels or plain MLX, whose numerics differ) and the cache format version. Hashing a model's
weights takes a while (~1 GB/s), so each file's digest is remembered in ``hashes.json`` next to
the cache, keyed by its path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from backend.memory.disk import FORMAT_VERSION

_CHUNK = 1 << 22


def file_digest(path: Path, memo: dict[str, str]) -> str:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    if key not in memo:
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        memo[key] = h.hexdigest()
    return memo[key]


def model_fingerprint(folder: Path, weight_files: list[Path], dtype: str, compute: str,
                      memo_file: Path | None = None) -> str:
    """A short hex name for (weights, config, dtype, compute path, cache format)."""
    memo: dict[str, str] = {}
    if memo_file is not None:
        try:
            memo = json.loads(memo_file.read_text())
        except (OSError, ValueError):
            memo = {}
        if not isinstance(memo, dict):
            memo = {}
    h = hashlib.blake2b(digest_size=12)
    config = Path(folder) / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(weight_files):
        h.update(path.name.encode() + b"\0" + file_digest(path, memo).encode())
    h.update(f"|{dtype}|{compute}|v{FORMAT_VERSION}".encode())
    if memo_file is not None:
        _save_memo(memo_file, memo)
    return h.hexdigest()


def _save_memo(memo_file: Path, memo: dict[str, str]) -> None:
    """Write the digests atomically; the memo is only a shortcut, so a disk that refuses it
    costs a re-hash next time, never a failure. Temporaries a killed process left are removed."""
    tmp = memo_file.with_suffix(f".tmp-{os.getpid()}")
    try:
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(memo_file.parent, memo_file.stem)
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_file)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def remove_stale_temporaries(folder: Path, stem: str) -> None:
    """Remove ``<stem>.tmp-<pid>`` files whose process is gone (one that is still running may
    be writing its own)."""
    for path in folder.glob(f"{stem}.tmp-*"):
        pid = path.suffix.removeprefix(".tmp-")
        if not pid.isdigit() or not _process_alive(int(pid)):
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True
