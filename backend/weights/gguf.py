"""Import a GGUF file (llama.cpp's format) as an Arbor model folder.

An Arbor model folder is a Hugging Face model folder: ``config.json``, ``model.safetensors`` with
HF tensor names, ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``.
``import_gguf`` reads a GGUF once and writes such a folder, so the rest of Arbor only ever loads
one format.

What happens to each tensor:

* F32 / F16 / BF16 are written as they are (same dtype).
* Q4_0, Q4_1 and Q8_0 blocks (32 weights, one float16 scale, Q4_1 also a float16 minimum) map
  exactly onto MLX affine quantization with ``group_size=32``, so they are repacked, never
  dequantized: Q4_1 ``w = d*q + m`` -> ``scales=d, biases=m``; Q4_0 ``w = d*(q-8)`` ->
  ``scales=d, biases=-8d``; Q8_0 ``w = d*q`` (int8) -> 8-bit codes ``q+128``, ``biases=-128d``.
  Dequantizing the result with ``mx.dequantize`` gives exactly ``gguf.quants.dequantize``'s values.
* Every other quantized type (K-quants, Q5_x, IQ*) has no exact MLX counterpart. By default it is
  dequantized and stored as float16 (its values carry far fewer significant bits than float16
  holds, so this loses nothing that matters). With ``quantize=4|8`` it is instead re-quantized to
  MLX ``quantize``-bit, group 32 -- lossy, so only when asked.
* ``quantize=4|8`` also quantizes floating-point linear/embedding weights (group 64). Tensors
  that are already Q4_0/Q4_1/Q8_0 keep their own 32-block quantization: re-quantizing them at
  another group size compounds the error and ruins small models.

Files mixing types (SmolLM2's Q4_1 file has a Q8_0 embedding and F32 norms) get per-module
overrides in ``config.json``'s ``"quantization"`` block, as mlx-lm writes them.

llama.cpp's converter permutes the rows of ``q_proj``/``k_proj`` of ``llama`` models for its
interleaved rotary layout; those rows are permuted back. Whole rows move, so packed codes, scales
and biases are permuted together and stay exact.

The vocabulary becomes ``tokenizer.json`` in ``gguf_tokenizer.py``.

Scope: architectures ``llama`` (also Mistral-style models, which llama.cpp writes as ``llama``),
``qwen2`` and ``qwen3``; byte-level BPE (``gpt2``) and SentencePiece (``llama``) tokenizers.
Anything else is a ``ModelLoadError``/``UnknownArchitectureError`` naming the file and the problem.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from backend.errors import ModelLoadError, UnknownArchitectureError
from backend.models import architecture_args
from backend.weights.gguf_tokenizer import build_tokenizer
from backend.weights.loading import read_checkpoint
from backend.weights.quantize import (
    DEFAULT_GROUP_SIZE,
    SCALE_DTYPE,
    QuantSpec,
    is_quantizable,
    module_of,
    quantization_block,
    quantize_weight,
)

Progress = Callable[[float, str], None]

# ---------------------------------------------------------------------------------------------
# Reading the file


def _open_reader(path: Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path``, with every failure turned into a one-line error."""
    import gguf  # imported lazily: only GGUF imports pay for it

    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    if sys.byteorder != "little":
        raise ModelLoadError(f"{path}: GGUF import needs a little-endian machine")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/IndexError/... on a damaged file
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF ({exc})") from exc
    if reader.endianess.name != "LITTLE":
        raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = tensor.data_offset + tensor.n_bytes
        if end > size:
            raise ModelLoadError(
                f"{path}: truncated GGUF (tensor {tensor.name} ends at byte {end}, file has {size})"
            )
    return reader


def _read_metadata(reader: Any, path: Path) -> dict[str, Any]:
    """Every key/value field of the file as plain Python values."""
    metadata: dict[str, Any] = {}
    for key, reader_field in reader.fields.items():
        try:
            metadata[key] = reader_field.contents()
        except Exception as exc:
            raise ModelLoadError(f"{path}: corrupt GGUF metadata field {key!r} ({exc})") from exc
    return metadata


# ---------------------------------------------------------------------------------------------
# Architectures: metadata -> config.json, GGUF tensor names -> HF names


@dataclass(frozen=True)
class _Architecture:
    """How one llama.cpp architecture maps onto a Hugging Face ``model_type``."""

    model_type: str
    hf_class: str
    # llama.cpp permutes q/k rows only for architectures it runs with "normal" (interleaved) rope.
    permuted_qk: bool
    extra_config: Mapping[str, Any] = field(default_factory=dict)


