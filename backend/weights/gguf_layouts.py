"""How llama.cpp's converter lays each architecture out in a GGUF file, and the way back.

For every ``general.architecture`` Arbor imports, this module knows the Hugging Face
``model_type`` it came from, the config (from the ``{arch}.*`` metadata keys, with llama.cpp's own
defaults where its loader hard-codes what the file leaves out), where each ``blk.N.*`` tensor
goes in the Hugging Face layout, and what the converter did to the values, undone here:

* ``llama``: q/k rows permuted for interleaved RoPE (``unpermute_qk_rows``). Whole rows move, so
  packed codes, scales and biases move with them and stay exact.
* ``qwen2``, ``qwen3``: names only.
* ``qwen3moe``: experts stacked per projection (``ffn_{gate,up,down}_exps``, ``(experts, out,
  in)``, or gate and up fused as ``ffn_gate_up_exps``), kept stacked as ``mlp.switch_mlp.*``.
* ``gemma3``: every RMSNorm weight stored as ``1 + w`` (Gemma scales by ``1 + w``; llama.cpp
  by the stored weight): ``w = stored - 1`` in float32, which gives back ``1 + w == stored``
  exactly whenever the stored value is at least 0.5 (always, for weights that came from bf16);
  ``lm_head`` is never written (tied); the attention scale, sliding-window pattern and local
  RoPE base are llama.cpp's fixed Gemma 3 values unless the file names them.
* ``qwen3next``: the same ``1 + w`` norms except the gated norm of the linear-attention layers;
  ``A_log`` stored as ``A = -exp(A_log)`` (back: ``log(-A)``, float64 then float32: within an
  ulp); ``dt_bias`` as ``ssm_dt.bias``; the conv kernel squeezed to ``(channels, kernel)``; the
  linear layers' ``in_proj_qkvz`` split into ``attn_qkv`` (all q, all k, all v) and
  ``attn_gate`` (all z), which are regrouped per key head here (``ssm_in`` in older files keeps
  the Hugging Face order); experts stacked as for ``qwen3moe``, plus the shared expert.
* ``qwen35``, ``qwen35moe`` (Qwen3.5 / 3.6): Qwen3-Next's changes, but the linear layers keep
  Hugging Face's four projections (``attn_qkv`` = ``in_proj_qkv``, ``attn_gate`` = ``in_proj_z``,
  ``ssm_beta`` / ``ssm_alpha`` = ``in_proj_b`` / ``in_proj_a``); where there are more value heads
  than key heads, the converter reorders the value heads from grouped by key head to tiled (head
  ``j * key_heads + g`` holds group ``g``'s ``j``-th): in the v rows of ``in_proj_qkv``, the rows
  of ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, the entries of ``A_log`` and ``dt_bias``, the v
  channels of the conv kernel and the input columns of ``out_proj``, all put back here
  (``_untile_value_heads``: whole rows, or whole quantization groups of columns when a head's
  columns are whole groups; otherwise the exact float32 values). Written with the dense or MoE
  model type; the multi-token-prediction block llama.cpp appends (``nextn_predict_layers``) is
  left out.
* ``gemma4`` (the language model; ``gemma4_text``): norms stored as they are (Gemma 4 scales by
  ``w``); per-layer head counts and MLP widths as arrays (``head_count_kv``: sliding layers' and
  global layers' kv heads; ``feed_forward_length``: double-wide KV-shared layers), the sliding
  layers' head size as ``key_length_swa``; the global layers' proportional partial rotation as
  a ``rope_freqs`` tensor (1 for each rotated pair, 1e30 for the rest), read back into the
  config; keys-as-values from the global layers that carry no ``attn_v``; the router's scale and
  the per-expert scale as ``ffn_gate_inp.scale`` / ``ffn_down_exps.scale``; experts fused as
  ``ffn_gate_up_exps`` (split here).
* ``deepseek2`` as llama.cpp writes GLM-4.7-Flash (``glm4_moe_lite``): multi-head latent
  attention in its absorbed form. The file states the attention as one-kv-head MQA over
  ``kv_lora_rank + rope`` dims (``key_length`` / ``value_length``; the per-head sizes are the
  ``*_mla`` keys) and splits ``kv_b_proj`` per head into ``attn_k_b`` ``(heads, latent, nope)``
  (W_UK transposed) and ``attn_v_b`` ``(heads, v, latent)`` (W_UV): exactly the per-head
  ``embed_q`` / ``unembed_out`` the model runs, so both stay quantized as stacks. Rotary pairs
  stay interleaved (llama.cpp's "normal" rope is the checkpoint's ``rope_interleave``), so no
  rows move. Older files with one ``attn_kv_b`` load it as ``kv_b_proj``. Only the
  sigmoid-scored, bias-corrected router (``exp_probs_b``) without rope scaling is
  GLM-4.7-Flash's layout; a softmax-gated DeepSeek-V2 file or a YaRN-scaled DeepSeek-V3 one
  is refused.

Tensors travel as ``Converted`` (MLX arrays by suffix, with the ``QuantSpec`` of a quantized
weight); ``restore`` undoes one tensor's changes, ``assemble`` the merges and splits that span
several. No file reading here (gguf.py does that).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from backend.errors import ModelLoadError
from backend.weights.quantize import QuantSpec

# ---------------------------------------------------------------------------------------------
# Tensors in transit


@dataclass
class Converted:
    """One tensor in MLX form. A quantized weight (``spec`` set) has ``weight`` (packed codes),
    ``scales`` and ``biases``; anything else has ``value``."""

    arrays: dict[str, mx.array]
    spec: QuantSpec | None = None

    @property
    def rows(self) -> int:
        return next(iter(self.arrays.values())).shape[0]

    @property
    def ndim(self) -> int:
        """The tensor's rank (packed codes keep the rank of the weights they hold)."""
        return next(iter(self.arrays.values())).ndim

    def take_rows(self, order: mx.array | np.ndarray) -> Converted:
        """Rows (the output dimension) in ``order``; every array moves together."""
        index = mx.array(np.asarray(order))
        return Converted({k: v[index] for k, v in self.arrays.items()}, self.spec)

    def take_column_blocks(self, order: np.ndarray, block: int) -> Converted:
        """Input columns moved in whole blocks of ``block`` (``order``: the source block of each
        destination block). Quantized codes, scales and biases move by whole groups when a
        block is whole groups of whole 32-bit words of codes; otherwise the tensor becomes its
        exact float32 values."""
        spec = self.spec
        if spec is None or block % spec.group_size or block * spec.bits % 32:
            values = self.dense() if self.spec is not None else self.arrays["value"]
            blocks = values.reshape(*values.shape[:-1], -1, block)
            return Converted({"value": blocks[..., mx.array(order), :].reshape(values.shape)})
        moved = {}
        for key, value in self.arrays.items():  # every array's last axis holds whole blocks
            per_block = value.shape[-1] // len(order)
            grouped = value.reshape(*value.shape[:-1], len(order), per_block)
            moved[key] = grouped[..., mx.array(order), :].reshape(value.shape)
        return Converted(moved, self.spec)

    def dense(self) -> mx.array:
        """The tensor's values as float32 (dequantized when quantized)."""
        if self.spec is None:
            return self.arrays["value"].astype(mx.float32)
        a = self.arrays  # float16 scales widen first: their products are float32's
        return mx.dequantize(a["weight"], a["scales"].astype(mx.float32),
                             a["biases"].astype(mx.float32), self.spec.group_size,
                             self.spec.bits, stream=mx.cpu)


