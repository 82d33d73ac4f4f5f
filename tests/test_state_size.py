"""``state_bytes_per_token`` (what ``arbor models list --verbose`` prints) equals, for every
family, the bytes its caches really add per token: the records the prefix cache would store
for a span of tokens (windows and recurrent states are bounded: they add none)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from backend.models.state_size import state_bytes_per_token
from backend.weights.loading import load_model
from tests.fixtures.tiny_models import TINY_CONFIGS


def measured_bytes_per_token(model, first: int = 20, span: int = 30) -> float:
    """Bytes of the span-kind caches' records for ``span`` tokens after ``first``, per token."""
    caches = model.make_caches()
    tokens = np.random.default_rng(0).integers(3, model.args.vocab_size, (1, first + span))
    mx.eval(model.hidden(mx.array(tokens[:, :first]), caches))
    mx.eval(model.hidden(mx.array(tokens[:, first:]), caches))
    total = 0
    for cache in caches:
        if cache.snapshot_kind == "span":
            snapshot = cache.snapshot(first, first + span)
            total += cache.export_snapshot(snapshot).nbytes
            snapshot.close()
    return total / span


@pytest.mark.parametrize("case", sorted(TINY_CONFIGS))
def test_bytes_per_token_from_the_config_equal_the_caches(case, tiny_model_dir):
    folder = tiny_model_dir(case)
    config = json.loads((folder / "config.json").read_text())
    model = load_model(folder, dtype="float32").model
    assert state_bytes_per_token(config) == measured_bytes_per_token(model) > 0
    assert state_bytes_per_token(config, itemsize=2) * 2 == state_bytes_per_token(config)
