"""Segmented scans and the gated-delta layer: chunked == per-token == independent reference.

* The chunked parallel form gives the per-token recurrence's outputs and states.
* Segmenting (asking for states at split offsets) never changes the outputs (bitwise), and every
  boundary state equals the state of running just that prefix.
* bf16 activations keep a float32 delta state.
* A Qwen3-Next layer stack fed in any chunking equals the one-shot forward, states included.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from backend.caches.recurrent import RecurrentCache
from backend.caches.scan import (
    CHUNK,
    causal_conv1d,
    gated_delta,
    gated_delta_chunked,
    gated_delta_recurrent,
    unit_lower_inverse,
)
from backend.weights.loading import load_model

HK, HV, DK, DV = 2, 4, 16, 8
SCANS = {"recurrent": gated_delta_recurrent, "chunked": gated_delta_chunked}


def inputs(n: int, seed: int = 0, dtype=mx.float32, state: bool = True):
    """Normalised q/k (q scaled by 1/sqrt(Dk)), mild decays (long memory), random betas."""
    key = mx.random.key(seed)
    ks = mx.random.split(key, 7)
    q = mx.random.normal((1, n, HK, DK), key=ks[0])
    k = mx.random.normal((1, n, HK, DK), key=ks[1])
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) / DK ** 0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((1, n, HV, DV), key=ks[2])
    log_g = -mx.random.uniform(0.0, 0.2, (1, n, HV), key=ks[3])
    beta = mx.sigmoid(mx.random.normal((1, n, HV), key=ks[4]))
    s0 = mx.random.normal((1, HV, DV, DK), key=ks[5]) * 0.3 if state else None
    return (q.astype(dtype), k.astype(dtype), v.astype(dtype), log_g, beta, s0)


def close(a: mx.array, b: mx.array, tol: float = 2e-5) -> bool:
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max())


def test_unit_lower_inverse_matches_a_triangular_solve():
    # The delta rule's WY matrix: I + strict_tril(beta_i k_i.k_j), unit-norm keys.
    k = mx.random.normal((3, 5, 64, 16), key=mx.random.key(1))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    beta = mx.random.uniform(0, 1, (3, 5, 64, 1), key=mx.random.key(2))
    m = mx.tril((beta * k) @ k.swapaxes(-1, -2), -1) + mx.eye(64)
    inv = unit_lower_inverse(m)
    assert close(inv @ m, mx.broadcast_to(mx.eye(64), m.shape), 1e-5)
    assert close(inv, mx.linalg.tri_inv(m, upper=False, stream=mx.cpu), 1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        unit_lower_inverse(mx.eye(6))


@pytest.mark.parametrize("n", [1, 7, 63, 64, 65, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_per_token_and_mlx_lm(n, with_state):
    from mlx_lm.models.gated_delta import gated_delta_ops

    q, k, v, log_g, beta, s0 = inputs(n, seed=n, state=with_state)
    y_rec, (s_rec,) = gated_delta_recurrent(q, k, v, log_g, beta, s0, [n])
    y_chk, (s_chk,) = gated_delta_chunked(q, k, v, log_g, beta, s0, [n])
    y_ref, s_ref = gated_delta_ops(q, k, v, mx.exp(log_g), beta, s0)  # independent reference
    assert s_rec.dtype == s_chk.dtype == mx.float32
    assert close(y_rec, y_ref) and close(s_rec, s_ref)
    assert close(y_chk, y_ref) and close(s_chk, s_ref)


@pytest.mark.parametrize("scan", sorted(SCANS))
def test_segmenting_never_changes_outputs_and_each_boundary_state_is_the_prefix_state(scan):
    n = 150
    q, k, v, log_g, beta, s0 = inputs(n, seed=3)
    run = SCANS[scan]
    y_whole, (s_whole,) = run(q, k, v, log_g, beta, s0, [n])
    cuts = [1, 5, CHUNK - 1, CHUNK, CHUNK + 1, 100, 2 * CHUNK, n]
    y_seg, states = run(q, k, v, log_g, beta, s0, cuts)
    assert np.array_equal(np.array(y_seg), np.array(y_whole))  # bitwise
    assert len(states) == len(cuts) and np.array_equal(np.array(states[-1]), np.array(s_whole))
    for cut, state in zip(cuts, states):
        _, (prefix_state,) = gated_delta_recurrent(q[:, :cut], k[:, :cut], v[:, :cut],
                                                   log_g[:, :cut], beta[:, :cut], s0, [cut])
        assert state.dtype == mx.float32 and close(state, prefix_state), cut
        # Continuing from a boundary state reproduces the rest of the unsegmented output.
        y_rest, _ = run(q[:, cut:], k[:, cut:], v[:, cut:], log_g[:, cut:], beta[:, cut:],
                        state, [n - cut]) if cut < n else (None, None)
        if y_rest is not None:
            assert close(y_rest, y_whole[:, cut:]), cut


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_low_precision_activations_keep_a_float32_state(dtype):
    n = 100
    full = inputs(n, seed=5)
    low = inputs(n, seed=5, dtype=dtype)
    for run in SCANS.values():
        y32, (s32,) = run(*full, [n])
        y16, states = run(*low, [40, n])
        assert all(s.dtype == mx.float32 for s in states)
        assert close(y16, y32, 2e-2) and close(states[-1], s32, 2e-2)


def test_scan_boundaries_are_checked():
    q, k, v, log_g, beta, s0 = inputs(10)
    for bad in ([0, 10], [5, 5], [3, 11]):
        with pytest.raises(ValueError, match="boundaries"):
            gated_delta(q, k, v, log_g, beta, s0, bad)


def test_segmented_conv_states_are_the_last_inputs_and_outputs_do_not_change():
    import mlx.nn as nn

    x = mx.random.normal((1, 30, 12), key=mx.random.key(7))
    state = mx.random.normal((1, 3, 12), key=mx.random.key(8))
    weight = mx.random.normal((12, 4), key=mx.random.key(9))
    y, (final,) = causal_conv1d(x, weight, state, [30])
    y_seg, states = causal_conv1d(x, weight, state, [1, 2, 17, 30])
    assert np.array_equal(np.array(y), np.array(y_seg))
    padded = mx.concatenate([state, x], axis=1)
    for cut, s in zip([1, 2, 17, 30], states):
        assert np.array_equal(np.array(s), np.array(padded[:, cut:cut + 3]))
    conv = nn.Conv1d(12, 12, 4, groups=12, bias=False)  # MLX's own depthwise conv as reference
    conv.weight = weight[..., None]
    assert close(y, conv(padded))
    # Two writes chained through the returned state equal one write.
    y1, (mid,) = causal_conv1d(x[:, :11], weight, state, [11])
    y2, _ = causal_conv1d(x[:, 11:], weight, mid, [19])
    assert close(mx.concatenate([y1, y2], axis=1), y)


# -- the layer inside a model ------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_next(tiny_model_dir):
    return load_model(tiny_model_dir("qwen3_next"), dtype="float32").model


def _run(model, tokens: mx.array, chunks: list[int], caches=None):
    caches = caches or model.make_caches()
    outs, pos = [], 0
    for n in chunks:
        outs.append(model(tokens[:, pos:pos + n], caches))
        pos += n
    return mx.concatenate(outs, axis=1), caches


@pytest.mark.parametrize("chunks", [
    [150],  # one chunked write (3 chunks of 64)
    [64, 64, 22],  # chunk grid aligned with writes
    [5, 70, 1, 1, 1, 9, 62, 1],  # per-token and chunked paths, boundaries off the grid
])
def test_model_chunking_does_not_change_logits_or_states(qwen3_next, chunks):
    tokens = mx.array(np.random.default_rng(0).integers(0, 250, (1, 150)))
    reference, ref_caches = _run(qwen3_next, tokens, [1] * 150)  # pure per-token recurrence
    logits, caches = _run(qwen3_next, tokens, chunks)
    assert close(logits, reference, 1e-4)
    for ours, ref in zip(caches, ref_caches):
        assert ours.offset == ref.offset == 150
        for a, b in zip(ours.arrays(), ref.arrays()):
            if isinstance(ours, RecurrentCache):
                assert close(a, b, 1e-4)


def test_bf16_model_keeps_float32_delta_state(tiny_model_dir):
    model = load_model(tiny_model_dir("qwen3_next"), dtype="bfloat16").model
    caches = model.make_caches()
    tokens = mx.array(np.random.default_rng(1).integers(0, 250, (1, 20)))
    model(tokens[:, :12], caches)
    model(tokens[:, 12:13], caches)
    recurrent = [c for c in caches if isinstance(c, RecurrentCache)]
    assert recurrent and all(c.delta.dtype == mx.float32 for c in recurrent)
    assert all(c.conv.dtype == mx.bfloat16 for c in recurrent)


def test_layer_captures_scheduled_states_inside_one_batched_write(qwen3_next):
    """A verify-style batched write with snapshots scheduled inside it: restoring each snapshot
    and continuing gives what a write stopping exactly there would have given."""
    tokens = mx.array(np.random.default_rng(2).integers(0, 250, (1, 90)))
    caches = qwen3_next.make_caches()
    qwen3_next(tokens[:, :20], caches)
    for c in caches:
        c.prepare_snapshots([23, 31, 86])
    qwen3_next(tokens[:, 20:90], caches)  # chunked path, snapshots mid-chunk
    snaps = [c.take_snapshots() for c in caches]
    for i, target in enumerate([23, 31, 86]):
        for c, s in zip(caches, snaps):
            assert c.restore(s[i], target)
        tail = qwen3_next(tokens[:, target:], caches)
        fresh, _ = _run(qwen3_next, tokens, [target, 90 - target])
        assert close(tail, fresh[:, target:], 1e-4), target


def test_head_groups_on_separate_cpu_streams_change_nothing(qwen3_next, monkeypatch):
    """Long writes split a layer's heads over CPU streams; outputs and every captured state are
    bitwise those of the single-stream scan."""
    import backend.caches.scan as scan

    tokens = mx.array(np.random.default_rng(3).integers(0, 250, (1, 130)))

    def run(streams: int):
        monkeypatch.setattr(scan, "CPU_STREAMS", streams)
        caches = qwen3_next.make_caches()
        for c in caches:
            c.prepare_snapshots([40, 100])
        logits = qwen3_next(tokens, caches)
        snaps = [c.take_snapshots() for c in caches if isinstance(c, RecurrentCache)]
        states = [a for c in caches if isinstance(c, RecurrentCache) for a in c.arrays()]
        return logits, states, snaps

    assert scan.parallel_groups(2, 130) == 2 and scan.parallel_groups(2, 8) == 1
    split, split_states, split_snaps = run(2)
    single, single_states, single_snaps = run(1)
    assert mx.array_equal(split, single)
    assert all(mx.array_equal(a, b) for a, b in zip(split_states, single_states))
    for ours, ref in zip(split_snaps, single_snaps):
        for a, b in zip(ours, ref):
            assert all(mx.array_equal(x, y) for x, y in zip(a.arrays(), b.arrays()))