def concat_rows(parts: list[Converted]) -> Converted:
    """The parts stacked along their rows. Parts quantized alike stay quantized (whole rows of
    codes, scales and biases); otherwise every part is dequantized to float32 first, which is
    exact too, at float32's size."""
    specs = {part.spec for part in parts}
    if len(specs) == 1 and None not in specs:
        keys = parts[0].arrays
        return Converted({k: mx.concatenate([p.arrays[k] for p in parts]) for k in keys},
                         parts[0].spec)
    dtypes = {p.arrays["value"].dtype for p in parts} if specs == {None} else set()
    if len(dtypes) == 1:
        return Converted({"value": mx.concatenate([p.arrays["value"] for p in parts])})
    return Converted({"value": mx.concatenate([p.dense() for p in parts])})


def split_rows(whole: Converted, sizes: list[int], axis: int = 0) -> list[Converted]:
    """``whole`` cut along ``axis`` (0: rows; 1: the rows of stacked experts) into ``sizes``."""
    cuts = list(np.cumsum(sizes)[:-1])
    pieces = {k: mx.split(v, cuts, axis=axis) for k, v in whole.arrays.items()}
    return [Converted({k: pieces[k][i] for k in pieces}, whole.spec) for i in range(len(sizes))]


# ---------------------------------------------------------------------------------------------
# Metadata -> config.json


def number(metadata: Mapping[str, Any], key: str, path: Path, kind: type = int,
           default: float | None = None) -> Any:
    """The positive ``kind`` (int or float) at ``key``, ``default`` when the key is absent (a
    required key has none); a ``ModelLoadError`` naming the key otherwise."""
    if key not in metadata:
        if default is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {key!r}")
        return default
    value = metadata[key]
    accepted = (int, float) if kind is float else int
    if (not isinstance(value, accepted) or isinstance(value, bool) or not math.isfinite(value)
            or value <= 0):
        what = "integer" if kind is int else "number"
        raise ModelLoadError(f"{path}: GGUF metadata {key} must be a positive {what}, "
                             f"got {value!r}")
    return kind(value)


