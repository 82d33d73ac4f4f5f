"""Row invariance of whole models: one forward of a block of k <= 16 tokens (a speculative verify
block) gives, bit for bit, the logits and cache state of k one-token decode steps. This is what
makes greedy speculative output identical to plain greedy output, not just close.

Run with the native CPU kernels (the default CPU path), for every cache kind: full attention,
a sliding window whose wrap falls inside the block, gated-delta recurrent layers, sparse MoE,
latent attention (GLM-4.7-Flash, absorbed form; its per-head and expert products gathered),
Gemma 4's layers that attend over another layer's keys.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from backend.weights.loading import load_model

CASES = ["llama", "qwen3", "mistral-window", "gemma3", "qwen3_next", "qwen3_moe", "qwen3_5",
         "qwen3_5_moe", "qwen3_5-4bit", "qwen3_5_moe-4bit", "glm4_moe_lite", "glm4_moe_lite-4bit",
         "gemma4", "gemma4-moe", "gemma4-4bit", "gemma4-moe-4bit"]


def _prefill(model, caches, tokens):
    hidden = model.hidden(mx.array(tokens)[None], caches)
    mx.eval(hidden, [c.arrays() for c in caches])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prefix,block", [(5, 10), (13, 16), (30, 3), (2, 1)])
def test_block_forward_equals_one_token_steps(case, prefix, block, tiny_model_dir,
                                              native_kernels):
    loaded = load_model(tiny_model_dir(case))
    assert loaded.cpu_kernels, "the native kernels are the path under test"
    model = loaded.model
    rng = np.random.default_rng(prefix * 100 + block)
    tokens = [int(t) for t in rng.integers(3, model.args.vocab_size, size=prefix + block)]

    stepped = model.make_caches()
    _prefill(model, stepped, tokens[:prefix])
    steps = []
    for t in tokens[prefix:]:
        steps.append(model.logits(model.hidden(mx.array([[t]]), stepped))[0, -1])
        mx.eval(steps[-1], [c.arrays() for c in stepped])

    blocked = model.make_caches()
    _prefill(model, blocked, tokens[:prefix])
    rows = model.logits(model.hidden(mx.array([tokens[prefix:]]), blocked))[0]
    mx.eval(rows)
    np.testing.assert_array_equal(np.array(rows), np.array(mx.stack(steps)))

    # ... and both leave the same state: the next decode step agrees too.
    nxt = mx.array([[tokens[0]]])
    a = model.logits(model.hidden(nxt, stepped))[0, -1]
    b = model.logits(model.hidden(nxt, blocked))[0, -1]
    np.testing.assert_array_equal(np.array(a), np.array(b))
