"""Loading HF folders: sharded safetensors, mlx-community quantized layouts, dtypes, RoPE keys."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from backend.errors import ModelLoadError
from backend.models.rope import rope_settings
from backend.weights.loading import load_model

TOKENS = mx.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]])


def logits_of(folder, **kw) -> np.ndarray:
    model = load_model(folder, **kw).model
    return np.array(model(TOKENS, model.make_caches()).astype(mx.float32))


def mlx_lm_logits(folder) -> np.ndarray:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as mlx_lm_load

    model, _ = mlx_lm_load(folder)
    return np.array(model(TOKENS, cache=make_prompt_cache(model)).astype(mx.float32))


def write_quantized(src, dest, bits: int, group: int, scale_dtype=mx.bfloat16):
    """The mlx-community layout: packed uint32 weights, (here bf16) scales and biases."""
    shutil.copytree(src, dest)
    weights = mx.load(str(src / "model.safetensors"))
    out = {}
    for name, w in weights.items():
        if name.endswith(".weight") and w.ndim == 2 and w.shape[-1] % group == 0:
            q, s, b = mx.quantize(w, group_size=group, bits=bits)
            prefix = name[: -len(".weight")]
            out[name], out[prefix + ".scales"], out[prefix + ".biases"] = \
                q, s.astype(scale_dtype), b.astype(scale_dtype)
        else:
            out[name] = w
    mx.save_safetensors(str(dest / "model.safetensors"), out)
    config = json.loads((dest / "config.json").read_text())
    config["quantization"] = {"group_size": group, "bits": bits}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 64), (8, 32)])
def test_quantized_folder_loads_as_is_and_matches_mlx_lm(tiny_model_dir, tmp_path, bits, group,
                                                         monkeypatch):
    folder = write_quantized(tiny_model_dir("llama"), tmp_path / "q", bits, group)
    reference = mlx_lm_logits(folder)
    # Without the native kernels the CPU path dequantizes to float32 at load time...
    dequantized = logits_of(folder, cpu_kernels=False)
    assert load_model(folder, cpu_kernels=False).quantization is None
    # ...with them (or over the size limit) the weights stay quantized.
    monkeypatch.setenv("ARBOR_DEQUANTIZE_LIMIT", "0")
    loaded = load_model(folder, cpu_kernels=False)
    assert loaded.quantization is not None
    kept = logits_of(folder, cpu_kernels=False)
    with_kernels = logits_of(folder)
    # mlx-lm computes with bf16 scales, we with their exact float32 values.
    assert np.abs(dequantized - reference).max() < 0.05
    assert np.abs(kept - dequantized).max() < 1e-3
    assert np.abs(with_kernels - dequantized).max() < 1e-3
    assert np.abs(reference).max() > 0.5


def test_quantized_dequantize_is_exact_against_float_reference(tiny_model_dir, tmp_path):
    folder = write_quantized(tiny_model_dir("llama"), tmp_path / "q", 8, 32, mx.float32)
    loaded = load_model(folder, cpu_kernels=False)
    params = dict(tree_flatten(loaded.model.parameters()))
    raw = mx.load(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj"
    expected = mx.dequantize(raw[name + ".weight"], raw[name + ".scales"],
                             raw[name + ".biases"], 32, 8)
    assert mx.array_equal(params[name + ".weight"], expected)


def test_sharded_checkpoint_with_index(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    dest = tmp_path / "sharded"
    shutil.copytree(src, dest)
    weights = mx.load(str(dest / "model.safetensors"))
    (dest / "model.safetensors").unlink()
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, keys in halves.items():
        mx.save_safetensors(str(dest / shard), {k: weights[k] for k in keys})
        weight_map.update({k: shard for k in keys})
    (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert np.array_equal(logits_of(dest), logits_of(src))
    (dest / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors named in .* is missing"):
        load_model(dest)


def test_missing_weight_is_a_clear_error(tiny_model_dir, tmp_path):
    dest = tmp_path / "partial"
    shutil.copytree(tiny_model_dir("llama"), dest)
    weights = mx.load(str(dest / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    mx.save_safetensors(str(dest / "model.safetensors"), weights)
    with pytest.raises(ModelLoadError, match="down_proj"):
        load_model(dest)


def test_dtype_override(tiny_model_dir):
    folder = tiny_model_dir("llama")
    assert load_model(folder).dtype == mx.float32  # CPU default
    bf16 = load_model(folder, dtype="bfloat16")
    assert bf16.dtype == mx.bfloat16
    assert bf16.model.model.layers[0].mlp.up_proj.weight.dtype == mx.bfloat16
    assert np.abs(logits_of(folder, dtype="bfloat16") - logits_of(folder)).max() < 0.1
    with pytest.raises(ModelLoadError, match="int3"):
        load_model(folder, dtype="int3")


def test_rope_settings_accept_old_and_new_config_layouts():
    old = {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    new = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}
    assert rope_settings(old) == rope_settings(new)
    assert rope_settings(new).theta == 5e5 and rope_settings(new).kind == "llama3"
    assert rope_settings({}).kind == "default"
    with pytest.raises(ModelLoadError, match="longrope"):
        rope_settings({"rope_scaling": {"rope_type": "longrope"}})
