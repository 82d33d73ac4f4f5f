"""Gemma 4 (``gemma4_text``, ``gemma4``) beyond the shared tables.

The ``gemma4*`` rows of ``TINY_CONFIGS`` (built with mlx-lm's classes: a text-only and two
multimodal Hugging Face checkpoints, two mlx-community 4-bit folders; the small models' layout
with KV-shared layers and per-layer inputs, and the MoE layout with keys as values) already run
through test_parity (logits, chunked prefill + decode with windows of 8 that wrap, vs
transformers and mlx-lm within 1e-4), test_row_invariance, test_prefix_cache_models (every
tier, bitwise), test_speculative and test_architecture_contract. This file adds:

1. The KV-shared layers store nothing: a conversation's bytes in the prefix cache are those of
   the layers that compute keys and values, measured against the shapes the config gives them;
   ``arbor models list --verbose`` counts those layers only.
2. Greedy replies through the engine equal mlx-lm's greedy tokens (log-probabilities within
   1e-4), with and without the native CPU kernels.
3. The checkpoint's parts: the other modalities left out with one logged line, 8-bit routers,
   stacked projections, and configs as transformers 5 writes them (``per_layer_config``).
"""

from __future__ import annotations

import json
import logging
import random

import mlx.core as mx
import numpy as np
import pytest

from backend.engine import Engine
from backend.errors import ConfigError
from backend.memory.budgets import CacheBudgets, CacheConfig
from backend.models import gemma4
from backend.weights.loading import load_model
from tests.fixtures.references import mlx_lm_greedy, random_tokens
from tests.fixtures.tiny_gemma4 import gemma4_config
from tests.fixtures.tiny_models import _BASE, TINY_CONFIGS
from tests.test_prefix_cache_models import run as _reply

TOLERANCE = 1e-4
ROWS = ("gemma4_text", "gemma4", "gemma4-moe", "gemma4-4bit", "gemma4-moe-4bit")
MIB = 1 << 20


# -- 1. shared keys are stored once -----------------------------------------------------------

def test_the_prefix_cache_stores_only_the_source_layers(tiny_model_dir):
    """A three-turn conversation, then another that pushes its states off the live caches onto
    the host tier (exact array bytes). Every stored node holds one snapshot per layer that
    computes keys (4 of the 6 layers), and the host tier's bytes are exactly what those
    layers' shapes give: a full-attention layer its keys and values of the node's tokens, a
    sliding one the window that ends at the node."""
    folder = tiny_model_dir("gemma4")
    text = json.loads((folder / "config.json").read_text())["text_config"]
    layers, shared = text["num_hidden_layers"], text["num_kv_shared_layers"]
    assert shared > 0  # the case is real
    computing = text["layer_types"][:layers - shared]
    float32 = 4
    per_token = {  # keys + values, per position, of one layer of each type
        "sliding_attention": 2 * text["num_key_value_heads"] * text["head_dim"] * float32,
        "full_attention": 2 * text["num_key_value_heads"] * text["global_head_dim"] * float32}
    window = text["sliding_window"]

    engine = Engine.load(str(folder), cache=CacheConfig(CacheBudgets(0, 64 * MIB, 0), None),
                         prefill_chunk=16)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 200) for _ in range(30)]
    for _ in range(3):
        ids, _, _ = _reply(engine, prompt, 5)
        prompt = prompt + ids + [rng.randrange(3, 200) for _ in range(4)]
    _reply(engine, [7, 8, 9], 2)  # another conversation: the first one's states leave the live caches
    expected, on_host = 0, []
    for node in engine.prefix.trie.nodes():
        if node.data is None or not node.data.on_host:
            continue
        on_host.append(node)
        assert len(node.data.layers) == len(computing), "one snapshot per computing layer"
        for kind, has_state in zip(computing, node.data.layers):
            if has_state:
                held = node.end - (node.start if kind == "full_attention"
                                   else max(0, node.end - window + 1))
                expected += held * per_token[kind]
    assert sum(node.end - node.start for node in on_host) >= 40  # most of the conversation
    host = engine.cache_stats().tiers["host"].bytes
    assert host == expected, (host, expected)
    engine.close()


def test_models_list_verbose_counts_only_the_source_layers(tiny_model_dir, capsys):
    """The tiny KV-shared model: of its two global layers only layer 2 computes keys (layer 5
    reads them), so a token costs one global layer's keys and values: 2 x 2 heads x 32 x 4."""
    from desktop.cli import main

    assert main(["models", "import", str(tiny_model_dir("gemma4")), "--name", "tiny-g4"]) == 0
    capsys.readouterr()
    assert main(["models", "list", "--verbose"]) == 0
    out = capsys.readouterr().out.splitlines()
    line = out[out.index(next(row for row in out if row.startswith("tiny-g4"))) + 1]
    assert line.strip() == "cache per token: 512 bytes (float32; 0.5 KiB)"


# -- 2. greedy replies equal mlx-lm's ---------------------------------------------------------

