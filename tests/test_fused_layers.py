"""The fused few-row layer forward (models/fused_layer.py, kernels/layer_ops.cpp): two native
blocks per Llama-style layer instead of ~26 graph nodes, equal bit for bit to the separate ops
(logits and cache contents) for decode steps and verify blocks, on full-attention and
sliding-window caches, dense and quantized weights; layers it does not cover keep the separate
ops; malformed inputs get a clear error."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from backend.weights.loading import load_model

# quantize: bits, or "4-int8": 4 bits with int8 inputs (a draft model's products).
FUSED_CASES = [("llama", None), ("llama-tied", None), ("mistral-window", None),
               ("llama3-rope", None), ("llama-linear-rope", None), ("llama", 4), ("llama", 8),
               ("llama-tied", "4-int8")]


def _model(tiny_model_dir, tmp_path, case, quantize):
    from backend.models.cpu_setup import use_int8_inputs
    from backend.weights.store import import_hf_folder

    folder = tiny_model_dir(case)
    if quantize:
        folder = import_hf_folder(folder, tmp_path / "q", quantize=4 if quantize == "4-int8"
                                  else quantize)
    loaded = load_model(folder)
    assert loaded.cpu_kernels, "the native kernels are the path under test"
    if quantize == "4-int8":
        assert use_int8_inputs(loaded.model) > 0
        assert all(layer.fused.qkv.int8_inputs for layer in loaded.model.model.layers)
    return loaded.model


def _run(model, fused: bool, tokens: list[int], blocks: list[int]):
    """Logits of each block after a prefill, and the caches' arrays at the end."""
    layers = model.model.layers
    kept = [layer.fused for layer in layers]
    if not fused:
        for layer in layers:
            layer.fused = None
    try:
        caches = model.make_caches()
        start = len(tokens) - sum(blocks)
        mx.eval(model.hidden(mx.array([tokens[:start]]), caches))  # > 16 rows: separate ops
        outs = []
        for n in blocks:
            outs.append(model.logits(model.hidden(mx.array([tokens[start:start + n]]), caches)))
            mx.eval(outs[-1], [c.arrays() for c in caches])
            start += n
        state = [np.array(a) for c in caches for a in c.arrays()]
        return [np.array(o) for o in outs], state
    finally:
        for layer, f in zip(layers, kept):
            layer.fused = f


@pytest.mark.parametrize("case,quantize", FUSED_CASES)
def test_fused_forward_equals_the_separate_ops(case, quantize, tiny_model_dir, tmp_path,
                                               native_kernels):
    model = _model(tiny_model_dir, tmp_path, case, quantize)
    assert all(layer.fused is not None for layer in model.model.layers)
    rng = np.random.default_rng(7)
    blocks = [1, 5, 16, 1, 3, 1]  # decode steps and verify blocks; the window of 8 wraps
    tokens = [int(t) for t in rng.integers(3, model.args.vocab_size, size=20 + sum(blocks))]
    fused_logits, fused_state = _run(model, True, tokens, blocks)
    plain_logits, plain_state = _run(model, False, tokens, blocks)
    for got, want in zip(fused_logits, plain_logits):
        np.testing.assert_array_equal(got, want)
    assert len(fused_state) == len(plain_state)
    for got, want in zip(fused_state, plain_state):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", ["llama", "mistral-window"])
def test_decode_takes_the_fused_path_and_prefill_does_not(case, tiny_model_dir, tmp_path,
                                                          native_kernels, monkeypatch):
    model = _model(tiny_model_dir, tmp_path, case, None)
    calls = []
    real = native_kernels.attention_mlp
    monkeypatch.setattr(native_kernels, "attention_mlp", lambda *a: calls.append(1) or real(*a))
    caches = model.make_caches()
    rows = native_kernels.MAX_KERNEL_ROWS + 1
    mx.eval(model.hidden(mx.array([[3 + t % 40 for t in range(rows)]]), caches))
    assert calls == []
    mx.eval(model.hidden(mx.array([[5]]), caches))
    assert len(calls) == len(model.model.layers)


@pytest.mark.parametrize("case,quantize", [("llama", None), ("mistral-window", None),
                                           ("llama", 4), ("llama-tied", "4-int8")])
def test_a_batched_step_takes_the_fused_path_and_equals_each_sequence_alone(
        case, quantize, tiny_model_dir, tmp_path, native_kernels, monkeypatch):
    from backend.caches.segments import layer_segments

    model = _model(tiny_model_dir, tmp_path, case, quantize)
    calls = []
    real = native_kernels.attention_mlp_segments
    monkeypatch.setattr(native_kernels, "attention_mlp_segments",
                        lambda *a: calls.append(len(a[4])) or real(*a))
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, model.args.vocab_size, size=n)]
               for n in (17, 6, 29)]  # the window of 8 wraps
    blocks = [[int(t) for t in rng.integers(3, model.args.vocab_size, size=n)]
              for n in (1, 4, 2)]  # a decode row and verify blocks side by side

    def prefilled(prompt):
        caches = model.make_caches()
        mx.eval(model.hidden(mx.array([prompt]), caches))
        return caches

    alone = []
    for prompt, block in zip(prompts, blocks):
        caches = prefilled(prompt)
        alone.append(np.array(model(mx.array([block]), caches)[0]))
    together = [prefilled(p) for p in prompts]
    calls.clear()
    step = layer_segments(together, [len(b) for b in blocks])
    batched = np.array(model(mx.array([sum(blocks, [])]), step)[0])
    assert calls == [3] * len(model.model.layers)  # one fused node per layer, three sequences
    at = 0
    for block, want in zip(blocks, alone):
        np.testing.assert_array_equal(batched[at:at + len(block)], want)
        at += len(block)