def _llama3_rope_scaling(
    factors: np.ndarray, rope_theta: float, head_dim: int, path: Path
) -> dict[str, Any]:
    """Recover HF's ``"llama3"`` rope_scaling from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores only the per-frequency divisors; HF stores the four parameters they were
    computed from. The factor is the largest divisor; the other three are the values every
    Llama 3.x release uses, and we check that they reproduce the stored divisors exactly rather
    than trust them.
    """
    factor = float(factors.max())
    low, high, original = 1.0, 4.0, 8192
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < original / high,
        1.0,
        np.where(wavelen > original / low, factor, 1.0 / ((1 - smooth) / factor + smooth)),
    )
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-4):
        raise ModelLoadError(f"{path}: unsupported rope frequency factors (rope_freqs) in GGUF")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def _rope_scaling(metadata: Mapping[str, Any], arch: str, path: Path) -> dict[str, Any] | None:
    """HF ``rope_scaling`` for llama.cpp's linear/yarn scaling keys, or ``None``."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none") or not metadata.get(f"{arch}.rope.scaling.factor"):
        return None
    if not isinstance(kind, str):
        raise ModelLoadError(f"{path}: GGUF metadata {arch}.rope.scaling.type must be a string, "
                             f"got {kind!r}")
    factor = number(metadata, f"{arch}.rope.scaling.factor", path, float)
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    original_key = f"{arch}.rope.scaling.original_context_length"
    if metadata.get(original_key):
        scaling["original_max_position_embeddings"] = number(metadata, original_key, path)
    return scaling


def _moe_config(metadata: Mapping[str, Any], arch: str, path: Path) -> dict[str, Any]:
    """The routed experts' keys. llama.cpp normalizes the chosen experts' weights for both Qwen
    MoE families unless the file says otherwise (``expert_weights_norm``)."""
    norm = metadata.get(f"{arch}.expert_weights_norm", True)
    if not isinstance(norm, bool):
        raise ModelLoadError(f"{path}: GGUF metadata {arch}.expert_weights_norm must be a "
                             f"boolean, got {norm!r}")
    return {
        "num_experts": number(metadata, f"{arch}.expert_count", path),
        "num_experts_per_tok": number(metadata, f"{arch}.expert_used_count", path),
        "moe_intermediate_size": number(metadata, f"{arch}.expert_feed_forward_length", path),
        "norm_topk_prob": norm,
        "decoder_sparse_step": 1,
    }


def _dense_layers(tensors: Mapping[str, Any]) -> list[int]:
    """Layers of an MoE file that carry a plain MLP (``ffn_gate``) instead of experts."""
    return sorted(int(name.split(".")[1]) for name in tensors
                  if name.startswith("blk.") and name.endswith(".ffn_gate.weight"))


def _qwen3moe_config(metadata: Mapping[str, Any], tensors: Mapping[str, Any], head_dim: int,
                     path: Path) -> dict[str, Any]:
    return {**_moe_config(metadata, "qwen3moe", path), "mlp_only_layers": _dense_layers(tensors)}


def _gemma3_config(metadata: Mapping[str, Any], tensors: Mapping[str, Any], head_dim: int,
                   path: Path) -> dict[str, Any]:
    layers = number(metadata, "gemma3.block_count", path)
    hidden = number(metadata, "gemma3.embedding_length", path)
    heads = number(metadata, "gemma3.attention.head_count", path)
    config: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        # llama.cpp: 1/sqrt(head_dim), except Gemma 3 27B (62 layers): 1/sqrt(hidden / heads).
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "rope_local_base_freq": number(metadata, "gemma3.rope.freq_base_swa", path, float,
                                       default=10000.0),
    }
    window = metadata.get("gemma3.attention.sliding_window")
    pattern = metadata.get("gemma3.attention.sliding_window_pattern")
    if window is None:  # no window: llama.cpp runs every layer as global attention
        config["layer_types"] = ["full_attention"] * layers
    else:
        config["sliding_window"] = number(metadata, "gemma3.attention.sliding_window", path)
        if isinstance(pattern, list) and len(pattern) == layers and all(
                isinstance(p, bool) for p in pattern):
            config["layer_types"] = ["sliding_attention" if p else "full_attention"
                                     for p in pattern]
        else:  # llama.cpp's fixed Gemma 3 pattern: five sliding layers, then a global one
            config["sliding_window_pattern"] = number(
                metadata, "gemma3.attention.sliding_window_pattern", path, default=6)
    cap = metadata.get("gemma3.final_logit_softcapping")
    if cap:
        config["final_logit_softcapping"] = number(metadata, "gemma3.final_logit_softcapping",
                                                   path, float)
    return config


def _linear_attention_config(metadata: Mapping[str, Any], arch: str, head_dim: int,
                             path: Path) -> dict[str, Any]:
    """The gated-delta layers' keys (Qwen3-Next, Qwen3.5) and the partial rotary factor."""
    value_heads = number(metadata, f"{arch}.ssm.time_step_rank", path)
    inner = number(metadata, f"{arch}.ssm.inner_size", path)
    if inner % value_heads:
        raise ModelLoadError(f"{path}: GGUF metadata {arch}.ssm.inner_size {inner} is not a "
                             f"multiple of {arch}.ssm.time_step_rank {value_heads}")
    rotary = number(metadata, f"{arch}.rope.dimension_count", path, default=head_dim)
    return {
        "linear_conv_kernel_dim": number(metadata, f"{arch}.ssm.conv_kernel", path),
        "linear_key_head_dim": number(metadata, f"{arch}.ssm.state_size", path),
        "linear_num_key_heads": number(metadata, f"{arch}.ssm.group_count", path),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "full_attention_interval": number(metadata, f"{arch}.full_attention_interval", path,
                                          default=4),
        "partial_rotary_factor": rotary / head_dim,
    }


def _hybrid_moe_config(arch: str) -> Any:
    """Qwen3-Next's / Qwen3.5-MoE's config: gated-delta layers, routed experts on every layer
    that has them, the shared expert."""
    def config(metadata: Mapping[str, Any], tensors: Mapping[str, Any], head_dim: int,
               path: Path) -> dict[str, Any]:
        out = {
            **_moe_config(metadata, arch, path),
            "mlp_only_layers": _dense_layers(tensors),
            **_linear_attention_config(metadata, arch, head_dim, path),
        }
        shared = metadata.get(f"{arch}.expert_shared_feed_forward_length")
        if shared is not None:
            out["shared_expert_intermediate_size"] = number(
                metadata, f"{arch}.expert_shared_feed_forward_length", path)
        return out
    return config


def _bool_list(metadata: Mapping[str, Any], key: str, length: int, path: Path) -> list[bool]:
    value = metadata.get(key)
    if not isinstance(value, list) or len(value) != length or not all(
            isinstance(v, bool) for v in value):
        raise ModelLoadError(f"{path}: GGUF metadata {key} must be {length} booleans, "
                             f"got {value!r}")
    return value


def _per_layer(metadata: Mapping[str, Any], key: str, layers: int, path: Path) -> list[int]:
    """A key llama.cpp writes as one count or one per layer, as one per layer."""
    value = metadata.get(key)
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers or not all(isinstance(v, int) and not isinstance(v, bool)
                                        and v > 0 for v in values):
        raise ModelLoadError(f"{path}: GGUF metadata {key} must be a positive count or "
                             f"{layers} of them, got {value!r}")
    return values


