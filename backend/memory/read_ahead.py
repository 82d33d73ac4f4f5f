"""Reading disk-tier files ahead of the restore that needs them, on a background thread.

A request waiting in the engine's queue (the batch is full) will restore its stored prefix when
it joins; the files of that prefix that only the disk holds can be read meanwhile, while the
running requests decode, so joining costs the import into the caches and not the disk. Reading
and checking a file (``DiskStore.read``: bytes, CRC, safetensors views) touches no shared
state, so it runs on one reader thread; the trie and the tiers stay on the engine's thread,
which takes a finished read with ``take`` (or waits for one under way).

A read is keyed by the node id and the ``DiskEntry`` it read: a file rewritten or dropped since
is never taken. Reads not taken are dropped by ``discard`` (the engine calls it when idle).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from backend.memory.disk import DiskEntry, DiskStore
from backend.memory.records import LayerRecords

#: ``take``'s answer when no read of that entry was started.
NOT_READ = object()


class ReadAhead:
    def __init__(self, disk: DiskStore, layers: int) -> None:
        self._disk = disk
        self._layers = layers
        self._reader: ThreadPoolExecutor | None = None  # started at the first read
        self._reads: dict[str, tuple[DiskEntry, Future]] = {}
        self.started = 0  # reads started (tests and stats read these)
        self.taken = 0  # reads a restore used

    def start(self, node_id: str, entry: DiskEntry) -> bool:
        """Read ``entry`` in the background unless that read is already under way."""
        if node_id in self._reads and self._reads[node_id][0] == entry:
            return False
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="arbor-read-ahead")
        self._reads[node_id] = (entry, self._reader.submit(self._disk.read, entry, self._layers))
        self.started += 1
        return True

    def take(self, node_id: str, entry: DiskEntry) -> LayerRecords | None | object:
        """The records a read of ``entry`` got (waiting for it if under way; None: unreadable),
        or ``NOT_READ``."""
        read = self._reads.pop(node_id, None)
        if read is None or read[0] != entry:
            return NOT_READ
        self.taken += 1
        return read[1].result()

    def discard(self) -> None:
        for _, future in self._reads.values():
            future.cancel()
        self._reads.clear()

    def close(self) -> None:
        self.discard()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