_ARCHITECTURES: dict[str, _Architecture] = {
    "llama": _Architecture("llama", "LlamaForCausalLM", True, {"mlp_bias": False}),
    "qwen2": _Architecture("qwen2", "Qwen2ForCausalLM", False, {"use_sliding_window": False}),
    "qwen3": _Architecture("qwen3", "Qwen3ForCausalLM", False, {}),
}

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Tensors that describe the model rather than hold weights; they are folded into config.json.
_CONFIG_TENSORS = {"rope_freqs.weight"}


def hf_tensor_name(gguf_name: str) -> str:
    """``"blk.3.attn_q.weight"`` -> ``"model.layers.3.self_attn.q_proj.weight"``.

    Raises ``KeyError`` for a name outside the supported families.
    """
    stem, _, leaf = gguf_name.rpartition(".")
    if leaf not in ("weight", "bias"):
        raise KeyError(gguf_name)
    if stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{leaf}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{leaf}"
    raise KeyError(gguf_name)


def _number(metadata: Mapping[str, Any], key: str, path: Path, kind: type = int,
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
    factor = _number(metadata, f"{arch}.rope.scaling.factor", path, float)
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    original_key = f"{arch}.rope.scaling.original_context_length"
    if metadata.get(original_key):
        scaling["original_max_position_embeddings"] = _number(metadata, original_key, path)
    return scaling


def _hf_config(
    metadata: Mapping[str, Any], arch: str, tensors: Mapping[str, Any], path: Path
) -> dict[str, Any]:
    """config.json (without ``quantization``) from llama.cpp's metadata keys."""
    spec = _ARCHITECTURES[arch]
    hidden = _number(metadata, f"{arch}.embedding_length", path)
    heads = _number(metadata, f"{arch}.attention.head_count", path)
    kv_heads = _number(metadata, f"{arch}.attention.head_count_kv", path, default=heads)
    if f"{arch}.attention.key_length" not in metadata and hidden % heads:
        raise ModelLoadError(f"{path}: GGUF metadata {arch}.embedding_length {hidden} is not a "
                             f"multiple of {arch}.attention.head_count {heads}")
    head_dim = _number(metadata, f"{arch}.attention.key_length", path, default=hidden // heads)
    rope_dims = _number(metadata, f"{arch}.rope.dimension_count", path, default=head_dim)
    if rope_dims != head_dim:
        raise ModelLoadError(
            f"{path}: partial rotary embeddings ({rope_dims} of {head_dim}) are not supported"
        )
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight tensor")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])  # ne order: (hidden, vocab)
    rope_theta = _number(metadata, f"{arch}.rope.freq_base", path, float, default=10000.0)
    config: dict[str, Any] = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": _number(metadata, f"{arch}.feed_forward_length", path),
        "num_hidden_layers": _number(metadata, f"{arch}.block_count", path),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _number(
            metadata, f"{arch}.attention.layer_norm_rms_epsilon", path, float, default=1e-6
        ),
        "rope_theta": rope_theta,
        "max_position_embeddings": _number(metadata, f"{arch}.context_length", path, default=4096),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        **spec.extra_config,
    }
    for name in ("bos_token_id", "eos_token_id"):
        value = metadata.get(f"tokenizer.ggml.{name}")  # type-checked by check_vocabulary
        if value is not None:
            config[name] = value
    scaling = _rope_scaling(metadata, arch, path)
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64).reshape(-1)
        scaling = _llama3_rope_scaling(factors, rope_theta, head_dim, path)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


# ---------------------------------------------------------------------------------------------
# Tensors


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