def _gemma4_config(metadata: Mapping[str, Any], tensors: Mapping[str, Any], head_dim: int,
                   path: Path) -> dict[str, Any]:
    """Gemma 4's config from the ``gemma4.*`` keys and tensors (module docstring)."""
    arch = "gemma4"
    layers = number(metadata, f"{arch}.block_count", path)
    sliding = _bool_list(metadata, f"{arch}.attention.sliding_window_pattern", layers, path)
    layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    shared = metadata.get(f"{arch}.attention.shared_kv_layers", 0)
    if not isinstance(shared, int) or isinstance(shared, bool) or not 0 <= shared < layers:
        raise ModelLoadError(f"{path}: GGUF metadata {arch}.attention.shared_kv_layers must be "
                             f"a count below {layers}, got {shared!r}")
    kv = _per_layer(metadata, f"{arch}.attention.head_count_kv", layers, path)
    kv_sliding = {k for k, s in zip(kv, sliding) if s}
    kv_global = {k for k, s in zip(kv, sliding) if not s}
    ffn = _per_layer(metadata, f"{arch}.feed_forward_length", layers, path)
    wide = [f == 2 * ffn[0] for f in ffn[layers - shared:]] if shared else []
    if len(kv_sliding) > 1 or len(kv_global) > 1 or (
            set(ffn[:layers - shared]) != {ffn[0]} or set(ffn[layers - shared:]) - {
                ffn[0], 2 * ffn[0]} or len(set(wide)) > 1):
        raise ModelLoadError(f"{path}: GGUF per-layer kv heads {kv} / MLP widths {ffn} are not "
                             "a Gemma 4 layout")
    sliding_head = number(metadata, f"{arch}.attention.key_length_swa", path, default=head_dim)
    full_rotary = head_dim
    if "rope_freqs.weight" in tensors:  # 1 per rotated pair, 1e30 for the unrotated ones
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64).reshape(-1)
        full_rotary = 2 * int((factors == 1.0).sum())
    sliding_rotary = number(metadata, f"{arch}.rope.dimension_count_swa", path,
                            default=sliding_head)
    local = {"rope_type": "default",
             "rope_theta": number(metadata, f"{arch}.rope.freq_base_swa", path, float,
                                  default=10000.0)}
    if sliding_rotary != sliding_head:
        local["partial_rotary_factor"] = sliding_rotary / sliding_head
    per_layer_rows = tensors.get("per_layer_token_embd.weight")
    config: dict[str, Any] = {
        "layer_types": layer_types,
        "head_dim": sliding_head,
        "global_head_dim": head_dim,
        "num_key_value_heads": next(iter(kv_sliding or kv_global)),
        "num_global_key_value_heads": next(iter(kv_global)) if kv_global != kv_sliding
        and kv_global else None,
        "intermediate_size": ffn[0],
        "use_double_wide_mlp": bool(wide and wide[0]),
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": metadata.get(
            f"{arch}.embedding_length_per_layer_input", 0) or 0,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "sliding_attention": local,
            "full_attention": {"rope_type": "proportional",
                               "partial_rotary_factor": full_rotary / head_dim,
                               "rope_theta": number(metadata, f"{arch}.rope.freq_base", path,
                                                    float, default=1000000.0)}},
        # Global layers before the shared ones without a value projection: keys are values.
        "attention_k_eq_v": any(not s and f"blk.{i}.attn_v.weight" not in tensors
                                for i, s in enumerate(sliding[:layers - shared])),
        "enable_moe_block": any(n.endswith(".ffn_gate_inp.weight") for n in tensors),
    }
    if per_layer_rows is not None:
        config["vocab_size_per_layer_input"] = int(per_layer_rows.shape[-1])
    window = metadata.get(f"{arch}.attention.sliding_window")
    if window is not None:
        config["sliding_window"] = number(metadata, f"{arch}.attention.sliding_window", path)
    if metadata.get(f"{arch}.final_logit_softcapping"):
        config["final_logit_softcapping"] = number(
            metadata, f"{arch}.final_logit_softcapping", path, float)
    if config["enable_moe_block"]:
        config.update(num_experts=number(metadata, f"{arch}.expert_count", path),
                      top_k_experts=number(metadata, f"{arch}.expert_used_count", path),
                      moe_intermediate_size=number(
                          metadata, f"{arch}.expert_feed_forward_length", path))
    return config


