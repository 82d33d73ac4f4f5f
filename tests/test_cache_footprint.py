"""``cache_footprint``: the bytes a model's caches hold per token, read lazily from the caches
it makes, and ``arbor models list --verbose`` printing them.

* For every ``TINY_CONFIGS`` row the lazy figures equal what real caches hold after 40 decoded
  tokens (exported bytes of full-attention caches, live windows, recurrent states).
* Nothing is evaluated: a Gemma 4 config with 5.5 G parameters costs no memory.
* Gemma 4's KV-shared layers add nothing; the command prints each stored model's line.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from backend.caches.kv import KVCache
from backend.caches.recurrent import RecurrentCache
from backend.caches.rotating import RotatingKVCache
from backend.models.footprint import cache_footprint
from backend.weights.loading import load_model
from desktop.cli import main
from tests.fixtures.tiny_models import _BASE, TINY_CONFIGS

STEPS = 40


@pytest.mark.parametrize("case", sorted(TINY_CONFIGS))
def test_lazy_figures_are_what_real_caches_hold(case, tiny_model_dir):
    folder = tiny_model_dir(case)
    loaded = load_model(folder, dtype="float32")
    config = json.loads((folder / "config.json").read_text())
    footprint = cache_footprint(config)
    model = loaded.model
    caches = model.make_caches()
    for token in range(3, 3 + STEPS):  # one token at a time: windows sit at their ring size
        mx.eval(model.hidden(mx.array([[token]]), caches), [c.arrays() for c in caches])
    full = windows = states = 0
    for cache in caches:
        if isinstance(cache, RotatingKVCache):
            windows += cache.nbytes
        elif isinstance(cache, KVCache):
            full += cache.export_snapshot(cache.snapshot(0)).nbytes  # exactly [0, STEPS)
        elif isinstance(cache, RecurrentCache):
            states += cache.nbytes
    assert full == STEPS * footprint.full_per_token > 0
    assert windows == footprint.window_bytes
    assert states == footprint.state_bytes
    assert footprint.caches == len(caches)


def test_nothing_is_evaluated():
    """A Gemma 4 config of real width (hidden 2048, 30 layers, a 262k vocabulary: 5.5 G
    parameters, 22 GB in float32): the probe allocates next to nothing."""
    big = {**_BASE, **TINY_CONFIGS["gemma4_text"], "hidden_size": 2048,
           "intermediate_size": 8192, "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
           "hidden_size_per_layer_input": 256, "num_hidden_layers": 30,
           "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 6,
           "num_kv_shared_layers": 10, "head_dim": 256, "global_head_dim": 512,
           "num_attention_heads": 8, "num_key_value_heads": 1, "sliding_window": 512}
    mx.eval(mx.zeros(1))
    mx.reset_peak_memory()
    footprint = cache_footprint(big)
    assert mx.get_peak_memory() < 16 << 20
    # 4 full and 16 sliding layers compute keys (one kv head each), 10 read theirs.
    assert footprint.caches == 20 and footprint.layers == 30
    assert footprint.full_per_token == 4 * 2 * 512 * 4
    assert footprint.window_bytes == 16 * 2 * 256 * 4 * 512


def test_shared_layers_add_nothing():
    """The same Gemma 4 model with and without its last two layers reading earlier keys: the
    shared form costs the two layers' bytes less per token."""
    spec = {**_BASE, **TINY_CONFIGS["gemma4_text"]}
    shared = cache_footprint(spec)
    own = cache_footprint({**spec, "num_kv_shared_layers": 0})
    # The shared layers are one sliding (16-wide heads) and one full (32-wide heads) layer.
    assert own.full_per_token - shared.full_per_token == 2 * 2 * 32 * 4
    assert own.window_per_token - shared.window_per_token == 2 * 2 * 16 * 4
    assert (shared.caches, own.caches) == (4, 6)


def test_models_list_verbose_prints_bytes_per_token(capsys, tiny_model_dir, tmp_path,
                                                    monkeypatch):
    monkeypatch.setenv("ARBOR_HOME", str(tmp_path / "home"))
    for case in ("gemma4", "llama", "qwen3_next"):
        assert main(["models", "import", str(tiny_model_dir(case)), "--name", f"tiny-{case}"]) == 0
    capsys.readouterr()
    assert main(["models", "list", "--verbose"]) == 0
    lines = capsys.readouterr().out.splitlines()
    cache_line = {lines[i].split()[0]: lines[i + 1].strip() for i in range(0, len(lines), 2)}
    assert cache_line["tiny-gemma4"] == ("cache: 512 B/token full attention, 768 B/token in "
                                         "windows (at most 6.0 KiB); 4 caches for 6 layers")
    assert cache_line["tiny-llama"] == "cache: 768 B/token full attention; 3 caches for 3 layers"
    assert cache_line["tiny-qwen3_next"].endswith("recurrent state; 4 caches for 4 layers")
    assert main(["models", "list"]) == 0
    assert "cache:" not in capsys.readouterr().out
