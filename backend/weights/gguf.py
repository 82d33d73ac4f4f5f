"""Import a GGUF file (llama.cpp's format) as an Arbor model folder.

An Arbor model folder is a Hugging Face model folder: ``config.json``, ``model.safetensors`` with
HF tensor names, ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``.
``import_gguf`` reads a GGUF once and writes such a folder, so the rest of Arbor only ever loads
one format.

What happens to each tensor:

* F32 / F16 / BF16 are written as they are (same dtype).
* Block-quantized types with an exact MLX affine form stay quantized, repacked, never
  dequantized (gguf_quants.py has the table): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants
  Q4_K, Q5_K in groups of 32; Q2_K, Q3_K, Q6_K in groups of 16. ``mx.dequantize`` of the result
  equals ``gguf.quants.dequantize`` of the source value for value. A mixed file (Q4_K_M: Q4_K
  with Q6_K and Q5_0 tensors) keeps each tensor's own type: per-module overrides in
  ``config.json``'s ``"quantization"`` block, as mlx-lm writes them.
* Q8_K (a float32 scale per 256 weights) becomes float32: no 8-bit affine form is exact.
* Every other type (the IQ and ternary families, MXFP4) has no affine form: it is dequantized
  with the ``gguf`` package and stored as float16 (its values carry far fewer significant bits
  than float16 holds). With ``quantize=4|8`` it is instead re-quantized to MLX ``quantize``-bit,
  group 32 -- lossy, so only when asked.
* ``quantize=4|8`` also quantizes floating-point linear/embedding weights (group 64). Tensors
  already in an exact affine type keep their own quantization: re-quantizing them at another
  group size compounds the error and ruins small models.

Per architecture (gguf_layouts.py): the config from the ``{arch}.*`` metadata, tensor names, and
what llama.cpp's converter did to the values (llama's permuted q/k rows, Gemma's and the hybrid
Qwens' ``1 + w`` norms, Qwen3-Next's split linear-attention projections, Qwen3.5's tiled value
heads, Gemma 4's per-layer arrays and rotation table, stacked experts) is undone; GLM-4.7-Flash's
latent attention keeps llama.cpp's per-head split of ``kv_b_proj``, which is the model's own
absorbed form. Multi-token-prediction blocks llama.cpp appends (``nextn_predict_layers``) are
not imported.

The vocabulary becomes ``tokenizer.json`` in ``gguf_tokenizer.py``.

Scope: architectures ``llama`` (also Mistral-style models, which llama.cpp writes as ``llama``),
``qwen2``, ``qwen3``, ``qwen3moe``, ``gemma3``, ``gemma4`` (the language model), ``qwen3next``,
``qwen35``, ``qwen35moe`` and ``deepseek2`` in GLM-4.7-Flash's layout (``glm4_moe_lite``);
byte-level BPE (``gpt2``), SentencePiece (``llama``) and Gemma 4's BPE (``gemma4``) tokenizers.
Anything else is a ``ModelLoadError`` / ``UnknownArchitectureError`` naming the file and the
problem.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from backend.errors import ModelLoadError, UnknownArchitectureError
from backend.models import architecture_args
from backend.weights.gguf_layouts import (
    CONFIG_TENSORS,
    LAYOUTS,
    Converted,
    assemble,
    hf_config,
    hf_tensor_name,
    is_prediction_block,
    restore,
    unpermute_qk_rows,
)
from backend.weights.gguf_quants import AFFINE_TYPES, pack_codes, q8_k_values, to_affine
from backend.weights.gguf_tokenizer import build_tokenizer
from backend.weights.loading import read_checkpoint
from backend.weights.quantize import (
    DEFAULT_GROUP_SIZE,
    QuantSpec,
    is_quantizable,
    module_of,
    quantization_block,
    quantize_weight,
)

__all__ = ["hf_tensor_name", "import_gguf", "unpermute_qk_rows"]

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
# One tensor


def _scale_array(values: np.ndarray) -> mx.array:
    """Scales or biases as float16 when every value is one exactly (the 32-weight types' block
    scales, and their multiples by -8, -16 or -128), else float32 (the K-quants' products of two
    scales): exact either way, and a Q8_0 tensor takes 9 bits a weight on disk instead of 10.
    The loader widens them to float32 (quantize.py says why)."""
    half = values.astype(np.float16)
    exact = np.isfinite(half).all() and np.array_equal(half.astype(np.float32), values)
    return mx.array(half if exact else values.astype(np.float32))


def _convert_tensor(tensor: Any, hf_name: str, quantize: int | None, path: Path) -> Converted:
    """One GGUF tensor of file ``path`` in MLX form (see the module docstring for the rules)."""
    import gguf

    kind = tensor.tensor_type
    types = gguf.GGMLQuantizationType
    hf_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if kind.name in AFFINE_TYPES:
        if len(hf_shape) not in (2, 3):
            raise ModelLoadError(f"{path}: tensor {tensor.name} is {kind.name} but not a matrix "
                                 f"or a stack of them (shape {list(hf_shape)})")
        try:
            affine = to_affine(np.asarray(tensor.data), kind.name)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: tensor {tensor.name}: {exc}") from None
        arrays = {
            "weight": mx.array(pack_codes(affine.codes, affine.bits)),
            "scales": _scale_array(affine.scales),
            "biases": _scale_array(affine.biases),
        }
        return Converted(arrays, QuantSpec(affine.group_size, affine.bits))

    if kind in (types.F32, types.F16):
        dense = mx.array(np.asarray(tensor.data).reshape(hf_shape))
    elif kind == types.BF16:
        raw = np.ascontiguousarray(tensor.data).view(np.uint16).reshape(hf_shape)
        dense = mx.array(raw).view(mx.bfloat16)
    elif kind == types.F64:
        dense = mx.array(np.asarray(tensor.data, dtype=np.float32).reshape(hf_shape))
    elif kind == types.Q8_K:
        dense = mx.array(q8_k_values(np.asarray(tensor.data)).reshape(hf_shape))
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
            return Converted(quantize_weight(mx.array(values), spec), spec)
        dense = mx.array(values.astype(np.float16))

    if quantize is not None and is_quantizable(hf_name, hf_shape, DEFAULT_GROUP_SIZE):
        spec = QuantSpec(DEFAULT_GROUP_SIZE, quantize)
        return Converted(quantize_weight(dense, spec), spec)
    return Converted({"value": dense})


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
    ``None``) additionally quantizes floating-point and non-affine quantized weights; see the
    module docstring. Returns ``dest``.

    Raises ``ModelLoadError`` (one line, naming ``path``) for a file that is not GGUF, is
    truncated, or uses a tensor type, tokenizer or feature Arbor cannot convert faithfully, and
    ``UnknownArchitectureError`` for an architecture outside the supported ones.
    """
    path = Path(path)
    dest = Path(dest)
    report = progress or (lambda fraction, message: None)
    report(0.0, f"reading {path.name}")
    reader = _open_reader(path)
    metadata = _read_metadata(reader, path)
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in LAYOUTS:
        raise UnknownArchitectureError(
            f"{path}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(sorted(LAYOUTS))})"
        )
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = hf_config(metadata, arch, tensors, path)
    architecture_args(config, path)  # the checks every config passes, before any conversion
    tokenizer_files = build_tokenizer(metadata, path)

    pieces: dict[str, Converted] = {}
    weight_tensors = [t for t in reader.tensors
                      if t.name not in CONFIG_TENSORS and not is_prediction_block(t.name, config)]
    for index, tensor in enumerate(weight_tensors):
        try:
            hf_name = hf_tensor_name(tensor.name, arch)
        except KeyError:
            raise ModelLoadError(
                f"{path}: unexpected tensor {tensor.name!r} for architecture {arch!r}"
            ) from None
        converted = _convert_tensor(tensor, hf_name, quantize, path)
        pieces[hf_name] = restore(tensor.name, hf_name, arch, converted, config, path)
        mx.eval(list(pieces[hf_name].arrays.values()))  # materialize now: the memmap can go
        report((index + 1) / (len(weight_tensors) + 1), f"converted {tensor.name}")

    weights: dict[str, mx.array] = {}
    layers: dict[str, QuantSpec | None] = {}
    for hf_name, converted in assemble(pieces, arch, config, path).items():
        if converted.spec is not None:
            module = module_of(hf_name)
            for key, value in converted.arrays.items():
                weights[f"{module}.{key}"] = value
        else:
            weights[hf_name] = converted.arrays["value"]
        # Linear, embedding and stacked-expert weights (not the 3-D conv kernel) take part in
        # the quantization block; a floating-point one gets its ``false`` override.
        if hf_name.endswith(".weight") and converted.ndim in (2, 3) and \
                not hf_name.endswith("conv1d.weight"):
            layers[module_of(hf_name)] = converted.spec

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
