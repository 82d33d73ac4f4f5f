"""Qwen3.5 / Qwen3.6 (``qwen3_5``, ``qwen3_5_moe``) beyond the shared tables.

The ``qwen3_5*`` rows of ``TINY_CONFIGS`` (Hugging Face multimodal checkpoints with an MTP head
and a vision tower; mlx-community 4-bit folders; all built with mlx-lm's classes) already run
through test_parity (logits, chunked prefill + decode, vs transformers and mlx-lm within 1e-4),
test_row_invariance, test_prefix_cache_models (every tier, bitwise), test_speculative and
test_architecture_contract. This file adds:

1. Long-memory gates (decay ~0.97 per token), 150 tokens so the chunked scan runs several
   chunks, mixed chunk schedules, with and without the native CPU kernels: logits within 1e-4
   of transformers and mlx-lm.
2. Greedy replies through the engine (prefill in 16-token chunks, decode through the caches)
   are mlx-lm's greedy tokens, their log-probabilities within 1e-4, in both layouts.
3. The checkpoint's parts: the MTP head is kept (a MoE head's one-tensor-per-expert weights
   stacked), the vision tower is left out with one logged line, mlx-community per-module
   quantization (8-bit routers) applies, projections quantized differently still load, and
   the config's nested and flat forms read alike.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from mlx.utils import tree_flatten

from backend.api import GenerateRequest, TokenEvent
from backend.engine import Engine
from backend.errors import ConfigError
from backend.memory.budgets import CacheConfig
from backend.models import qwen3_5
from backend.weights.loading import load_model
from tests.fixtures.references import (
    chunked_logits,
    give_slow_gates,
    mlx_lm_greedy,
    mlx_lm_logits,
    random_tokens,
    transformers_logits,
)
from tests.fixtures.tiny_models import _BASE, TINY_CONFIGS, write_tiny_model
from tests.fixtures.tiny_qwen3_5 import qwen3_5_config, write_qwen3_5

TOLERANCE = 1e-4
ROWS = ("qwen3_5", "qwen3_5_moe", "qwen3_5-4bit", "qwen3_5_moe-4bit")


# -- 1. long-memory parity -------------------------------------------------------------------

@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def long_memory(request, tmp_path_factory):
    """The tiny Hugging Face row with slow gates: decay ~0.97 per token instead of ~0.07."""
    return give_slow_gates(write_tiny_model(
        tmp_path_factory.mktemp(f"{request.param}_long"), request.param, seed=3))


SCHEDULES = [
    [150],
    [70, 1, 1, 9, 62, 1, 6],  # chunked and per-token writes, boundaries off the chunk grid
    [3] * 50,
]


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "mlx"])
def test_long_memory_matches_transformers_and_mlx_lm(long_memory, cpu_kernels, native_kernels):
    tokens = random_tokens(150)
    reference = transformers_logits(long_memory, tokens)
    loaded = load_model(long_memory, dtype="float32", cpu_kernels=cpu_kernels)
    assert loaded.cpu_kernels == cpu_kernels
    assert np.abs(reference).max() > 0.5
    for chunks in SCHEDULES:
        error = np.abs(chunked_logits(loaded.model, tokens, chunks) - reference).max()
        assert error < TOLERANCE, (chunks, error)
    mlx_lm = mlx_lm_logits(long_memory, tokens)
    assert np.abs(chunked_logits(loaded.model, tokens, [150]) - mlx_lm).max() < TOLERANCE


def test_the_kernels_stack_the_four_projections(tiny_model_dir, native_kernels):
    """On the CPU kernels the linear-attention layers' four projections are one product."""
    model = load_model(tiny_model_dir("qwen3_5"), dtype="float32").model
    mixers = [layer.linear_attn for layer in model.model.layers if layer.is_linear]
    assert mixers and all(m.stacked is not None and len(m.stacked.layers) == 4 for m in mixers)


# -- 2. greedy replies equal mlx-lm's --------------------------------------------------------

@pytest.mark.parametrize("case", ROWS)
def test_greedy_reply_equals_mlx_lm(case, tiny_model_dir):
    folder = tiny_model_dir(case)
    prompt = [int(t) for t in random_tokens(60, seed=5)[0]]
    engine = Engine.load(str(folder), cache=CacheConfig.memory_only(), prefill_chunk=16)
    request = GenerateRequest(prompt_ids=prompt, max_tokens=24, ignore_eos=True, logprobs=True)
    events = [e for e in engine.generate(request) if isinstance(e, TokenEvent)]
    ids = [e.token_id for e in events if e.token_id >= 0]
    logprobs = [e.logprob for e in events if e.token_id >= 0]
    want_ids, want_logprobs = mlx_lm_greedy(folder, prompt, 24)
    assert ids == want_ids
    assert np.abs(np.array(logprobs) - np.array(want_logprobs)).max() < TOLERANCE
    engine.close()


# -- 3. the checkpoint's parts ---------------------------------------------------------------

