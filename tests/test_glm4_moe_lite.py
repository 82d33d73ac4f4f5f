"""GLM-4.7-Flash (``glm4_moe_lite``) beyond the shared tables (parity, row invariance,
speculation and the prefix-cache state machine run its TINY_CONFIGS rows):

* the prefix cache stores the latent: a conversation's stored bytes per token are
  (kv_lora_rank + qk_rope_head_dim) x layers x 4, a fraction of per-head keys and values, and
  ``arbor models list --verbose`` says so;
* greedy replies through the engine (chunked prefill in the expanded form, decode in the
  absorbed form) equal mlx-lm's greedy tokens, in both checkpoint layouts;
* the expanded and absorbed forms agree within float32 rounding on one long write;
* the group-limited router never picks an expert of a dropped group;
* checkpoints: the mlx-community folder stays quantized (per-head matrices included), an
  import quantizing every 2-D weight still loads (``kv_b_proj`` and the router come back to
  float), the prediction layer is dropped, and bad configs are one ``ConfigError``.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

import backend.models.glm4_moe_lite as glm
from backend.api import DoneEvent, GenerateRequest, collect_reply
from backend.engine import Engine
from backend.errors import ConfigError
from backend.memory.budgets import MIB, CacheBudgets, CacheConfig
from backend.models.moe import QuantizedSwitchLinear
from backend.models.state_size import state_bytes_per_token
from backend.weights.loading import load_model
from tests.fixtures.tiny_models import _BASE, TINY_CONFIGS

CASES = ("glm4_moe_lite", "glm4_moe_lite-4bit")


def greedy(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], DoneEvent]:
    return collect_reply(engine.generate(GenerateRequest(prompt_ids=prompt, max_tokens=n,
                                                         ignore_eos=True)))


def mlx_lm_greedy(folder, prompt: list[int], n: int) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as mlx_lm_load

    model, _ = mlx_lm_load(folder)
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return out


def test_the_prefix_cache_stores_the_latent(tiny_model_dir):
    folder = tiny_model_dir("glm4_moe_lite")
    config = json.loads((folder / "config.json").read_text())
    # No device budget: a stored state leaves the device as soon as it costs bytes there (a
    # lazy view of the live caches costs none until another conversation overwrites them).
    engine = Engine.load(str(folder), cache=CacheConfig(CacheBudgets(0, 64 * MIB, 0), None))
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(3, 200, 40)]
    ids, done = greedy(engine, prompt, 8)
    stored_tokens = len(prompt) + len(ids) - 1  # the last reply token is never fed
    greedy(engine, [1] + [int(t) for t in rng.integers(3, 200, 10)], 2)  # another conversation
    stats = engine.cache_stats()
    assert stats.tiers["device"].bytes == 0 and stats.tiers["host"].entries > 0
    per_token = stats.tiers["host"].bytes / stored_tokens
    latent = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * config[
        "num_hidden_layers"] * 4
    assert per_token == latent == state_bytes_per_token(config)
    # Per-head keys and values would take heads x (query head + value head) per layer.
    heads = config["num_attention_heads"] * (config["qk_nope_head_dim"]
                                              + config["qk_rope_head_dim"] + config["v_head_dim"])
    assert per_token == latent < 0.3 * heads * config["num_hidden_layers"] * 4
    # The resumed next turn restores those records and goes on.
    follow = prompt + ids + [7, 8, 9]
    _, done = greedy(engine, follow, 4)
    assert done.cached_by_tier["host"] == len(follow) - 4
    engine.close()


def test_models_list_verbose_prints_bytes_per_token(tiny_model_dir, capsys):
    from desktop.cli import main

    for case, name in (("glm4_moe_lite", "tiny-glm"), ("llama", "tiny-llama")):
        assert main(["models", "import", str(tiny_model_dir(case)), "--name", name]) == 0
    capsys.readouterr()
    assert main(["models", "list", "--verbose"]) == 0
    out = capsys.readouterr().out.splitlines()
    line = out[out.index(next(row for row in out if row.startswith("tiny-glm"))) + 1]
    assert line.strip() == "cache per token: 960 bytes (float32; 0.9 KiB)"  # (64 + 16) x 3 x 4
    line = out[out.index(next(row for row in out if row.startswith("tiny-llama"))) + 1]
    assert "cache per token: 768 bytes" in line  # 2 x 2 heads x 16 x 3 layers x 4
    assert main(["models", "list"]) == 0
    assert "cache per token" not in capsys.readouterr().out


@pytest.mark.parametrize("case", CASES)
def test_greedy_replies_equal_mlx_lm(case, tiny_model_dir):
    folder = tiny_model_dir(case)
    rng = np.random.default_rng(9)
    engine = Engine.load(str(folder), cache=CacheConfig.memory_only())
    for length in (5, 60):  # one absorbed write, one expanded prefill
        prompt = [int(t) for t in rng.integers(3, 250, length)]
        ids, _ = greedy(engine, prompt, 12)
        assert ids == mlx_lm_greedy(folder, prompt, 12), f"prompt of {length}"


@pytest.mark.parametrize("case", CASES)
def test_expanded_and_absorbed_forms_agree(case, tiny_model_dir, monkeypatch):
    model = load_model(tiny_model_dir(case)).model
    tokens = mx.array(np.random.default_rng(3).integers(3, 250, (1, 70)))
    prefix = model.make_caches()
    mx.eval(model.hidden(tokens[:, :20], prefix))

    def logits_after_prefix() -> np.ndarray:
        caches = model.make_caches()
        mx.eval(model.hidden(tokens[:, :20], caches))
        return np.array(model(tokens[:, 20:], caches))  # 50 queries against 70 positions

    expanded = logits_after_prefix()
    monkeypatch.setattr(glm, "ABSORBED_MAX_QUERIES", 1 << 20)
    absorbed = logits_after_prefix()
    assert np.abs(expanded - absorbed).max() < 1e-4
    assert (expanded.argmax(-1) == absorbed.argmax(-1)).all()
    assert np.abs(expanded).max() > 0.5


def test_the_router_keeps_to_the_best_groups():
    spec = {**_BASE, **TINY_CONFIGS["glm4_moe_lite"], "n_routed_experts": 8, "n_group": 4,
            "topk_group": 2, "num_experts_per_tok": 3}
    args = glm.ModelArgs.from_config(spec)
    router = glm.GroupLimitedRouter(args)
    rng = np.random.default_rng(0)
    router.weight = mx.array(rng.normal(0, 1, (8, args.hidden_size)).astype(np.float32))
    # Negative biases: every choice score below 0, so a dropped group must lose to any kept
    # expert whatever it is replaced by (zeroing it would let it win).
    router.e_score_correction_bias = mx.array(rng.normal(-1.5, 0.3, 8).astype(np.float32))
    x = mx.array(rng.normal(0, 1, (1, 50, args.hidden_size)).astype(np.float32))
    top, weights = router(x)
    scores = 1 / (1 + np.exp(-(np.array(x, np.float64) @ np.array(router.weight, np.float64).T)))
    choice = scores + np.array(router.e_score_correction_bias, np.float64)
    for t in range(50):
        groups = choice[0, t].reshape(4, 2)
        group_scores = np.sort(groups, axis=-1)[:, -2:].sum(-1)
        kept = set(np.argsort(-group_scores)[:2])
        masked = np.where(np.repeat([g in kept for g in range(4)], 2), choice[0, t], -np.inf)
        want = set(np.argsort(-masked)[:3])
        picked = [int(e) for e in np.array(top[0, t])]
        assert set(picked) == want and all(e // 2 in kept for e in picked)
        w = scores[0, t, picked]
        np.testing.assert_allclose(np.array(weights[0, t]), w / w.sum() * 1.8, rtol=1e-5)


def test_the_mlx_community_folder_stays_quantized(tiny_model_dir):
    loaded = load_model(tiny_model_dir("glm4_moe_lite-4bit"))
    assert loaded.quantization is not None and loaded.cpu_kernels
    attn = loaded.model.model.layers[1].self_attn
    assert isinstance(attn.embed_q, QuantizedSwitchLinear) and attn.embed_q.native_ops
    assert isinstance(attn.unembed_out, QuantizedSwitchLinear)
    assert attn.stacked is not None  # q_a_proj and kv_a_proj_with_mqa: one kernel product


def test_an_import_quantizing_every_matrix_loads(tiny_model_dir, tmp_path):
    from backend.weights.store import import_hf_folder

    folder = import_hf_folder(tiny_model_dir("glm4_moe_lite"), tmp_path / "q4", quantize=4)
    names = json.loads((folder / "config.json").read_text())["quantization"]
    assert "model.layers.1.self_attn.kv_b_proj" in json.dumps(names) or names.get("bits") == 4
    model = load_model(folder).model
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attn.embed_q.weight.dtype == mx.float32 and moe.gate.weight.dtype == mx.float32
    reference = load_model(tiny_model_dir("glm4_moe_lite")).model
    tokens = mx.array([[5, 9, 30, 41, 7, 7, 100]])
    got = np.array(model(tokens, model.make_caches()))
    want = np.array(reference(tokens, reference.make_caches()))
    assert np.isfinite(got).all() and np.abs(got - want).max() < 0.5 * np.abs(want).max()


def test_the_prediction_layer_is_dropped(tiny_model_dir, tmp_path):
    from safetensors.numpy import load_file

    folder = tiny_model_dir("glm4_moe_lite")
    layers = TINY_CONFIGS["glm4_moe_lite"].get("num_hidden_layers", _BASE["num_hidden_layers"])
    shipped = load_file(folder / "model.safetensors")
    assert any(k.startswith(f"model.layers.{layers}.") for k in shipped)
    copy = shutil.copytree(folder, tmp_path / "no-mtp")
    from safetensors.numpy import save_file

    save_file({k: v for k, v in shipped.items() if not k.startswith(f"model.layers.{layers}.")},
              copy / "model.safetensors", metadata={"format": "pt"})
    tokens = mx.array([[3, 4, 5, 6]])
    with_layer, without = load_model(folder).model, load_model(copy).model
    assert mx.array_equal(with_layer(tokens, with_layer.make_caches()),
                          without(tokens, without.make_caches())).item()


@pytest.mark.parametrize("change,message", [
    ({"n_group": 3}, "do not split into n_group 3"),
    ({"topk_group": 3}, "topk_group 3"),
    ({"num_experts_per_tok": 5}, "more than the 1 kept groups hold"),
    ({"topk_method": "greedy"}, "unsupported topk_method 'greedy'"),
    ({"scoring_func": "softmax"}, "unsupported scoring_func"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim 15 is odd"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ({"kv_lora_rank": 0}, "kv_lora_rank must be a positive integer"),
])
def test_bad_configs_are_one_config_error(change, message):
    spec = {**_BASE, **TINY_CONFIGS["glm4_moe_lite"], **change}
    with pytest.raises(ConfigError, match=message):
        glm.ModelArgs.from_config(spec)