def _glm_mla_config(metadata: Mapping[str, Any], tensors: Mapping[str, Any], head_dim: int,
                    path: Path) -> dict[str, Any]:
    """GLM-4.7-Flash's config from the ``deepseek2.*`` keys (module docstring)."""
    arch = "deepseek2"
    gating = metadata.get(f"{arch}.expert_gating_func")
    if gating is not None and gating != 2 or not any(n.endswith(".exp_probs_b.bias")
                                                       for n in tensors):
        raise ModelLoadError(f"{path}: deepseek2 GGUF without a sigmoid, bias-corrected router "
                             "(DeepSeek-V2's layout) is not supported; Arbor imports "
                             "GLM-4.7-Flash's")
    if metadata.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        # DeepSeek-V3's YaRN also rescales MLA's attention (mscale): not GLM-4.7-Flash's model.
        raise ModelLoadError(f"{path}: deepseek2 GGUF with rope scaling "
                             f"{metadata[f'{arch}.rope.scaling.type']!r} (DeepSeek-V3's layout) "
                             "is not supported; Arbor imports GLM-4.7-Flash's")
    rope = number(metadata, f"{arch}.rope.dimension_count", path)
    # Per-head sizes: the *_mla keys; files older than the MQA form state them directly.
    key = number(metadata, f"{arch}.attention.key_length_mla", path,
                 default=metadata.get(f"{arch}.attention.key_length"))
    value = number(metadata, f"{arch}.attention.value_length_mla", path,
                   default=metadata.get(f"{arch}.attention.value_length"))
    if key <= rope:
        raise ModelLoadError(f"{path}: GGUF key length {key} leaves no room for "
                             f"{rope} rotary dims")
    heads = number(metadata, f"{arch}.attention.head_count", path)
    config: dict[str, Any] = {
        "num_key_value_heads": heads,
        "head_dim": key,
        "kv_lora_rank": number(metadata, f"{arch}.attention.kv_lora_rank", path),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": key - rope,
        "v_head_dim": value,
        "n_routed_experts": number(metadata, f"{arch}.expert_count", path),
        "n_shared_experts": metadata.get(f"{arch}.expert_shared_count", 0),
        "moe_intermediate_size": number(metadata, f"{arch}.expert_feed_forward_length", path),
        "num_experts_per_tok": number(metadata, f"{arch}.expert_used_count", path),
        "routed_scaling_factor": number(metadata, f"{arch}.expert_weights_scale", path, float,
                                        default=1.0),
        "n_group": number(metadata, f"{arch}.expert_group_count", path, default=1),
        "topk_group": number(metadata, f"{arch}.expert_group_used_count", path, default=1),
        # llama.cpp leaves the chosen weights unnormalised unless the file says otherwise.
        "norm_topk_prob": bool(metadata.get(f"{arch}.expert_weights_norm", False)),
        "first_k_dense_replace": metadata.get(f"{arch}.leading_dense_block_count", 0),
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "moe_layer_freq": 1,
        "rope_interleave": True,
    }
    if f"{arch}.attention.q_lora_rank" in metadata:
        config["q_lora_rank"] = number(metadata, f"{arch}.attention.q_lora_rank", path)
    return config


def _qwen35_config(metadata: Mapping[str, Any], tensors: Mapping[str, Any], head_dim: int,
                   path: Path) -> dict[str, Any]:
    return _linear_attention_config(metadata, "qwen35", head_dim, path)


# ---------------------------------------------------------------------------------------------
# Architectures

