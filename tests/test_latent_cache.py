"""The cache contract for ``LatentCache`` (multi-head latent attention): one entry per token,
``[latent | rotary key]``, lazy snapshots, restore regimes, merge/split, schedules, records and
bytes.

Entries are *position-coded* (every latent element of position p is p, its rotary key p + 1000)
so a test reads exactly which positions a buffer or snapshot holds, in which order.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from backend.caches.kv import KVCache, KVSnapshot
from backend.caches.latent import LatentCache, LatentSnapshot
from tests.fixtures.span_caches import (
    SpanKind, active_bytes_held, check_broken_contracts_raise_with_the_values,
    check_free_copies_out_every_lazy_snapshot,
    check_lazy_snapshots_cost_nothing_until_a_write_overwrites_them,
    check_merge_and_split_keep_contents_and_laziness, check_schedule_persists_across_chunked_writes)

LATENT, ROPE = 6, 2
ENTRY_BYTES = (LATENT + ROPE) * 4


def coded(start: int, n: int, latent: int = LATENT, rope: int = ROPE,
          dtype: mx.Dtype = mx.float32) -> tuple[mx.array, mx.array]:
    p = mx.arange(start, start + n, dtype=mx.float32)[:, None]
    return (mx.broadcast_to(p, (1, 1, n, latent)).astype(dtype),
            mx.broadcast_to(p + 1000, (1, 1, n, rope)).astype(dtype))


def write(cache: LatentCache, start: int, n: int):
    return cache.update(*coded(start, n))


def positions_of(entries: mx.array) -> list[int]:
    """The positions whose entries ``entries`` holds, checking each entry is whole."""
    array = np.array(entries[0, 0])
    assert (array[:, LATENT:] == array[:, :1] + 1000).all(), "a torn entry"
    return [int(p) for p in array[:, 0]]


def test_history_is_the_entries_and_their_latent_as_views():
    cache = LatentCache(LATENT)
    write(cache, 0, 5)
    history = write(cache, 5, 3)
    assert (history.query_start, history.num_queries, history.key_start) == (5, 3, 0)
    assert history.keys.shape == (1, 1, 8, LATENT + ROPE)
    assert history.values.shape == (1, 1, 8, LATENT)
    assert positions_of(history.keys) == list(range(8))
    assert (np.array(history.values)[0, 0, :, 0] == np.arange(8)).all()
    latent = mx.random.normal((1, 1, 2, LATENT))
    rope = mx.random.normal((1, 1, 2, ROPE))
    history = cache.update(latent, rope)
    assert mx.array_equal(history.values[..., 8:, :], latent).item()
    assert mx.array_equal(history.keys[..., 8:, :], mx.concatenate([latent, rope], -1)).item()
    # One buffer of whole entries, grown in blocks: per token exactly latent + rope values.
    assert cache.arrays() == [cache.keys] and cache.values is None
    assert cache.nbytes == cache.keys.shape[2] * ENTRY_BYTES and cache.offset == 10


LATENT_KIND = SpanKind(lambda: LatentCache(LATENT), write, positions_of,
                       LatentSnapshot.entries, ENTRY_BYTES)


def test_lazy_snapshots_cost_nothing_until_a_write_overwrites_them():
    check_lazy_snapshots_cost_nothing_until_a_write_overwrites_them(LATENT_KIND)


def test_free_copies_out_every_lazy_snapshot():
    check_free_copies_out_every_lazy_snapshot(LATENT_KIND)


def test_restore_regimes():
    cache = LatentCache(LATENT)
    write(cache, 0, 12)
    own = cache.snapshot(4, 10)
    assert cache.restore(None, 6) and cache.can_rewind_to(6) and not cache.can_rewind_to(7)
    assert cache.restore(own, 10) and cache.offset == 10 and own.is_lazy  # an offset move
    assert positions_of(cache.keys[..., :10, :]) == list(range(10))

    source = LatentCache(LATENT)
    write(source, 0, 16)
    owned = source.snapshot(10, 16)
    source.free()  # now an owned copy
    target = LatentCache(LATENT)
    write(target, 0, 10)
    assert target.restore(owned, 14) and target.offset == 14
    assert positions_of(target.keys[..., :14, :]) == list(range(14))
    short = LatentCache(LATENT)
    write(short, 0, 5)
    assert short.restore(owned, 16) is False  # live cache lacks [5, 10): caller recomputes


def test_merge_and_split_keep_contents_and_laziness():
    check_merge_and_split_keep_contents_and_laziness(LATENT_KIND)


def test_schedule_persists_across_chunked_writes():
    check_schedule_persists_across_chunked_writes(LATENT_KIND)


def test_broken_contracts_raise_with_the_values():
    kv_snapshot = KVSnapshot(None, 0, 1, mx.zeros((1, 1, 1, 2)), mx.zeros((1, 1, 1, 2)))
    cache = check_broken_contracts_raise_with_the_values(LATENT_KIND, kv_snapshot)
    with pytest.raises(ValueError, match="6-dim latent"):
        cache.update(*coded(10, 1, latent=5))
    with pytest.raises(TypeError, match="LatentSnapshot"):
        KVCache().restore(LatentSnapshot(None, 0, 1, mx.zeros((1, 1, 1, 8))), 1)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_records_round_trip_exactly_and_refuse_foreign_ones(dtype):
    cache = LatentCache(LATENT)
    latent, rope = coded(0, 9, dtype=dtype)
    cache.update(latent + 0.3, rope - 0.7)  # values bfloat16 must carry bit for bit
    record = cache.export_snapshot(cache.snapshot(3, 9))
    assert record.meta["kind"] == "latent" and record.nbytes == 6 * (LATENT + ROPE) * (
        2 if dtype == mx.bfloat16 else 4)
    back = LatentCache(LATENT).import_snapshot(record)
    assert not back.is_lazy and (back.start, back.end) == (3, 9)
    assert mx.array_equal(back.entries(), cache.keys[..., 3:9, :]).item()
    assert back.entries().dtype == dtype
    with pytest.raises(ValueError, match="does not fit"):
        LatentCache(LATENT + 1).import_snapshot(record)
    kv = KVCache()
    kv.update(mx.zeros((1, 1, 2, 4)), mx.zeros((1, 1, 2, 4)))
    with pytest.raises(ValueError, match="'kv' snapshot record"):
        cache.import_snapshot(kv.export_snapshot(kv.snapshot(0, 2)))


def test_copied_out_snapshot_does_not_keep_the_live_buffer_alive():
    def make():
        cache = LatentCache(512)
        cache.update(*coded(0, 4096, 512, 64))  # 4096 * 576 * 4 bytes live
        snap = cache.snapshot(100, 116)
        mx.eval(cache.keys)
        cache.free()
        return snap

    held, nbytes = active_bytes_held(make)
    assert nbytes == 16 * 576 * 4
    assert held <= nbytes + 4096, (held, nbytes)  # not the 9 MB buffer