def test_full_attention_buffers_are_written_in_place(tiny_model_dir, tmp_path, native_kernels):
    """Each decode step writes its keys and values into the cache's buffers without copying
    them (a copy per layer and step would cost a pass over the whole cache)."""
    model = _model(tiny_model_dir, tmp_path, "llama", None)
    caches = model.make_caches()
    mx.eval(model.hidden(mx.array([list(range(3, 40))]), caches))

    def address(a: mx.array) -> int:
        return np.array(a, copy=False).__array_interface__["data"][0]

    for token in (5, 6, 7):
        before = [address(a) for c in caches for a in c.arrays()]
        mx.eval(model.hidden(mx.array([[token]]), caches))
        assert [address(a) for c in caches for a in c.arrays()] == before


@pytest.mark.parametrize("case", ["qwen2", "qwen3", "gemma3", "qwen3_moe"])
def test_layers_outside_the_fused_form_keep_the_separate_ops(case, tiny_model_dir,
                                                             native_kernels):
    """Biases (Qwen2), q/k norms (Qwen3), Gemma's norms, mixture-of-experts MLPs."""
    model = load_model(tiny_model_dir(case)).model
    assert all(getattr(layer, "fused", None) is None for layer in model.model.layers)


def test_fused_ops_reject_malformed_input(native_kernels):
    k = native_kernels
    H, heads, kv, D = 64, 4, 2, 16
    x, norm = mx.zeros((1, 2, H)), mx.ones((H,))
    freqs = mx.ones((D // 2,))
    qkv = k.KernelWeight((mx.zeros(((heads + 2 * kv) * D, H)),))
    q, kk, v = k.attention_inputs(x, norm, 1e-5, qkv, heads, kv, D, D, 3, 1.0, freqs)
    assert q.shape == (1, heads, 2, D) and kk.shape == v.shape == (1, kv, 2, D)
    with pytest.raises(ValueError, match=r"qkv: expected 128 x 64 values, got 96 x 64"):
        k.attention_inputs(x, norm, 1e-5, k.KernelWeight((mx.zeros((96, H)),)), heads, kv, D,
                           D, 0, 1.0, freqs)
    with pytest.raises(ValueError, match="expected float32 x"):
        k.attention_inputs(x.astype(mx.float16), norm, 1e-5, qkv, heads, kv, D, D, 0, 1.0,
                           freqs)
    with pytest.raises(ValueError, match="heads a multiple of kv_heads"):
        k.attention_inputs(x, norm, 1e-5, qkv, heads, 3, D, D, 0, 1.0, freqs)
    with pytest.raises(ValueError, match="expected wq, scales and biases"):
        k.attention_inputs(x, norm, 1e-5, k.KernelWeight(qkv.arrays, 4, 64), heads, kv, D, D,
                           0, 1.0, freqs)
    o = k.KernelWeight((mx.zeros((H, heads * D)),))
    gate_up = k.KernelWeight((mx.zeros((2 * 96, H)),))
    down = k.KernelWeight((mx.zeros((H, 96)),))
    keys = values = mx.zeros((1, kv, 8, D))
    out = k.attention_mlp(q, keys, values, 5, 0.25, 0, x, norm, 1e-5, o, gate_up, down)
    np.testing.assert_array_equal(np.array(out), np.array(x))  # all-zero weights: x + 0 + 0
    with pytest.raises(ValueError, match="rows <= length <= capacity"):
        k.attention_mlp(q, keys, values, 9, 0.25, 0, x, norm, 1e-5, o, gate_up, down)
    with pytest.raises(ValueError, match="expected q"):
        k.attention_mlp(q[:, :, :1], keys, values, 5, 0.25, 0, x, norm, 1e-5, o, gate_up, down)
    with pytest.raises(ValueError, match="down: int8 inputs need 4-bit weights"):
        wq, scales, biases = mx.quantize(mx.zeros((H, 128)), group_size=64, bits=8)
        k.attention_mlp(q, keys, values, 5, 0.25, 0, x, norm, 1e-5, o, gate_up,
                        k.KernelWeight((wq, scales, biases), 8, 64, True))
    with pytest.raises(ValueError, match=r"covering x's 2 rows .*rows \[1, 2\]"):
        k.attention_inputs_segments(x, norm, 1e-5, qkv, heads, kv, D, D, [0, 4], [1, 2], 1.0,
                                    freqs)
    with pytest.raises(ValueError, match="several only for batch 1"):
        k.attention_inputs_segments(mx.zeros((2, 2, H)), norm, 1e-5, qkv, heads, kv, D, D,
                                    [0, 4], [1, 1], 1.0, freqs)
    with pytest.raises(ValueError, match="a length for each of the 2 segments"):
        k.attention_mlp_segments(q, [keys, keys], [values], [5, 5], [1, 1], 0.25, 0, x, norm,
                                 1e-5, o, gate_up, down)
    with pytest.raises(ValueError, match="rows <= length"):
        k.attention_mlp_segments(q, [keys, keys], [values, values], [5, 0], [1, 1], 0.25, 0, x,
                                 norm, 1e-5, o, gate_up, down)
    with pytest.raises(ValueError, match=r"down: expected 64 x 96 values"):
        k.attention_mlp(q, keys, values, 5, 0.25, 0, x, norm, 1e-5, o, gate_up,
                        k.KernelWeight((mx.zeros((H, 95)),)))
