"""One forward over several sequences (``caches/segments.py``) equals each sequence's forward
alone, bit for bit: the rows of every sequence, at different offsets and in blocks of different
lengths, share the products and keep their own RoPE positions, attention, window and
recurrent state. Real tiny models of each cache kind, float32 and 4-bit, native kernels on.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from backend.caches.segments import Segments, layer_segments
from backend.weights.loading import load_model

CASES = ["llama", "gemma3", "qwen3_next", "qwen3_moe", "qwen3_5", "qwen3_5-4bit", "gemma4_text", "gemma4", "gemma4-moe", "glm4_moe_lite", "glm4_moe_lite-4bit"]


def _prefilled(model, ids: list[int]):
    caches = model.make_caches()
    for i in range(0, len(ids), 16):
        mx.eval(model.hidden(mx.array(ids[i:i + 16])[None], caches))
    return caches


@pytest.mark.parametrize("case", CASES)
def test_a_batched_step_equals_each_sequence_alone(case, tiny_model_dir, native_kernels):
    model = load_model(tiny_model_dir(case), dtype="float32").model
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, size=n).tolist() for n in (5, 23, 11)]  # a window of 8 wraps
    for blocks in ([1, 1, 1], [3, 1, 5], [1, 7, 2]):
        rows = [rng.integers(3, 200, size=n).tolist() for n in blocks]
        alone = []
        for prompt, block in zip(prompts, rows):
            caches = _prefilled(model, prompt)
            alone.append(np.array(model(mx.array(block)[None], caches)[0]))
        together = [_prefilled(model, p) for p in prompts]
        step = layer_segments(together, blocks)
        batched = np.array(model(mx.array(sum(rows, []))[None], step)[0])
        at = 0
        for i, n in enumerate(blocks):
            np.testing.assert_array_equal(batched[at:at + n], alone[i], err_msg=f"{case} {i}")
            at += n
        for i, caches in enumerate(together):  # the caches moved on exactly as alone
            assert all(c.offset == len(prompts[i]) + blocks[i] for c in caches)


def test_segments_refuse_a_mismatch():
    with pytest.raises(ValueError, match="segments"):
        Segments([object()], [1, 2])
    with pytest.raises(ValueError, match="row"):
        Segments([object(), object()], [1, 0])
    with pytest.raises(ValueError, match="rows"):
        Segments([object(), object()], [1, 2]).split(mx.zeros((1, 4, 2)), axis=1)