def _plain_mlx_greedy(folder, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding of the model on plain MLX ops (no native kernels): 16-token prefill
    chunks, then one token at a time through its caches."""
    model = load_model(folder, cpu_kernels=False).model
    caches = model.make_caches()
    for start in range(0, len(prompt) - 1, 16):
        model.hidden(mx.array([prompt[start:min(start + 16, len(prompt) - 1)]]), caches)
    token, ids, logprobs = prompt[-1], [], []
    for _ in range(n):
        logits = model(mx.array([[token]]), caches)[0, -1]
        token = int(mx.argmax(logits))
        ids.append(token)
        logprobs.append(float((logits - mx.logsumexp(logits))[token]))
    return ids, logprobs


@pytest.mark.parametrize("case", ROWS)
def test_greedy_reply_equals_mlx_lm(case, tiny_model_dir, native_kernels):
    """A 60-token prompt prefilled in 16-token chunks (every window wraps), 24 greedy tokens:
    through the engine on the native kernels, and on plain MLX ops."""
    folder = tiny_model_dir(case)
    prompt = [int(t) for t in random_tokens(60, seed=5)[0]]
    want_ids, want_logprobs = mlx_lm_greedy(folder, prompt, 24)
    engine = Engine.load(str(folder), cache=CacheConfig.memory_only(), prefill_chunk=16)
    ids, logprobs, _ = _reply(engine, prompt, 24)
    engine.close()
    plain_ids, plain_logprobs = _plain_mlx_greedy(folder, prompt, 24)
    for got_ids, got_logprobs in ((ids, logprobs), (plain_ids, plain_logprobs)):
        assert got_ids == want_ids
        assert np.abs(np.array(got_logprobs) - np.array(want_logprobs)).max() < TOLERANCE


# -- 3. the checkpoint's parts ---------------------------------------------------------------

def test_other_modalities_are_left_out_with_one_line(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger=gemma4.log.name):
        load_model(tiny_model_dir("gemma4"))
    lines = [r.getMessage() for r in caplog.records if r.name == gemma4.log.name]
    assert len(lines) == 1 and "images and audio are not supported" in lines[0], lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=gemma4.log.name):
        load_model(tiny_model_dir("gemma4_text"))  # a text checkpoint has nothing to leave out
    assert not [r for r in caplog.records if r.name == gemma4.log.name]


def test_shared_layers_have_no_key_projections_and_read_their_source(tiny_model_dir):
    model = load_model(tiny_model_dir("gemma4"), cpu_kernels=False).model
    layers = model.model.layers
    assert [layer.kv_source for layer in layers] == [None, None, None, None, 3, 2]
    assert [layer.cache_slot for layer in layers] == [0, 1, 2, 3, None, None]
    for layer in layers[4:]:
        assert "k_proj" not in layer.self_attn and "v_proj" not in layer.self_attn
        assert layer.mlp.up_proj.weight.shape[0] == 2 * 128  # double-wide
    assert layers[3].mlp.up_proj.weight.shape[0] == 128
    caches = model.make_caches()
    assert [type(c).__name__ for c in caches] == ["RotatingKVCache", "RotatingKVCache",
                                                  "KVCache", "RotatingKVCache"]


def test_keys_as_values_and_8_bit_routers(tiny_model_dir, native_kernels):
    """The MoE layout: global layers have one projection for keys and values (stacked with the
    queries on the kernels); mlx-lm's 8-bit routers load as 8-bit layers."""
    model = load_model(tiny_model_dir("gemma4-moe-4bit")).model
    sliding, full = model.model.layers[0], model.model.layers[1]
    assert "v_proj" not in full.self_attn and full.self_attn.num_kv_heads == 1
    assert len(full.self_attn.stacked.layers) == 2 and len(sliding.self_attn.stacked.layers) == 3
    assert full.router.proj.bits == 8 and full.mlp.up_proj.bits == 4
    assert full.experts.switch_glu.up_proj.bits == 4


def test_configs_as_transformers_writes_them_read_alike(tmp_path):
    """transformers 5 saves the global layers' head size and kv heads as ``per_layer_config``
    (by layer index) instead of ``global_head_dim`` / ``num_global_key_value_heads``."""
    from transformers import Gemma4TextConfig

    for case in ("gemma4_text", "gemma4-moe"):
        text = gemma4_config({**_BASE, **TINY_CONFIGS[case]})
        text = text.get("text_config", text)
        Gemma4TextConfig(**text).save_pretrained(tmp_path / case)
        saved = json.loads((tmp_path / case / "config.json").read_text())
        assert "per_layer_config" in saved and "global_head_dim" not in saved
        assert gemma4.ModelArgs.from_config(saved) == gemma4.ModelArgs.from_config(text)


@pytest.mark.parametrize("change,needle", [
    ({"num_kv_shared_layers": 6}, "leaves no layer"),
    ({"layer_types": ["full_attention"] * 4 + ["sliding_attention", "full_attention"]},
     "layer 4 shares the keys of an earlier sliding_attention layer"),
    ({"enable_moe_block": True}, "enable_moe_block needs num_experts"),
    ({"use_bidirectional_attention": "vision"}, "bidirectional"),
    ({"rope_parameters": {"full_attention": {"rope_type": "proportional",
                                              "partial_rotary_factor": 1.5}}},
     "partial_rotary_factor"),
    ({"num_global_key_value_heads": 3}, "num_global_key_value_heads 3"),
])
def test_bad_configs_are_one_named_error(change, needle):
    config = {**gemma4_config({**_BASE, **TINY_CONFIGS["gemma4_text"]}), **change}
    with pytest.raises(ConfigError, match=needle):
        gemma4.ModelArgs.from_config(config)