def _split_blocks(tensor: Any, block_bytes: int) -> np.ndarray:
    """The raw bytes of a block-quantized tensor as ``(rows, blocks_per_row, block_bytes)``."""
    data = np.asarray(tensor.data)
    return data.reshape(data.shape[0], -1, block_bytes)


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 stored at byte ``start`` of every block, as float32 ``(rows, blocks)``."""
    raw = np.ascontiguousarray(blocks[..., start : start + 2])
    return raw.view(np.float16)[..., 0].astype(np.float32)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes ``(rows, n)`` (values < 16, n % 8 == 0) -> MLX-packed uint32 ``(rows, n/8)``."""
    codes = codes.astype(np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # byte b holds elements 2b (low), 2b+1 (high)
    return np.ascontiguousarray(packed).view(np.uint32)  # little-endian: element j at bits 4j


def _repack_q4(tensor: Any, with_min: bool) -> dict[str, np.ndarray]:
    """Q4_0 (``d, qs[16]``) or Q4_1 (``d, m, qs[16]``) -> MLX 4-bit group-32 arrays."""
    block_bytes = 20 if with_min else 18
    blocks = _split_blocks(tensor, block_bytes)
    rows, n_blocks, _ = blocks.shape
    scales = _f16_field(blocks, 0)
    # GGUF packs a block's 32 codes as 16 bytes: low nibbles are codes 0..15, high nibbles 16..31.
    qs = blocks[..., block_bytes - 16 :]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, n_blocks * 32)
    if with_min:
        biases = _f16_field(blocks, 2)
    else:
        biases = scales * np.float32(-8.0)  # exact: a power-of-two multiple of a float16 value
    return {"weight": _pack_nibbles(codes), "scales": scales, "biases": biases}


def _repack_q8_0(tensor: Any) -> dict[str, np.ndarray]:
    """Q8_0 (``d, int8 qs[32]``) -> MLX 8-bit group-32 arrays (codes shifted to ``q + 128``)."""
    blocks = _split_blocks(tensor, 34)
    rows, n_blocks, _ = blocks.shape
    scales = _f16_field(blocks, 0)
    codes = (blocks[..., 2:] ^ np.uint8(0x80)).reshape(rows, n_blocks * 32)  # int8 q -> q + 128
    return {
        "weight": np.ascontiguousarray(codes).view(np.uint32),
        "scales": scales,
        "biases": scales * np.float32(-128.0),
    }


_Q4_SPEC = QuantSpec(group_size=32, bits=4)
_Q8_SPEC = QuantSpec(group_size=32, bits=8)


@dataclass
class _Converted:
    """One GGUF tensor in MLX form: ``arrays`` maps ``weight``/``bias``/``scales``/``biases`` to
    data; ``spec`` is set when ``weight`` is MLX-quantized."""

    arrays: dict[str, mx.array]
    spec: QuantSpec | None = None


def _convert_tensor(tensor: Any, hf_name: str, quantize: int | None, path: Path) -> _Converted:
    """Convert one GGUF tensor of file ``path`` (see the module docstring for the rules)."""
    import gguf

    kind = tensor.tensor_type
    types = gguf.GGMLQuantizationType
    hf_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if kind in (types.Q4_0, types.Q4_1, types.Q8_0) and len(hf_shape) != 2:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is {kind.name} but not a matrix "
                             f"(shape {list(hf_shape)})")
    if kind == types.Q4_0:
        repacked, spec = _repack_q4(tensor, with_min=False), _Q4_SPEC
    elif kind == types.Q4_1:
        repacked, spec = _repack_q4(tensor, with_min=True), _Q4_SPEC
    elif kind == types.Q8_0:
        repacked, spec = _repack_q8_0(tensor), _Q8_SPEC
    else:
        repacked, spec = None, None
    if repacked is not None:
        arrays = {key: mx.array(value) for key, value in repacked.items()}
        arrays["scales"] = arrays["scales"].astype(SCALE_DTYPE)
        arrays["biases"] = arrays["biases"].astype(SCALE_DTYPE)
        return _Converted(arrays, spec)

    if kind in (types.F32, types.F16):
        dense = mx.array(np.asarray(tensor.data).reshape(hf_shape))
    elif kind == types.BF16:
        raw = np.ascontiguousarray(tensor.data).view(np.uint16).reshape(hf_shape)
        dense = mx.array(raw).view(mx.bfloat16)
    elif kind == types.F64:
        dense = mx.array(np.asarray(tensor.data, dtype=np.float32).reshape(hf_shape))
    else:
        try:
            values = gguf.quants.dequantize(np.asarray(tensor.data), kind)
        except NotImplementedError as exc:
            message = f"{path}: tensor {tensor.name} has unsupported type {kind.name}"
            raise ModelLoadError(message) from exc
        values = values.reshape(hf_shape)
        if quantize is not None and is_quantizable(hf_name, hf_shape, 32):
            # Re-quantize at the source's 32-element block size, which is what it was tuned for.
            spec = QuantSpec(32, quantize)
            return _Converted(quantize_weight(mx.array(values), spec), spec)
        dense = mx.array(values.astype(np.float16))

    if quantize is not None and is_quantizable(hf_name, hf_shape, DEFAULT_GROUP_SIZE):
        spec = QuantSpec(DEFAULT_GROUP_SIZE, quantize)
        return _Converted(quantize_weight(dense, spec), spec)
    return _Converted({"weight" if hf_name.endswith(".weight") else "bias": dense})