def test_the_mtp_head_is_kept_with_its_experts_stacked(tiny_model_dir):
    from safetensors.numpy import load_file

    for case in ("qwen3_5", "qwen3_5_moe"):
        folder = tiny_model_dir(case)
        model = load_model(folder, dtype="float32", cpu_kernels=False).model
        head = model.draft_head()
        assert head is not None and len(head.layers) == 1, case
        stored = load_file(folder / "model.safetensors")
        loaded = dict(tree_flatten(head.parameters()))
        names = {n for n in stored if n.startswith("mtp.")}
        experts = {n for n in names if ".mlp.experts." in n}
        assert bool(experts) == (case == "qwen3_5_moe")
        for name in names - experts:
            np.testing.assert_array_equal(np.array(loaded[name.removeprefix("mtp.")]),
                                          stored[name], err_msg=name)
        for name in experts:  # mtp.layers.0.mlp.experts.E.PROJ.weight -> switch_mlp, row E
            *layer, _, e, proj, _ = name.removeprefix("mtp.").split(".")
            stacked = loaded[".".join(layer + ["switch_mlp", proj, "weight"])]
            np.testing.assert_array_equal(np.array(stacked[int(e)]), stored[name], err_msg=name)
        # It is the drafter the engine picks by default.
        engine = Engine.load(str(folder), cache=CacheConfig.memory_only())
        assert engine.speculation == "mtp"
        engine.close()


def test_mlx_community_folders_have_no_head(tiny_model_dir):
    for case in ("qwen3_5-4bit", "qwen3_5_moe-4bit"):
        assert load_model(tiny_model_dir(case)).model.draft_head() is None


def test_the_vision_tower_is_left_out_with_one_line(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger=qwen3_5.log.name):
        load_model(tiny_model_dir("qwen3_5"))
    lines = [r.getMessage() for r in caplog.records if r.name == qwen3_5.log.name]
    assert len(lines) == 1 and "images are not supported" in lines[0], lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=qwen3_5.log.name):
        load_model(tiny_model_dir("qwen3_5-4bit"))  # mlx-lm saved no vision tower
    assert not [r for r in caplog.records if r.name == qwen3_5.log.name]


def test_per_module_quantization_of_mlx_community_names_applies(tiny_model_dir,
                                                                native_kernels):
    """mlx-lm quantizes the MoE routers to 8 bits and names them ``language_model.model.*``;
    they load as 8-bit layers of ``model.layers.*``, the rest at 4 bits."""
    folder = tiny_model_dir("qwen3_5_moe-4bit")
    overrides = [k for k in json.loads((folder / "config.json").read_text())["quantization"]
                 if k.startswith("language_model.model.")]
    assert overrides  # the case is real
    model = load_model(folder).model
    mlp = model.model.layers[0].mlp
    assert (mlp.gate.bits, mlp.shared_expert_gate.bits) == (8, 8)
    assert mlp.shared_expert.up_proj.bits == 4
    assert mlp.switch_mlp.up_proj.bits == 4


def test_projections_quantized_differently_still_match_mlx_lm(tmp_path, native_kernels):
    """``in_proj_z`` at 8 bits beside 4-bit ``in_proj_qkv``: the kernels cannot stack them, the
    separate products run instead, with mlx-lm's logits."""
    spec = {**_BASE, **TINY_CONFIGS["qwen3_5-4bit"]}
    folder = write_qwen3_5(tmp_path / "mixed", spec, quant_predicate=lambda path, _: (
        {"group_size": 32, "bits": 8} if path.endswith("in_proj_z") else True))
    loaded = load_model(folder)
    mixers = [layer.linear_attn for layer in loaded.model.model.layers if layer.is_linear]
    assert loaded.cpu_kernels and all(m.stacked is None for m in mixers)
    assert all(m.in_proj_z.bits == 8 and m.in_proj_qkv.bits == 4 for m in mixers)
    tokens = random_tokens(40)
    error = np.abs(chunked_logits(loaded.model, tokens, [7, 13] + [1] * 20)
                   - mlx_lm_logits(folder, tokens)).max()
    assert error < TOLERANCE


def test_nested_and_flat_configs_read_alike():
    spec = {**_BASE, **TINY_CONFIGS["qwen3_5_moe"]}
    nested = qwen3_5_config(spec)
    flat = {**nested["text_config"], "model_type": "qwen3_5_moe"}
    assert qwen3_5.ModelArgs.from_config(nested) == qwen3_5.ModelArgs.from_config(flat)
    args = qwen3_5.ModelArgs.from_config(nested)
    assert args.model_type == "qwen3_5_moe" and args.intermediate_size == 0  # every MLP sparse
    assert args.num_experts == 8 and args.mtp_num_hidden_layers == 1
    assert args.rope.theta == 10000.0 and args.partial_rotary_factor == 0.25


def test_tied_embeddings_named_outside_the_text_config_count():
    config = qwen3_5_config({**_BASE, **TINY_CONFIGS["qwen3_5"]})
    config["text_config"].pop("tie_word_embeddings")
    config["tie_word_embeddings"] = True
    assert qwen3_5.ModelArgs.from_config(config).tie_word_embeddings is True


@pytest.mark.parametrize("change,needle", [
    ({"intermediate_size": None}, "intermediate_size"),  # a dense model needs its MLP width
    ({"attn_output_gate": False}, "attn_output_gate"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
])
def test_bad_configs_name_the_key(change, needle):
    config = qwen3_5_config({**_BASE, **TINY_CONFIGS["qwen3_5"]})
    config["text_config"].update(change)
    with pytest.raises(ConfigError, match=needle):
        qwen3_5.ModelArgs.from_config(config)