_COMMON_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_BLOCK_NAMES = {**_COMMON_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"}
_EXPERT_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_up_exps": "mlp.switch_mlp.gate_up_proj",  # split by ``assemble``
}
_GEMMA3_BLOCK_NAMES = {
    **_COMMON_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_SHARED_EXPERT_NAMES = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# The gated-delta layers' tensors both Qwen3-Next and Qwen3.5 name alike.
_GATED_DELTA_NAMES = {
    **_COMMON_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ssm_dt": "linear_attn.dt",  # its .bias is dt_bias (placement)
    "ssm_a": "linear_attn.A_log",  # no suffix in the file
}
_QWEN3NEXT_BLOCK_NAMES = {
    **_GATED_DELTA_NAMES,
    **_EXPERT_NAMES,
    **_SHARED_EXPERT_NAMES,
    "ssm_in": "linear_attn.in_proj_qkvz",
    "ssm_ba": "linear_attn.in_proj_ba",
    "attn_gate": "linear_attn.in_proj_z",  # merged by ``assemble``
    "attn_qkv": "qkv",  # linear layers: in_proj_qkv; attention layers: q, k and v (assemble)
}
_QWEN35_BLOCK_NAMES = {
    **_GATED_DELTA_NAMES,
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
}
_GLM_MLA_BLOCK_NAMES = {
    **{k: v for k, v in _LLAMA_BLOCK_NAMES.items()
       if k in ("attn_output", "attn_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")},
    **_EXPERT_NAMES,
    "attn_q": "self_attn.q_proj",  # without q_lora_rank
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_k_b": "self_attn.embed_q",
    "attn_v_b": "self_attn.unembed_out",
    "attn_kv_b": "self_attn.kv_b_proj",  # files older than the split
    "exp_probs_b": "mlp.gate.e_score_correction_bias",  # its .bias is the value (no suffix)
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_GEMMA4_BLOCK_NAMES = {
    **_COMMON_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "ffn_gate_inp": "router.proj",
    "ffn_gate_up_exps": "experts.switch_glu.gate_up_proj",  # split by ``assemble``
    "ffn_down_exps": "experts.switch_glu.down_proj",
}
# Gemma 4's tensors whose Hugging Face names are not the block name plus the same suffix.
_GEMMA4_LEAVES = {
    ("layer_output_scale", "weight"): "layer_scalar",
    ("ffn_gate_inp", "scale"): "router.scale",
    ("ffn_down_exps", "scale"): "router.per_expert_scale",
}
_QWEN_OFFSET_NORMS = frozenset({"attn_norm", "post_attention_norm", "attn_q_norm",
                                "attn_k_norm", "output_norm"})


@dataclass(frozen=True)
class Layout:
    """How one llama.cpp architecture maps onto a Hugging Face ``model_type``."""

    model_type: str
    hf_class: str
    block_names: Mapping[str, str]
    # llama.cpp permutes q/k rows only for architectures it runs with "normal" (interleaved) rope.
    permuted_qk: bool = False
    # GGUF leaf names whose values are stored as 1 + w (output_norm included when non-empty).
    offset_norms: frozenset[str] = frozenset()
    partial_rotary: bool = False
    moe: bool = False  # routed experts; an all-expert file may omit feed_forward_length
    # Value heads stored tiled instead of grouped by key head (``_untile_value_heads``).
    tiled_value_heads: bool = False
    # (block leaf, suffix) -> the Hugging Face name within the layer, where it is not
    # ``block_names[leaf] + "." + suffix``.
    leaves: Mapping[tuple[str, str], str] = field(default_factory=dict)
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    family_config: Any = None  # (metadata, tensors, head_dim, path) -> dict


LAYOUTS: dict[str, Layout] = {
    "llama": Layout("llama", "LlamaForCausalLM", _LLAMA_BLOCK_NAMES, permuted_qk=True,
                    extra_config={"mlp_bias": False}),
    "qwen2": Layout("qwen2", "Qwen2ForCausalLM", _LLAMA_BLOCK_NAMES,
                    extra_config={"use_sliding_window": False}),
    "qwen3": Layout("qwen3", "Qwen3ForCausalLM", _LLAMA_BLOCK_NAMES),
    "qwen3moe": Layout("qwen3_moe", "Qwen3MoeForCausalLM", {**_LLAMA_BLOCK_NAMES, **_EXPERT_NAMES},
                       moe=True, family_config=_qwen3moe_config),
    "gemma3": Layout("gemma3_text", "Gemma3ForCausalLM", _GEMMA3_BLOCK_NAMES,
                     offset_norms=frozenset({"attn_norm", "post_attention_norm", "ffn_norm",
                                             "post_ffw_norm", "attn_q_norm", "attn_k_norm",
                                             "output_norm"}),
                     family_config=_gemma3_config),
    "qwen3next": Layout("qwen3_next", "Qwen3NextForCausalLM", _QWEN3NEXT_BLOCK_NAMES,
                        offset_norms=_QWEN_OFFSET_NORMS, partial_rotary=True, moe=True,
                        family_config=_hybrid_moe_config("qwen3next")),
    "qwen35": Layout("qwen3_5", "Qwen3_5ForCausalLM", _QWEN35_BLOCK_NAMES,
                     offset_norms=_QWEN_OFFSET_NORMS, partial_rotary=True,
                     tiled_value_heads=True, family_config=_qwen35_config),
    "qwen35moe": Layout("qwen3_5_moe", "Qwen3_5MoeForCausalLM",
                        {**_QWEN35_BLOCK_NAMES, **_EXPERT_NAMES, **_SHARED_EXPERT_NAMES},
                        offset_norms=_QWEN_OFFSET_NORMS, partial_rotary=True, moe=True,
                        tiled_value_heads=True, family_config=_hybrid_moe_config("qwen35moe")),
    "gemma4": Layout("gemma4_text", "Gemma4ForCausalLM", _GEMMA4_BLOCK_NAMES,
                     partial_rotary=True, leaves=_GEMMA4_LEAVES, family_config=_gemma4_config),
    # MLA's rotary dims are part of each head (``partial_rotary``: the key length is not theirs).
    "deepseek2": Layout("glm4_moe_lite", "Glm4MoeLiteForCausalLM", _GLM_MLA_BLOCK_NAMES,
                        partial_rotary=True, moe=True, family_config=_glm_mla_config),
}

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    # Gemma 4's per-layer inputs
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}

# Tensors that describe the model rather than hold weights; they are folded into config.json.
CONFIG_TENSORS = {"rope_freqs.weight"}


def hf_config(metadata: Mapping[str, Any], arch: str, tensors: Mapping[str, Any],
              path: Path) -> dict[str, Any]:
    """config.json (without ``quantization``) from llama.cpp's metadata keys."""
    layout = LAYOUTS[arch]
    family_metadata = metadata
    # Keys a family may write per layer (Gemma 4): the generic reading takes the first layer's;
    # the family's config reads them whole.
    metadata = {k: v[0] if isinstance(v, list) and v and k in (
        f"{arch}.attention.head_count_kv", f"{arch}.feed_forward_length") else v
        for k, v in metadata.items()}
    hidden = number(metadata, f"{arch}.embedding_length", path)
    heads = number(metadata, f"{arch}.attention.head_count", path)
    kv_heads = number(metadata, f"{arch}.attention.head_count_kv", path, default=heads)
    if f"{arch}.attention.key_length" not in metadata and hidden % heads:
        raise ModelLoadError(f"{path}: GGUF metadata {arch}.embedding_length {hidden} is not a "
                             f"multiple of {arch}.attention.head_count {heads}")
    head_dim = number(metadata, f"{arch}.attention.key_length", path, default=hidden // heads)
    rope_dims = number(metadata, f"{arch}.rope.dimension_count", path, default=head_dim)
    if rope_dims != head_dim and not layout.partial_rotary:
        raise ModelLoadError(
            f"{path}: partial rotary embeddings ({rope_dims} of {head_dim}) are not supported"
        )
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight tensor")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])  # ne order: (hidden, vocab)
    default_theta = 1000000.0 if arch == "gemma3" else 10000.0
    rope_theta = number(metadata, f"{arch}.rope.freq_base", path, float, default=default_theta)
    moe = layout.moe
    config: dict[str, Any] = {
        "architectures": [layout.hf_class],
        "model_type": layout.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": _main_layers(metadata, arch, path),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": number(
            metadata, f"{arch}.attention.layer_norm_rms_epsilon", path, float, default=1e-6
        ),
        "rope_theta": rope_theta,
        "max_position_embeddings": number(metadata, f"{arch}.context_length", path, default=4096),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        **layout.extra_config,
    }
    ffn_key = f"{arch}.feed_forward_length"
    if moe and ffn_key not in metadata:  # only dense layers use it; all-expert files may omit it
        config["intermediate_size"] = number(metadata, f"{arch}.expert_feed_forward_length",
                                             path)
    else:
        config["intermediate_size"] = number(metadata, ffn_key, path)
    if layout.family_config is not None:
        config.update(layout.family_config(family_metadata, tensors, head_dim, path))
    for name in ("bos_token_id", "eos_token_id"):
        value = metadata.get(f"tokenizer.ggml.{name}")  # type-checked by check_vocabulary
        if value is not None:
            config[name] = value
    scaling = _rope_scaling(metadata, arch, path)
    if "rope_freqs.weight" in tensors and arch != "gemma4":  # Gemma 4's: its family config
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64).reshape(-1)
        scaling = _llama3_rope_scaling(factors, rope_theta, head_dim, path)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _main_layers(metadata: Mapping[str, Any], arch: str, path: Path) -> int:
    """``block_count`` less the multi-token-prediction blocks llama.cpp appends after the
    model's own layers (``nextn_predict_layers``; Qwen3.5, GLM)."""
    blocks = number(metadata, f"{arch}.block_count", path)
    extra = metadata.get(f"{arch}.nextn_predict_layers", 0)
    if not isinstance(extra, int) or isinstance(extra, bool) or not 0 <= extra < blocks:
        raise ModelLoadError(f"{path}: GGUF metadata {arch}.nextn_predict_layers must be a "
                             f"count below {arch}.block_count {blocks}, got {extra!r}")
    return blocks - extra


def is_prediction_block(gguf_name: str, config: Mapping[str, Any]) -> bool:
    """A tensor of an appended multi-token-prediction block (``blk.N.*``, N at or past the
    model's layers): not imported (the drafters that would run it come separately)."""
    parts = gguf_name.split(".")
    return (len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit()
            and int(parts[1]) >= config["num_hidden_layers"])


# ---------------------------------------------------------------------------------------------
# Tensor names and values


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """``"blk.3.attn_q.weight"`` -> ``"model.layers.3.self_attn.q_proj.weight"`` for ``arch``.

    Names that ``assemble`` still merges or splits come back as their intermediate names
    (``...linear_attn.in_proj_z.weight``, ``...qkv.weight``, ``...switch_mlp.gate_up_proj.weight``).
    Raises ``KeyError`` for a name the architecture does not have.
    """
    names = LAYOUTS[arch].block_names
    stem, _, leaf = gguf_name.rpartition(".")
    if stem in _TOP_LEVEL_NAMES and leaf in ("weight", "bias"):
        return f"{_TOP_LEVEL_NAMES[stem]}.{leaf}"
    parts = gguf_name.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] == "ssm_a" \
            and "ssm_a" in names:
        return f"model.layers.{parts[1]}.{names['ssm_a']}"
    leaves = LAYOUTS[arch].leaves
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and \
            (parts[2], parts[3]) in leaves:
        return f"model.layers.{parts[1]}.{leaves[(parts[2], parts[3])]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names \
            and parts[3] in ("weight", "bias"):
        if parts[2] in ("ssm_dt", "exp_probs_b"):  # only a bias, stored under its own name
            if parts[3] != "bias":
                raise KeyError(gguf_name)
            bias = "linear_attn.dt_bias" if parts[2] == "ssm_dt" else names["exp_probs_b"]
            return f"model.layers.{parts[1]}.{bias}"
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    raise KeyError(gguf_name)


