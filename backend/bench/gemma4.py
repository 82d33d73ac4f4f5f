"""Random Gemma 4 checkpoints for the model benchmark (``bench/hybrid.py`` runs them).

Two families with the published models' head sizes (sliding heads of 256, global heads of 512
with proportional RoPE over a quarter of them) at a width and depth of the caller's choosing:

* ``gemma4``: the small models' layout (E2B / E4B): one kv head, windows of 512, per-layer
  inputs of 256, the last 40% of the layers reading earlier layers' keys with double-wide MLPs;
* ``gemma4_moe``: the 26B-A4B layout: keys as values on global layers, a routed MoE of 32
  experts (top 4) beside every dense MLP, windows of 1024, no per-layer inputs, no sharing.

Both are written as the published multimodal checkpoints are (``model.language_model.*``,
tied embeddings, the experts fused per layer), in float32; tensor shapes come from Arbor's own
module tree (mlx-lm refuses any that differ from its own when it loads the folder).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

#: Families this module writes, and what each looks like.
FAMILIES = {
    "gemma4": "Gemma 4 E2B-shaped: 4 sliding : 1 global, 40% KV-shared layers, per-layer inputs",
    "gemma4_moe": "Gemma 4 26B-A4B-shaped: 5 sliding : 1 global, keys as values, 32 experts "
                  "top-4 beside each dense MLP",
}

#: Depth when not given: enough for a few global layers and (``gemma4``) shared ones.
DEFAULT_LAYERS = 10

_SLIDE, _FULL = "sliding_attention", "full_attention"


def model_config(hidden_size: int, num_layers: int, vocab_size: int = 8192,
                 family: str = "gemma4") -> dict:
    """The multimodal ``config.json`` of a random ``family`` checkpoint (module docstring):
    attention heads of 256 (global: 512) as many as ``hidden_size / 256``."""
    moe = family == "gemma4_moe"
    heads = max(1, hidden_size // 256)
    pattern = min(6 if moe else 5, max(2, num_layers // 2))  # shallow checkpoints: more global
    layer_types = [_SLIDE if (i + 1) % pattern else _FULL for i in range(num_layers)]
    layer_types[-1] = _FULL
    shared = 0 if moe else _shared_layers(layer_types)
    text = {
        "model_type": "gemma4_text", "hidden_size": hidden_size,
        "num_hidden_layers": num_layers, "layer_types": layer_types,
        "num_attention_heads": heads, "head_dim": 256,
        "global_head_dim": 512, "num_key_value_heads": 2 if moe and heads % 2 == 0 else 1,
        "num_global_key_value_heads": 1 if moe else None, "attention_k_eq_v": moe,
        "intermediate_size": hidden_size if moe else 4 * hidden_size,
        "use_double_wide_mlp": not moe, "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": 0 if moe else 256, "vocab_size_per_layer_input": vocab_size,
        "enable_moe_block": moe, "num_experts": 32 if moe else None,
        "top_k_experts": 4 if moe else None, "moe_intermediate_size": hidden_size // 2 if moe
        else None, "sliding_window": 1024 if moe else 512, "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size, "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rope_parameters": {_SLIDE: {"rope_type": "default", "rope_theta": 10000.0},
                            _FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1000000.0}},
    }
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "text_config": text, "vocab_size": vocab_size, "tie_word_embeddings": True,
            "torch_dtype": "float32"}


def _shared_layers(layer_types: list[str]) -> int:
    """Up to 40% of the layers, as many as leave a computing layer of each type before them."""
    n = len(layer_types)
    for shared in range(2 * n // 5, 0, -1):
        if set(layer_types[:n - shared]) >= set(layer_types[n - shared:]):
            return shared
    return 0


def write_random_checkpoint(folder: Path, config: dict, seed: int = 0) -> Path:
    """Random float32 weights for ``config`` in the published layout (module docstring):
    matrices scaled by ``inputs ** -0.5``, norms and scales near 1."""
    from backend.models import gemma4

    rng = np.random.default_rng(seed)
    model = gemma4.Model(gemma4.ModelArgs.from_config(config))
    tensors: dict[str, np.ndarray] = {}
    for name, param in tree_flatten(model.parameters()):
        shape = tuple(param.shape)
        if len(shape) == 1:  # norm weights, layer and router scales
            value = (1 + rng.normal(0.0, 0.05, shape)).astype(np.float32)
        elif name == "model.embed_tokens.weight" or "embed_tokens_per_layer" in name:
            value = rng.normal(0.0, 1.0, shape).astype(np.float32)
        else:
            value = rng.normal(0.0, shape[-1] ** -0.5, shape).astype(np.float32)
        tensors[name] = value
    out = {}
    for name, value in tensors.items():
        if ".experts.switch_glu." in name:
            continue  # fused below
        out["model.language_model." + name.removeprefix("model.")] = value
    for i in range(config["text_config"]["num_hidden_layers"]):
        stacked = f"model.layers.{i}.experts.switch_glu"
        if f"{stacked}.gate_proj.weight" in tensors:
            experts = f"model.language_model.layers.{i}.experts"
            out[f"{experts}.gate_up_proj"] = np.concatenate(
                [tensors[f"{stacked}.gate_proj.weight"], tensors[f"{stacked}.up_proj.weight"]],
                axis=1)  # (experts, 2 * intermediate, hidden)
            out[f"{experts}.down_proj"] = tensors[f"{stacked}.down_proj.weight"]
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k: mx.array(v) for k, v in out.items()}, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
