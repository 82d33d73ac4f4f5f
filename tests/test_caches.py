"""The cache contract for every kind: lazy snapshots, restore regimes, merge/split, schedules, bytes.

Keys and values are *position-coded* (every element of position p's key is p, its value p + 1000)
so a test reads exactly which positions a buffer or snapshot holds, in which order.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.caches.attention import logical_mask, scaled_dot_product_attention
from backend.caches.base import sliding_window
from backend.caches.kv import KVCache, KVSnapshot
from backend.caches.recurrent import RecurrentCache, RecurrentSnapshot
from backend.caches.rotating import RotatingKVCache, RotatingSnapshot
from backend.caches.scan import causal_conv1d
from tests.fixtures.span_caches import (
    SpanKind, active_bytes_held, check_broken_contracts_raise_with_the_values,
    check_free_copies_out_every_lazy_snapshot,
    check_lazy_snapshots_cost_nothing_until_a_write_overwrites_them,
    check_merge_and_split_keep_contents_and_laziness, check_schedule_persists_across_chunked_writes)

HEADS, DIM = 2, 4


def coded(start: int, n: int, heads: int = HEADS, dim: int = DIM) -> tuple[mx.array, mx.array]:
    keys = mx.broadcast_to(mx.arange(start, start + n, dtype=mx.float32)[:, None],
                           (1, heads, n, dim))
    return mx.array(keys), mx.array(keys + 1000)


def write(cache, start: int, n: int):
    return cache.update(*coded(start, n))


def positions_of(keys: mx.array) -> list[int]:
    return [int(p) for p in np.array(keys[0, 0, :, 0])]


def fill(cache, n: int, chunk: int = 1) -> None:
    for p in range(cache.offset, n, chunk):
        write(cache, p, min(chunk, n - p))


# -- KVCache -------------------------------------------------------------------------------------

# A position of an owned snapshot: its key and value, float32.
KV = SpanKind(KVCache, write, positions_of, lambda snap: snap.arrays()[0], 2 * HEADS * DIM * 4)


def test_kv_lazy_snapshots_cost_nothing_until_a_write_overwrites_them():
    check_lazy_snapshots_cost_nothing_until_a_write_overwrites_them(KV)


def test_kv_free_copies_out_every_lazy_snapshot():
    check_free_copies_out_every_lazy_snapshot(KV)


def test_kv_restore_own_lazy_snapshot_is_an_offset_move():
    cache = KVCache()
    write(cache, 0, 12)
    snap = cache.snapshot(4, 10)
    assert cache.restore(None, 6)
    assert cache.restore(snap, 10) and cache.offset == 10 and snap.is_lazy
    assert positions_of(cache.keys[..., :10, :]) == list(range(10))


def test_kv_restore_from_an_owned_snapshot_into_another_cache():
    source = KVCache()
    write(source, 0, 16)
    snap = source.snapshot(10, 16)
    source.free()  # snap is now an owned copy
    target = KVCache()
    write(target, 0, 10)
    assert target.restore(snap, 14) and target.offset == 14
    assert positions_of(target.keys[..., :14, :]) == list(range(14))
    short = KVCache()
    write(short, 0, 5)
    assert short.restore(snap, 16) is False  # live cache lacks [5, 10): caller recomputes


def test_kv_merge_and_split_keep_contents_and_laziness():
    check_merge_and_split_keep_contents_and_laziness(KV)


def right_bytes(n: int) -> int:
    return 2 * HEADS * n * DIM * 4


def test_kv_broken_contracts_raise_with_the_values():
    check_broken_contracts_raise_with_the_values(KV, RotatingSnapshot(None, 0, 1, 0, *coded(0, 1)))


def test_kv_schedule_persists_across_chunked_writes():
    check_schedule_persists_across_chunked_writes(KV)


@pytest.mark.parametrize("heads", [1, 4])  # 1 head: the range is one contiguous run of memory
def test_kv_copied_out_snapshot_does_not_keep_the_live_buffer_alive(heads):
    def make():
        cache = KVCache()
        cache.update(*coded(0, 4096, heads, 64))  # 2 * 4096 * heads * 64 * 4 bytes live
        snap = cache.snapshot(100, 116)
        mx.eval(cache.keys, cache.values)
        cache.free()
        return snap

    held, nbytes = active_bytes_held(make)
    assert nbytes == 2 * 16 * heads * 64 * 4
    assert held <= nbytes + 4096, (held, nbytes)  # not the 2 MB+ buffer


# -- RotatingKVCache -------------------------------------------------------------------------------

def queries(start: int, n: int) -> mx.array:
    """Query for position p: a function of p alone, so chunked and full runs agree."""
    q = mx.sin(mx.arange(start, start + n, dtype=mx.float32))[:, None] * 0.003
    return mx.broadcast_to(q, (1, HEADS, n, DIM))


def reference_attention(n: int, window: int) -> mx.array:
    """Sliding-window attention over positions [0, n) with the position-coded keys."""
    keys, values = coded(0, n)
    pos = mx.arange(n)
    mask = logical_mask(sliding_window(window), pos, pos)
    return mx.fast.scaled_dot_product_attention(queries(0, n), keys, values, scale=1.0,
                                                mask=mask)


def rotating_attention(cache: RotatingKVCache, start: int, n: int) -> mx.array:
    history = write(cache, start, n)
    return scaled_dot_product_attention(queries(start, n), history,
                                        sliding_window(cache.window), 1.0)


@settings(max_examples=40, deadline=None)
@given(window=st.sampled_from([1, 3, 8]),
       chunks=st.lists(st.integers(1, 11), min_size=1, max_size=14))
def test_rotating_matches_sliding_window_attention_for_any_write_schedule(window, chunks):
    cache, outs, p = RotatingKVCache(window), [], 0
    for n in chunks:
        outs.append(rotating_attention(cache, p, n))
        p += n
        lo, hi = cache.stored_range()
        assert hi == p and lo <= max(0, p - window + 1)  # the window is always stored
        assert cache.keys.shape[2] <= max(window, window - 1 + n)
    expected = reference_attention(p, window)
    assert np.allclose(np.array(mx.concatenate(outs, axis=2)), np.array(expected), atol=1e-5)


def test_rotating_multi_token_write_after_a_wrap_keeps_the_last_window_minus_one_in_order():
    cache = RotatingKVCache(8)
    fill(cache, 20)  # single-token writes: the ring has wrapped twice
    assert cache.keys.shape[2] == 8
    assert sorted(positions_of(cache.keys)) == list(range(12, 20))
    assert positions_of(cache.keys) != list(range(12, 20))  # ring order, not logical
    history = write(cache, 20, 5)
    assert positions_of(history.keys) == list(range(13, 25))  # 7 old in logical order + 5 new
    assert history.key_start == 13


def test_rotating_history_is_logical_order_whatever_the_ring_layout():
    """Attention must read the same keys in the same order for the same positions, whether the
    ring wrapped step by step or the window was restored from a snapshot (other layout)."""
    stepped = RotatingKVCache(8)
    fill(stepped, 20)
    snap = stepped.snapshot(0)
    restored = RotatingKVCache(8)
    assert restored.restore(snap, 20)
    snap.close()
    for cache in (stepped, restored):
        history = write(cache, 20, 1)
        assert positions_of(history.keys) == list(range(13, 21)) and history.key_start == 13
    assert positions_of(stepped.keys) != positions_of(restored.keys)  # storage differs


def test_rotating_multi_token_write_before_a_wrap_drops_the_stale_tail():
    cache = RotatingKVCache(8)
    write(cache, 0, 6)
    assert cache.restore(None, 3)
    history = write(cache, 3, 2)
    assert positions_of(history.keys) == list(range(5))
    assert history.key_start == 0


@pytest.mark.parametrize("regime,offset,reachable", [
    ("not full", 5, {0, 1, 2, 3, 4, 5}),
    ("exactly full", 8, set(range(9))),
    ("wrapped", 20, {0, 19, 20}),  # the ring overwrote what any earlier target needs
])
def test_rotating_live_rewind_by_regime(regime, offset, reachable):
    for target in range(offset + 1):
        cache = RotatingKVCache(8)
        fill(cache, offset)
        assert cache.restore(None, target) is (target in reachable), (regime, target)
        if target in reachable:  # continuing from the rewound state is exact
            outs = [rotating_attention(cache, p, 1) for p in range(target, offset + 4)]
            expected = reference_attention(offset + 4, 8)[..., target:, :]
            assert np.allclose(np.array(mx.concatenate(outs, axis=2)), np.array(expected),
                               atol=1e-5)


@pytest.mark.parametrize("offset", [5, 8, 20])  # not full, exactly full, wrapped
def test_rotating_snapshot_restore_by_regime(offset):
    cache = RotatingKVCache(8)
    cache.prepare_snapshots([offset])
    fill(cache, offset + 17)  # continue far past the snapshot (wrapping the ring)
    (snap,) = cache.take_snapshots()
    assert cache.restore(None, offset) is False  # the ring moved on: only the snapshot has it
    assert not snap.is_lazy and snap.nbytes == right_bytes(min(offset, 7))
    assert positions_of(snap.arrays()[0]) == list(range(max(0, offset - 7), offset))
    assert cache.restore(snap, offset) and cache.offset == offset
    outs = [rotating_attention(cache, p, 1) for p in range(offset, offset + 12)]
    expected = reference_attention(offset + 12, 8)[..., offset:, :]
    assert np.allclose(np.array(mx.concatenate(outs, axis=2)), np.array(expected), atol=1e-5)


def test_rotating_snapshot_stays_lazy_until_the_ring_overwrites_its_window():
    cache = RotatingKVCache(8)
    fill(cache, 10)
    snap = cache.snapshot()  # window at 10: positions [3, 10)
    assert (snap.lo, snap.end, snap.nbytes) == (3, 10, 0)
    write(cache, 10, 1)  # overwrites position 2: not needed
    assert snap.is_lazy
    write(cache, 11, 1)  # overwrites position 3
    assert not snap.is_lazy and positions_of(snap.arrays()[0]) == list(range(3, 10))


def test_rotating_verify_block_across_the_wrap_rewinds_without_copies():
    cache = RotatingKVCache(8)
    fill(cache, 6)
    cache.prepare_snapshots([7, 8, 9, 10])
    write(cache, 6, 5)  # one verify block crossing the window boundary
    snaps = cache.take_snapshots()
    assert all(s.is_lazy and s.nbytes == 0 for s in snaps)
    assert cache.restore(None, 8)  # accept 2 of 5: an offset move
    assert all(s.is_lazy for s in snaps[:2])
    outs = [rotating_attention(cache, 8, 3)] + [rotating_attention(cache, p, 1)
                                                for p in range(11, 15)]
    expected = reference_attention(15, 8)[..., 8:, :]
    assert np.allclose(np.array(mx.concatenate(outs, axis=2)), np.array(expected), atol=1e-5)
    assert cache.restore(snaps[3], 10) is True  # snapshot copied out when position 10 rewrote
    assert positions_of(snaps[3].arrays()[0]) == list(range(3, 10))


def test_rotating_restore_inside_a_snapshot_range():
    cache = RotatingKVCache(8)
    fill(cache, 4)
    cache.prepare_snapshots([9])
    write(cache, 4, 5)
    (snap,) = cache.take_snapshots()  # window [2, 9), covering [4, 9)
    fill(cache, 30)
    # Target 6 inside [4, 9): needs live positions before 4 — the live ring lost them.
    assert cache.restore(snap, 6) is False
    fresh = RotatingKVCache(8)
    fill(fresh, 4)  # the caller's prefix [0, 4)
    assert fresh.restore(snap, 6) and fresh.offset == 6
    outs = [rotating_attention(fresh, p, 1) for p in range(6, 12)]
    assert np.allclose(np.array(mx.concatenate(outs, axis=2)),
                       np.array(reference_attention(12, 8)[..., 6:, :]), atol=1e-5)
    early = RotatingKVCache(8)
    early.prepare_snapshots([5])
    fill(early, 20)
    (whole,) = early.take_snapshots()  # window at 5 holds [0, 5): every target reachable
    assert early.restore(whole, 3) and positions_of(early.keys) == [0, 1, 2]


def test_rotating_merge_split_and_contracts():
    cache = RotatingKVCache(8)
    cache.prepare_snapshots([6, 12])
    fill(cache, 12)
    a, b = cache.take_snapshots()
    merged = cache.merge(a, b)
    assert (merged.start, merged.end, merged.lo) == (0, 12, 5) and merged.is_lazy
    first, second = cache.split(merged, 9)
    assert first is None and (second.start, second.end) == (9, 12)
    assert positions_of(second.arrays()[0]) == list(range(5, 12))
    with pytest.raises(TypeError, match="KVSnapshot"):
        cache.restore(KVSnapshot(None, 0, 1, *coded(0, 1)), 1)
    with pytest.raises(ValueError, match="outside snapshot range"):
        cache.restore(second, 13)
    with pytest.raises(ValueError, match="window"):
        RotatingKVCache(0)
    cache.free()
    assert not second.is_lazy and cache.offset == 0 and cache.nbytes == 0


def test_rotating_copied_out_snapshot_does_not_keep_the_ring_alive():
    def make():
        cache = RotatingKVCache(64)
        cache.update(*coded(0, 4096, 1, 64))  # a long prefill: buffer of 4096 slots
        snap = cache.snapshot()
        mx.eval(cache.keys, cache.values)
        cache.free()
        return snap

    held, nbytes = active_bytes_held(make)
    assert nbytes == 2 * 63 * 64 * 4
    assert held <= nbytes + 4096, (held, nbytes)


# -- RecurrentCache --------------------------------------------------------------------------------

def states(value: float, dtype=mx.float32) -> tuple[mx.array, mx.array]:
    return mx.full((1, 3, 6), value, mx.float32), mx.full((1, 2, 4, 4), value, dtype)


def advance(cache: RecurrentCache, n: int) -> list[int]:
    """Write n tokens whose state after position p is filled with the value p."""
    bounds = cache.boundaries(n)
    pairs = [states(cache.offset + b) for b in bounds]
    cache.advance(n, [c for c, _ in pairs], [d for _, d in pairs])
    return bounds


def state_value(snapshot_or_cache) -> float:
    conv, delta = (snapshot_or_cache.state() if isinstance(snapshot_or_cache, RecurrentSnapshot)
                   else (snapshot_or_cache.conv, snapshot_or_cache.delta))
    assert float(conv[0, 0, 0]) == float(delta[0, 0, 0, 0])
    return float(delta[0, 0, 0, 0])


def test_recurrent_schedule_asks_the_scan_for_each_crossed_offset():
    cache = RecurrentCache()
    cache.prepare_snapshots([0, 5, 12, 20])
    assert advance(cache, 7) == [5, 7]
    assert advance(cache, 13) == [5, 13]  # 12 and 20, relative to offset 7
    snaps = cache.take_snapshots()
    assert [(s.start, s.end) for s in snaps] == [(0, 0), (0, 5), (5, 12), (12, 20)]
    assert [state_value(s) for s in snaps[1:]] == [5, 12, 20]
    assert snaps[0].state() == (None, None) and snaps[0].nbytes == 0
    assert advance(cache, 4) == [4]


def test_recurrent_restores_only_at_exact_offsets():
    cache = RecurrentCache()
    cache.prepare_snapshots([6, 10])
    advance(cache, 14)
    at6, at10 = cache.take_snapshots()
    assert cache.restore(None, 14) and not cache.restore(None, 13)
    assert cache.restore(at10, 10) and cache.offset == 10 and state_value(cache) == 10
    assert cache.restore(at10, 8) is False  # inside [6, 10): that state was never captured
    assert cache.restore(at6, 6) and state_value(cache) == 6
    assert cache.restore(None, 0) and cache.offset == 0 and cache.arrays() == []
    with pytest.raises(ValueError, match="forward"):
        cache.restore(None, 1)
    with pytest.raises(ValueError, match="outside snapshot range"):
        cache.restore(at10, 11)
    with pytest.raises(TypeError, match="KVSnapshot"):
        cache.restore(KVSnapshot(None, 0, 1, *coded(0, 1)), 1)


def test_recurrent_merge_split_and_float32_state():
    cache = RecurrentCache()
    cache.prepare_snapshots([4, 9])
    advance(cache, 9)
    a, b = cache.take_snapshots()
    merged = cache.merge(a, b)
    assert (merged.start, merged.end, state_value(merged)) == (0, 9, 9)
    with pytest.raises(ValueError, match="closed"):
        a.state()
    first, second = cache.split(merged, 3)
    assert first is None and (second.start, second.end, state_value(second)) == (3, 9, 9)
    assert second.nbytes == 3 * 6 * 4 + 2 * 16 * 4
    with pytest.raises(ValueError, match="float32"):
        cache.advance(1, [states(1)[0]], [states(1, mx.bfloat16)[1]])
    with pytest.raises(ValueError, match="states at"):
        cache.advance(2, [], [])


def test_recurrent_conv_snapshot_does_not_keep_the_input_alive():
    def make():
        cache = RecurrentCache()
        x = mx.random.normal((1, 8192, 128))  # 4 MB of conv input
        bounds = cache.boundaries(8192)
        _, conv_states = causal_conv1d(x, mx.ones((128, 4)), None, bounds)
        delta = [mx.zeros((1, 1, 2, 2))]
        mx.eval(conv_states)
        cache.advance(8192, conv_states, delta)
        return cache.snapshot()

    held, nbytes = active_bytes_held(make)
    assert nbytes == 3 * 128 * 4 + 16
    assert held <= nbytes + 4096, (held, nbytes)


# -- the SDPA helper's query blocking (CPU) --------------------------------------------------------

@pytest.mark.parametrize("kind,window", [("kv", None), ("kv", 5), ("rotating", 5)])
def test_query_blocks_give_the_unblocked_result(monkeypatch, kind, window):
    from backend.caches import attention
    from backend.caches.base import CAUSAL

    mask = CAUSAL if window is None else sliding_window(window)
    make = (lambda: KVCache()) if kind == "kv" else (lambda: RotatingKVCache(window))
    rng = np.random.default_rng(0)
    keys = mx.array(rng.normal(size=(1, HEADS, 60, DIM)).astype(np.float32))
    values = mx.array(rng.normal(size=(1, HEADS, 60, DIM)).astype(np.float32))
    q = mx.array(rng.normal(size=(1, HEADS, 60, DIM)).astype(np.float32))

    def run(block: int) -> mx.array:
        monkeypatch.setattr(attention, "QUERY_BLOCK", block)
        cache, outs = make(), []
        for start, n in ((0, 13), (13, 1), (14, 40), (54, 6)):  # prefix, then long writes
            history = cache.update(keys[..., start:start + n, :], values[..., start:start + n, :])
            if n > block:
                assert attention.query_blocks(history, mask) is not None
            outs.append(scaled_dot_product_attention(q[..., start:start + n, :], history, mask,
                                                     0.5))
        return mx.concatenate(outs, axis=2)

    assert np.allclose(np.array(run(4)), np.array(run(10**6)), atol=1e-5)