def unpermute_qk_rows(rows: int, n_head: int) -> np.ndarray:
    """Row indices that undo llama.cpp's q/k permutation: ``hf = gguf[unpermute_qk_rows(...)]``.

    llama.cpp's converter maps HF rows, per head, from ``(half, i)`` to ``(i, half)`` order:
    ``w.reshape(n_head, 2, d, ...).swapaxes(1, 2)``. ``n_head`` is the head count of this
    projection (``num_key_value_heads`` for k_proj).
    """
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    half = rows // n_head // 2
    return np.arange(rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(-1)


def restore(gguf_name: str, hf_name: str, arch: str, tensor: Converted,
            config: Mapping[str, Any], path: Path) -> Converted:
    """Undo what llama.cpp's converter did to this one tensor's values (module docstring)."""
    tensor = _undo_value_changes(gguf_name, hf_name, arch, tensor, config, path)
    if LAYOUTS[arch].tiled_value_heads and ".linear_attn." in hf_name:
        return _untile_value_heads(hf_name, tensor, config)
    return tensor


def _untile_value_heads(hf_name: str, tensor: Converted, config: Mapping[str, Any]) -> Converted:
    """Qwen3.5's value heads from llama.cpp's tiled order back to grouped by key head (module
    docstring): Hugging Face's head ``g * per_key + j`` is the file's ``j * key_heads + g``."""
    kh, vh = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if kh == vh:
        return tensor
    heads = np.arange(vh).reshape(vh // kh, kh).T.reshape(-1)
    dv = config["linear_value_head_dim"]
    value_rows = (heads[:, None] * dv + np.arange(dv)).reshape(-1)
    qk = 2 * kh * config["linear_key_head_dim"]
    if hf_name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):  # q, k rows, then v
        return tensor.take_rows(np.concatenate([np.arange(qk), qk + value_rows]))
    if hf_name.endswith(".in_proj_z.weight"):
        return tensor.take_rows(value_rows)
    if hf_name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
        return tensor.take_rows(heads)
    if hf_name.endswith(".out_proj.weight"):
        return tensor.take_column_blocks(heads, dv)
    return tensor  # the gated norm: one weight per value dim, shared by every head


def _undo_value_changes(gguf_name: str, hf_name: str, arch: str, tensor: Converted,
                        config: Mapping[str, Any], path: Path) -> Converted:
    layout = LAYOUTS[arch]
    parts = gguf_name.split(".")
    leaf = parts[2] if parts[0] == "blk" and len(parts) > 2 else parts[0]
    if layout.permuted_qk and leaf in ("attn_q", "attn_k"):
        heads = config["num_attention_heads" if leaf == "attn_q" else "num_key_value_heads"]
        rows = tensor.rows
        if len(next(iter(tensor.arrays.values())).shape) != 2 or rows % (2 * heads):
            raise ModelLoadError(f"{path}: tensor {gguf_name} has {rows} rows, which do not "
                                 f"split into {heads} heads")
        return tensor.take_rows(unpermute_qk_rows(rows, heads))
    if leaf in layout.offset_norms and gguf_name.endswith(".weight"):
        return Converted({"value": _plain(tensor, gguf_name, path) - 1.0})
    if hf_name.endswith("linear_attn.A_log"):
        a = np.asarray(_plain(tensor, gguf_name, path), dtype=np.float64)
        if not (a < 0).all():
            raise ModelLoadError(f"{path}: tensor {gguf_name} must be negative (it is "
                                 "-exp(A_log))")
        return Converted({"value": mx.array(np.log(-a).astype(np.float32))})
    if hf_name.endswith("linear_attn.conv1d.weight"):
        value = _plain(tensor, gguf_name, path)
        if value.ndim != 2:
            raise ModelLoadError(f"{path}: tensor {gguf_name} has shape {list(value.shape)}, "
                                 "expected (channels, kernel)")
        return Converted({"value": value[:, None, :]})  # (C, K) -> Hugging Face's (C, 1, K)
    if hf_name.endswith("mlp.shared_expert_gate.weight") and tensor.spec is None:
        value = tensor.arrays["value"]
        return Converted({"value": value.reshape(1, -1)})  # llama.cpp may keep it 1-D
    return tensor


def _plain(tensor: Converted, gguf_name: str, path: Path) -> mx.array:
    """A small tensor's float32 values; quantized norms or conv kernels would be a new layout."""
    if tensor.spec is not None:
        raise ModelLoadError(f"{path}: tensor {gguf_name} is quantized; llama.cpp keeps it in "
                             "floating point")
    return tensor.arrays["value"].astype(mx.float32)


def assemble(pieces: dict[str, Converted], arch: str, config: Mapping[str, Any],
             path: Path) -> dict[str, Converted]:
    """The merges and splits that span tensors (module docstring), in place of the
    intermediate names ``hf_tensor_name`` gave them."""
    out = dict(pieces)
    for name in [n for n in pieces if n.endswith((".switch_mlp.gate_up_proj.weight",
                                                  ".switch_glu.gate_up_proj.weight"))]:
        fused = out.pop(name)  # (experts, 2 * intermediate, hidden): gate rows, then up rows
        half = next(iter(fused.arrays.values())).shape[1] // 2
        gate, up = split_rows(fused, [half, half], axis=1)
        out[name.replace("gate_up_proj", "gate_proj")] = gate
        out[name.replace("gate_up_proj", "up_proj")] = up
    if arch != "qwen3next":
        return out
    layer_types = _qwen3next_layer_types(config)
    for name in [n for n in pieces if n.endswith(".qkv.weight")]:
        layer = int(name.split(".")[2])
        qkv = out.pop(name)
        prefix = f"model.layers.{layer}"
        if layer_types[layer] == "full_attention":  # fused q (with its gate), k, v
            q = 2 * config["num_attention_heads"] * config["head_dim"]
            kv = config["num_key_value_heads"] * config["head_dim"]
            if qkv.rows != q + 2 * kv:
                raise ModelLoadError(f"{path}: tensor blk.{layer}.attn_qkv.weight has "
                                     f"{qkv.rows} rows, the config needs {q + 2 * kv}")
            for proj, part in zip("qkv", split_rows(qkv, [q, kv, kv])):
                out[f"{prefix}.self_attn.{proj}_proj.weight"] = part
            continue
        gate_name = f"{prefix}.linear_attn.in_proj_z.weight"
        if gate_name not in out:
            raise ModelLoadError(f"{path}: blk.{layer}.attn_qkv has no blk.{layer}.attn_gate")
        out[f"{prefix}.linear_attn.in_proj_qkvz.weight"] = _qkvz(qkv, out.pop(gate_name),
                                                                  config, layer, path)
    strays = [n for n in out if n.endswith(".linear_attn.in_proj_z.weight")]
    if strays:
        raise ModelLoadError(f"{path}: attn_gate without attn_qkv ({strays[0]})")
    return out


def _qwen3next_layer_types(config: Mapping[str, Any]) -> list[str]:
    interval = config["full_attention_interval"]
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(config["num_hidden_layers"])]


