"""Logits parity with independent references on identical tiny random weights.

For each architecture row of TINY_CONFIGS: Arbor's full-sequence logits, and its logits from a
chunked prefill followed by token-by-token decode through the cache, must match Hugging Face
transformers (CPU torch, float32; rows it can load) and mlx-lm within 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from backend.weights.loading import load_model
from tests.fixtures.references import mlx_lm_logits, random_tokens, transformers_logits
from tests.fixtures.tiny_models import TINY_CONFIGS, transformers_reads

TOLERANCE = 1e-4
SEQ_LEN = 40
CHUNKS = (7, 13)
# mlx-lm's llama module ignores `sliding_window`, so it is a reference only for the positions
# before the window starts to cut (transformers implements the window and checks the rest).
MLX_LM_VALID_POSITIONS = {"mistral-window": 8}  # prefill 7 + 13 tokens, then decode the remaining 20 one at a time


def _arbor_full(folder, tokens: np.ndarray) -> np.ndarray:
    model = load_model(folder, dtype="float32").model
    return np.array(model(mx.array(tokens), model.make_caches()))


def _arbor_incremental(folder, tokens: np.ndarray) -> np.ndarray:
    model = load_model(folder, dtype="float32").model
    caches = model.make_caches()
    outs, pos = [], 0
    for size in CHUNKS:
        outs.append(model(mx.array(tokens[:, pos:pos + size]), caches))
        pos += size
    while pos < tokens.shape[1]:
        outs.append(model(mx.array(tokens[:, pos:pos + 1]), caches))
        pos += 1
    return np.array(mx.concatenate(outs, axis=1))


@pytest.mark.parametrize("case", sorted(TINY_CONFIGS))
def test_logits_match_transformers_and_mlx_lm(case, tiny_model_dir):
    folder = tiny_model_dir(case)
    tokens = random_tokens(SEQ_LEN)
    full = _arbor_full(folder, tokens)
    incremental = _arbor_incremental(folder, tokens)
    if transformers_reads(case):
        reference = transformers_logits(folder, tokens)
        assert full.shape == reference.shape
        assert np.abs(reference).max() > 0.5  # the check is not vacuous
        assert np.abs(full - reference).max() < TOLERANCE
        assert np.abs(incremental - reference).max() < TOLERANCE
    mlx_lm = mlx_lm_logits(folder, tokens)
    assert full.shape == mlx_lm.shape and np.abs(mlx_lm).max() > 0.5
    upto = MLX_LM_VALID_POSITIONS.get(case, SEQ_LEN)
    assert np.abs(full[:, :upto] - mlx_lm[:, :upto]).max() < TOLERANCE
    assert np.abs(incremental[:, :upto] - mlx_lm[:, :upto]).max() < TOLERANCE
