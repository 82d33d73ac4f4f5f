"""A checkpoint whose config ties the embeddings but which ships its own ``lm_head.weight``.

transformers uses the shipped head (it ties only when the checkpoint has none), and so does
mlx-lm's Gemma 3 module; Arbor must agree with them from the first token. (mlx-lm's Llama and
Qwen modules drop the shipped head instead, so they are no reference here.)
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from backend.weights.loading import load_model
from tests.fixtures.tiny_models import write_tiny_model
from tests.fixtures.references import mlx_lm_logits, random_tokens, transformers_logits
from tests.test_parity import SEQ_LEN, TOLERANCE, _arbor_full, _arbor_incremental

#: Families whose mlx-lm module also uses a shipped head.
MLX_LM_USES_SHIPPED_HEAD = {"gemma3"}


def tied_config_with_own_head(folder, case: str):
    """The tiny ``case`` model with ``tie_word_embeddings: true`` and a distinct lm_head."""
    write_tiny_model(folder, case)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["tie_word_embeddings"] = True
    path.write_text(json.dumps(config))
    weights = dict(mx.load(str(folder / "model.safetensors")))
    embedding = weights["model.embed_tokens.weight"]
    head = mx.random.normal(embedding.shape, key=mx.random.key(7)) * 0.08
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    return folder, np.array(embedding), np.array(head)


@pytest.mark.parametrize("case", ["llama-tied", "qwen2", "gemma3"])
def test_shipped_head_wins_over_tied_config(case, tmp_path):
    folder, embedding, head = tied_config_with_own_head(tmp_path / case, case)
    tokens = random_tokens(SEQ_LEN)
    reference = transformers_logits(folder, tokens)
    full = _arbor_full(folder, tokens)
    assert np.abs(full - reference).max() < TOLERANCE
    assert np.abs(_arbor_incremental(folder, tokens) - reference).max() < TOLERANCE
    # Not vacuous: the tied projection gives other logits (the hidden states are the same).
    model = load_model(folder, dtype="float32").model
    hidden = np.array(model.hidden(mx.array(tokens), model.make_caches()))
    assert np.abs(hidden @ head.T - hidden @ embedding.T).max() > 0.5
    if case in MLX_LM_USES_SHIPPED_HEAD:
        assert np.abs(full - mlx_lm_logits(folder, tokens)).max() < TOLERANCE