def _qkvz(qkv: Converted, z: Converted, config: Mapping[str, Any], layer: int,
          path: Path) -> Converted:
    """llama.cpp's ``[all q | all k | all v]`` and ``[all z]`` back into Hugging Face's
    ``in_proj_qkvz``: per key head, its q, k, v and z rows."""
    kh, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    vh, dv = config["linear_num_value_heads"], config["linear_value_head_dim"]
    v_per = vh // kh * dv  # value (and z) rows per key head
    if qkv.rows != kh * (2 * dk + v_per) or z.rows != kh * v_per:
        raise ModelLoadError(f"{path}: blk.{layer}.attn_qkv / attn_gate have {qkv.rows} / "
                             f"{z.rows} rows, the config needs {kh * (2 * dk + v_per)} / "
                             f"{kh * v_per}")
    whole = concat_rows([qkv, z])  # rows: q (kh*dk), k (kh*dk), v (kh*v_per), z (kh*v_per)
    q0, k0, v0, z0 = 0, kh * dk, 2 * kh * dk, 2 * kh * dk + kh * v_per
    order = np.concatenate([
        np.concatenate([np.arange(q0 + h * dk, q0 + (h + 1) * dk),
                        np.arange(k0 + h * dk, k0 + (h + 1) * dk),
                        np.arange(v0 + h * v_per, v0 + (h + 1) * v_per),
                        np.arange(z0 + h * v_per, z0 + (h + 1) * v_per)])
        for h in range(kh)])
    return whole.take_rows(order)
