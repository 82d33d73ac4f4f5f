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
from tests.fixtures.byte_tokenizer import VOCAB_SIZE
from tests.fixtures.tiny_models import TINY_CONFIGS, transformers_reads

TOLERANCE = 1e-4
SEQ_LEN = 40
CHUNKS = (7, 13)
# mlx-lm's llama module ignores `sliding_window`, so it is a reference only for the positions
# before the window starts to cut (transformers implements the window and checks the rest).
MLX_LM_VALID_POSITIONS = {"mistral-window": 8}  # prefill 7 + 13 tokens, then decode the remaining 20 one at a time


def _tokens(vocab: int) -> np.ndarray:
    return np.random.default_rng(1).integers(0, vocab - 1, size=(1, SEQ_LEN))


def _torch_logits(folder, tokens: np.ndarray) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _mlx_lm_logits(folder, tokens: np.ndarray) -> np.ndarray:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as mlx_lm_load

    model, _ = mlx_lm_load(folder)
    logits = model(mx.array(tokens), cache=make_prompt_cache(model))
    return np.array(logits.astype(mx.float32))


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
    tokens = _tokens(VOCAB_SIZE)
    full = _arbor_full(folder, tokens)
    incremental = _arbor_incremental(folder, tokens)
    if transformers_reads(case):
        reference = _torch_logits(folder, tokens)
        assert full.shape == reference.shape
        assert np.abs(reference).max() > 0.5  # the check is not vacuous
        assert np.abs(full - reference).max() < TOLERANCE
        assert np.abs(incremental - reference).max() < TOLERANCE
    mlx_lm = _mlx_lm_logits(folder, tokens)
    assert full.shape == mlx_lm.shape and np.abs(mlx_lm).max() > 0.5
    upto = MLX_LM_VALID_POSITIONS.get(case, SEQ_LEN)
    assert np.abs(full[:, :upto] - mlx_lm[:, :upto]).max() < TOLERANCE
    assert np.abs(incremental[:, :upto] - mlx_lm[:, :upto]).max() < TOLERANCE