# ---------------------------------------------------------------------------------------------
# The import


def import_gguf(
    path: Path,
    dest: Path,
    progress: Progress | None = None,
    quantize: int | None = None,
) -> Path:
    """Convert the GGUF file ``path`` into an Arbor (Hugging Face) model folder at ``dest``.

    ``dest`` is created if needed; files of the same names in it are overwritten (callers that
    need atomicity write to a temporary folder and rename it, as ``ModelStore`` does).
    ``progress(fraction, message)`` is called as tensors are converted. ``quantize`` (4 or 8, or
    ``None``) additionally quantizes floating-point and non-MLX-compatible quantized weights; see
    the module docstring. Returns ``dest``.

    Raises ``ModelLoadError`` (one line, naming ``path``) for a file that is not GGUF, is
    truncated, or uses a tensor type, tokenizer or feature Arbor cannot convert faithfully, and
    ``UnknownArchitectureError`` for an architecture outside ``llama``/``qwen2``/``qwen3``.
    """
    path = Path(path)
    dest = Path(dest)
    report = progress or (lambda fraction, message: None)
    report(0.0, f"reading {path.name}")
    reader = _open_reader(path)
    metadata = _read_metadata(reader, path)
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in _ARCHITECTURES:
        raise UnknownArchitectureError(
            f"{path}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(sorted(_ARCHITECTURES))})"
        )
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = _hf_config(metadata, arch, tensors, path)
    architecture_args(config, path)  # the checks every config passes, before any conversion
    tokenizer_files = build_tokenizer(metadata, path)

    permute_heads = {}
    if _ARCHITECTURES[arch].permuted_qk:
        permute_heads = {
            "attn_q": config["num_attention_heads"],
            "attn_k": config["num_key_value_heads"],
        }

    weights: dict[str, mx.array] = {}
    layers: dict[str, QuantSpec | None] = {}
    weight_tensors = [t for t in reader.tensors if t.name not in _CONFIG_TENSORS]
    for index, tensor in enumerate(weight_tensors):
        try:
            hf_name = hf_tensor_name(tensor.name)
        except KeyError:
            raise ModelLoadError(
                f"{path}: unexpected tensor {tensor.name!r} for architecture {arch!r}"
            ) from None
        converted = _convert_tensor(tensor, hf_name, quantize, path)
        gguf_leaf = tensor.name.split(".")[-2]
        if gguf_leaf in permute_heads:
            rows, heads = int(tensor.shape[-1]), permute_heads[gguf_leaf]
            if len(tensor.shape) != 2 or rows % (2 * heads):
                raise ModelLoadError(f"{path}: tensor {tensor.name} has shape "
                                     f"{list(tensor.shape)}, which does not split into {heads} "
                                     "heads")
            order = mx.array(unpermute_qk_rows(rows, heads))
            converted.arrays = {key: value[order] for key, value in converted.arrays.items()}
        prefix = (
            module_of(hf_name) if hf_name.endswith(".weight") else hf_name.removesuffix(".bias")
        )
        for key, value in converted.arrays.items():
            weights[f"{prefix}.{key}"] = value
        if hf_name.endswith(".weight") and len(tensor.shape) == 2:
            layers[prefix] = converted.spec
        mx.eval(list(converted.arrays.values()))  # materialize now: the memmap pages can go
        report((index + 1) / (len(weight_tensors) + 1), f"converted {tensor.name}")

    block = quantization_block(layers)
    if block is not None:
        config["quantization"] = block

    report(len(weight_tensors) / (len(weight_tensors) + 1), "writing model.safetensors")
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(dest / "config.json", config)
    _write_json(dest / "tokenizer.json", tokenizer_files.tokenizer)
    _write_json(dest / "tokenizer_config.json", tokenizer_files.tokenizer_config)
    eos_ids = tokenizer_files.eos_token_ids
    generation: dict[str, Any] = {}
    if eos_ids:
        generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if "bos_token_id" in config:
        generation["bos_token_id"] = config["bos_token_id"]
    _write_json(dest / "generation_config.json", generation)
    # The converted folder must load: weights against config, as every load checks them.
    read_checkpoint(dest, source=path)
    report(1.0, f"imported {path.name}")
    return dest


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
