"""GGUF import: tiny files written here with gguf.GGUFWriter, plus the real default model.

The tiny model is a llama with hidden 64, 2 layers, 4 heads / 2 kv heads and a ~300-token
byte-level vocabulary. Each test writes the HF-layout weights into a GGUF the way llama.cpp's
converter does (q/k rows permuted, names renamed, tensors quantized with gguf.quants) and checks
what ``import_gguf`` gives back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from tokenizers import Tokenizer

from backend.errors import ModelLoadError, UnknownArchitectureError
from backend.weights.gguf import hf_tensor_name, import_gguf, unpermute_qk_rows
from backend.weights.gguf_tokenizer import build_tokenizer

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 256, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS

# ---------------------------------------------------------------------------------------------
# Building tiny GGUF files


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py), written out independently."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _byte_alphabet() -> list[str]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {b: chr(b) for b in printable}, 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("Ġ", "w"),
    ("o", "r"), ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld"), ("H", "e"), ("l", "l"), ("He", "ll"),
    ("Hell", "o"), ("Ġ", "c"), ("o", "d"), ("Ġc", "od"), ("Ġcod", "e"), ("u", "s"), ("Ġ", "1"),
    ("1", "2"),
]  # fmt: skip


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a small GPT-2-style vocabulary with three control tokens."""
    tokens = SPECIAL_TOKENS + _byte_alphabet() + ["".join(pair) for pair in MERGES]
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types, [" ".join(pair) for pair in MERGES]


VOCAB = len(byte_level_vocab()[0])


def tiny_hf_weights(seed: int = 0, tie: bool = False) -> dict[str, np.ndarray]:
    """Random float32 weights of the tiny llama, in HF names and (out, in) layout."""
    rng = np.random.default_rng(seed)

    def dense(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": dense(VOCAB, HIDDEN),
        "model.norm.weight": 1 + dense(HIDDEN),
    }
    if not tie:
        weights["lm_head.weight"] = dense(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        weights.update({
            f"{p}.self_attn.q_proj.weight": dense(HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.k_proj.weight": dense(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.v_proj.weight": dense(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.o_proj.weight": dense(HIDDEN, HEADS * HEAD_DIM),
            f"{p}.mlp.gate_proj.weight": dense(INTERMEDIATE, HIDDEN),
            f"{p}.mlp.up_proj.weight": dense(INTERMEDIATE, HIDDEN),
            f"{p}.mlp.down_proj.weight": dense(HIDDEN, INTERMEDIATE),
            f"{p}.input_layernorm.weight": 1 + dense(HIDDEN),
            f"{p}.post_attention_layernorm.weight": 1 + dense(HIDDEN),
        })  # fmt: skip
    return weights


def gguf_names(hf: dict[str, np.ndarray]) -> dict[str, str]:
    """HF name -> GGUF name for the tiny model (the inverse of the importer's map, spelled out)."""
    leaf = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
    names = {}
    for name in hf:
        if name in top:
            names[name] = top[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            names[name] = f"blk.{layer}.{leaf[rest.removesuffix('.weight')]}.weight"
    return names


def q4_k_bytes(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random but valid Q4_K blocks (gguf-py has no Q4_K quantizer): finite float16 d/dmin."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = np.array([0.002], dtype=np.float16).view(np.uint8)
    blocks[..., 2:4] = np.array([0.001], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def iq4_nl_bytes(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random IQ4_NL blocks (a type with no affine form; gguf-py cannot quantize it)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 32, 18), dtype=np.uint8)
    blocks[..., 0:2] = np.array([0.0005], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(
    path: Path,
    hf: dict[str, np.ndarray],
    qtype: Callable[[str, np.ndarray], T] = lambda name, data: T.F32,
    *,
    arch: str = "llama",
    pre: str = "smollm",
    tokenizer: str = "gpt2",
    extra_tensors: dict[str, np.ndarray] | None = None,
    metadata: dict[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Write ``hf`` as llama.cpp would; returns the raw GGUF payload per GGUF name.

    q/k rows are permuted only for ``llama``: llama.cpp's Qwen converters leave them alone.
    ``metadata`` replaces key/value fields (``None`` removes one), e.g. to write a damaged file."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    if tokenizer == "gpt2":
        tokens, types, merges = byte_level_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template(
            "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
        )
    payload = {}
    for hf_name, gguf_name in gguf_names(hf).items():
        data = hf[hf_name]
        if ".attn_q." in gguf_name and arch == "llama":
            data = llama_cpp_permute(data, HEADS)
        elif ".attn_k." in gguf_name and arch == "llama":
            data = llama_cpp_permute(data, KV_HEADS)
        kind = qtype(gguf_name, data)
        if kind == T.F32:
            raw = data.astype(np.float32)
        elif kind == T.F16:
            raw = data.astype(np.float16)
        elif kind == T.Q4_K:
            raw = q4_k_bytes(*data.shape, seed=len(payload))
        elif kind == T.IQ4_NL:
            raw = iq4_nl_bytes(*data.shape, seed=len(payload))
        else:
            raw = gguf.quants.quantize(data, kind)
        writer.add_tensor(gguf_name, raw, raw_dtype=None if kind in (T.F32, T.F16) else kind)
        payload[gguf_name] = (raw, kind)
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    for key, value in (metadata or {}).items():
        writer.kv_data[0].pop(key, None)
        if isinstance(value, list):
            writer.add_array(key, value)
        elif value is not None:
            writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return payload


def reference_values(raw: np.ndarray, kind: T, gguf_name: str) -> np.ndarray:
    """What the importer must reproduce: gguf-py's dequantization, un-permuted with the test's
    own inverse of llama.cpp's permute."""
    values = gguf.quants.dequantize(raw, kind).astype(np.float32)
    for leaf, heads in ((".attn_q.", HEADS), (".attn_k.", KV_HEADS)):
        if leaf in gguf_name:
            half = values.shape[0] // heads // 2
            values = values.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(values.shape)
    return values


def imported_values(folder: Path, hf_name: str) -> np.ndarray:
    """A tensor of an imported folder, dequantized by MLX when it is quantized."""
    weights = mx.load(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    module = hf_name.removesuffix(".weight")
    if f"{module}.scales" in weights:
        spec = config["quantization"].get(module, config["quantization"])
        values = mx.dequantize(  # float16 block scales are stored as such: widen them
            weights[hf_name], weights[f"{module}.scales"].astype(mx.float32),
            weights[f"{module}.biases"].astype(mx.float32),
            group_size=spec["group_size"], bits=spec["bits"],
        )  # fmt: skip
        return np.array(values)
    return np.array(weights[hf_name].astype(mx.float32))


# ---------------------------------------------------------------------------------------------
# Layout helpers


@pytest.mark.parametrize("rows,heads", [(64, 4), (32, 2), (576, 9), (192, 3)])
def test_unpermute_is_the_inverse_of_llama_cpp_permute(rows: int, heads: int) -> None:
    original = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    permuted = llama_cpp_permute(original, heads)
    assert not np.array_equal(permuted, original)
    np.testing.assert_array_equal(permuted[unpermute_qk_rows(rows, heads)], original)


def test_tensor_names_map_to_hugging_face_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert (
        hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    with pytest.raises(KeyError):
        hf_tensor_name("blk.0.ssm_conv1d.weight")


# ---------------------------------------------------------------------------------------------
# Tiny files, one tensor type at a time


def test_float_gguf_round_trips_exactly(tmp_path: Path) -> None:
    hf = tiny_hf_weights()
    # F16 for the big matrices, F32 for the rest, as llama.cpp's f16 files do.
    write_gguf(tmp_path / "m.gguf", hf, lambda name, data: T.F16 if data.ndim == 2 else T.F32)
    folder = import_gguf(tmp_path / "m.gguf", tmp_path / "out")

    weights = mx.load(str(folder / "model.safetensors"))
    assert set(weights) == set(hf)
    for name, original in hf.items():
        expected_dtype = mx.float16 if original.ndim == 2 else mx.float32
        assert weights[name].dtype == expected_dtype, name
        assert weights[name].shape == original.shape, name
        np.testing.assert_array_equal(
            np.array(weights[name]),
            original.astype(np.float16 if original.ndim == 2 else np.float32),
        )

    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        HIDDEN,
        INTERMEDIATE,
        LAYERS,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        HEADS,
        KV_HEADS,
        HEAD_DIM,
    )
    assert config["vocab_size"] == VOCAB and config["tie_word_embeddings"] is False
    assert config["rope_theta"] == 10000.0 and config["max_position_embeddings"] == 512
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert "quantization" not in config
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.parametrize(
    "kind,bits,tolerance",
    [(T.Q8_0, 8, 0.002), (T.Q4_0, 4, 0.03), (T.Q4_1, 4, 0.03)],
)
def test_block_quantized_gguf_converts_without_dequantizing(
    tmp_path: Path, kind: T, bits: int, tolerance: float
) -> None:
    hf = tiny_hf_weights(seed=1)
    payload = write_gguf(
        tmp_path / "m.gguf", hf, lambda name, data: kind if data.ndim == 2 else T.F32
    )
    folder = import_gguf(tmp_path / "m.gguf", tmp_path / "out")

    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": bits}
    weights = mx.load(str(folder / "model.safetensors"))
    for hf_name, gguf_name in gguf_names(hf).items():
        raw, raw_kind = payload[gguf_name]
        got = imported_values(folder, hf_name)
        if raw_kind == kind:
            module = hf_name.removesuffix(".weight")
            assert weights[hf_name].dtype == mx.uint32
            assert weights[hf_name].shape == (
                hf[hf_name].shape[0],
                hf[hf_name].shape[1] * bits // 32,
            )
            assert weights[f"{module}.scales"].shape == (
                hf[hf_name].shape[0],
                hf[hf_name].shape[1] // 32,
            )
        # Bit-exact against gguf-py after un-permuting, and close to the original weights.
        np.testing.assert_array_equal(
            got, reference_values(raw, raw_kind, gguf_name), err_msg=hf_name
        )
        assert np.abs(got - hf[hf_name]).max() <= tolerance, hf_name


def test_mixed_file_gets_per_module_overrides(tmp_path: Path) -> None:
    """SmolLM2's shape: Q4_1 linears, a Q8_0 embedding, F32 norms, no output (tied); plus a
    Q4_K tensor, which stays 4-bit in groups of 32 like the Q4_1 ones."""
    hf = tiny_hf_weights(seed=2, tie=True)

    def choose(name: str, data: np.ndarray) -> T:
        if data.ndim == 1:
            return T.F32
        if name == "token_embd.weight":
            return T.Q8_0
        if name == "blk.1.ffn_down.weight":
            return T.Q4_K
        return T.Q4_1

    payload = write_gguf(tmp_path / "m.gguf", hf, choose)
    folder = import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    weights = mx.load(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in weights
    assert weights["model.layers.1.mlp.down_proj.weight"].dtype == mx.uint32
    assert weights["model.norm.weight"].dtype == mx.float32
    for hf_name, gguf_name in gguf_names(hf).items():
        raw, kind = payload[gguf_name]
        expected = reference_values(raw, kind, gguf_name)
        np.testing.assert_array_equal(imported_values(folder, hf_name), expected, err_msg=hf_name)


def test_quantize_option_quantizes_float_and_non_affine_weights(tmp_path: Path) -> None:
    hf = tiny_hf_weights(seed=3)

    def choose(name: str, data: np.ndarray) -> T:
        if data.ndim == 1:
            return T.F32
        return {"blk.0.ffn_down.weight": T.IQ4_NL, "blk.0.ffn_up.weight": T.Q4_1,
                "blk.1.ffn_down.weight": T.Q4_K}.get(name, T.F16)

    write_gguf(tmp_path / "m.gguf", hf, choose)
    folder = import_gguf(tmp_path / "m.gguf", tmp_path / "out", quantize=8)
    quantization = json.loads((folder / "config.json").read_text())["quantization"]
    # Float weights: 8-bit group 64. The Q4_1 and Q4_K tensors keep their own 4-bit blocks; the
    # IQ4_NL one (no affine form) is re-quantized at its native 32-element block size.
    assert quantization["group_size"] == 64 and quantization["bits"] == 8
    assert quantization["model.layers.0.mlp.up_proj"] == {"group_size": 32, "bits": 4}
    assert quantization["model.layers.1.mlp.down_proj"] == {"group_size": 32, "bits": 4}
    assert quantization["model.layers.0.mlp.down_proj"] == {"group_size": 32, "bits": 8}
    got = imported_values(folder, "model.layers.1.self_attn.o_proj.weight")
    assert np.abs(got - hf["model.layers.1.self_attn.o_proj.weight"]).max() < 2e-3
    got_q = imported_values(
        folder, "model.layers.1.self_attn.q_proj.weight"
    )  # un-permuted, then quantized
    assert np.abs(got_q - hf["model.layers.1.self_attn.q_proj.weight"]).max() < 2e-3


def test_qwen2_gguf_is_not_unpermuted(tmp_path: Path) -> None:
    hf = tiny_hf_weights(seed=4)
    rng = np.random.default_rng(5)
    biases = {  # Qwen2 always has q/k/v biases
        f"blk.{i}.attn_{leaf}.bias": rng.standard_normal(width).astype(np.float32) * 0.05
        for i in range(LAYERS)
        for leaf, width in (("q", HEADS * HEAD_DIM), ("k", KV_HEADS * HEAD_DIM),
                            ("v", KV_HEADS * HEAD_DIM))
    }  # fmt: skip
    write_gguf(tmp_path / "q.gguf", hf, arch="qwen2", pre="qwen2", extra_tensors=biases)
    folder = import_gguf(tmp_path / "q.gguf", tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    name = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(imported_values(folder, name), hf[name])
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens = byte_level_vocab()[0]
    assert [tokens[i] for i in tokenizer.encode("Hello world").ids] == ["Hello", "Ġworld"]


def llama3_rope_factors(base: float, dim: int, factor: float) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for Llama 3.1 scaling (low 1, high 4, original context 8192)."""
    factors = []
    for inv in 1.0 / base ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * np.pi / inv
        if wavelen < 8192 / 4:
            factors.append(1.0)
        elif wavelen > 8192 / 1:
            factors.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_frequencies_become_rope_scaling(tmp_path: Path) -> None:
    factors = llama3_rope_factors(10000.0, HEAD_DIM, 8.0)
    assert {1.0, 8.0} < set(factors.tolist())  # all three regimes: kept, scaled, smoothed
    extra = {"rope_freqs.weight": factors}
    write_gguf(tmp_path / "l3.gguf", tiny_hf_weights(), extra_tensors=extra)
    folder = import_gguf(tmp_path / "l3.gguf", tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in mx.load(str(folder / "model.safetensors"))

    odd = {"rope_freqs.weight": factors * np.linspace(1, 1.5, factors.size, dtype=np.float32)}
    write_gguf(tmp_path / "odd.gguf", tiny_hf_weights(), extra_tensors=odd)
    with pytest.raises(ModelLoadError, match="rope frequency factors"):
        import_gguf(tmp_path / "odd.gguf", tmp_path / "out2")


# ---------------------------------------------------------------------------------------------
# Tokenizer


def test_byte_level_tokenizer_and_chat_template(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", tiny_hf_weights(), pre="smollm")
    folder = import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens = byte_level_vocab()[0]

    ids = tokenizer.encode("<|im_start|>Hello the world<|im_end|>").ids
    assert [tokens[i] for i in ids] == ["<|im_start|>", "Hello", "Ġthe", "Ġworld", "<|im_end|>"]
    # smollm isolates every digit before BPE (as llama.cpp and SmolLM2's own tokenizer.json do),
    # so neither the "Ġ 1" nor the "1 2" merge can apply.
    assert [tokens[i] for i in tokenizer.encode(" 12").ids] == ["Ġ", "1", "2"]
    text = "code 😀 ünïcode\n\tx"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text

    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert config["chat_template"].startswith("{% for m in messages %}")
    assert config["add_bos_token"] is False


def test_sentencepiece_tokenizer_matches_transformers(tmp_path: Path) -> None:
    """A tiny SentencePiece (tokenizer.ggml.model == "llama") vocabulary gives the same ids as
    transformers' own GGUF tokenizer, byte fallback included."""
    from transformers import AutoTokenizer

    pieces = ["▁", "t", "h", "e", "a", "l", "o", "w", "r", "d", "H", "he", "▁t", "▁the", "▁w",
              "or", "ld", "▁wor", "▁world", "el", "ll", "▁H", "▁He", "▁Hell", "lo", "▁Hello",
              "▁a"]  # fmt: skip
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<tool>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0]

    writer = gguf.GGUFWriter(str(tmp_path / "sp.gguf"), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 128),
                       (writer.add_embedding_length, 64), (writer.add_feed_forward_length, 64),
                       (writer.add_head_count, 2), (writer.add_head_count_kv, 2)):  # fmt: skip
        add(value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    # The file holds a vocabulary but no whole model (so it cannot be imported): the tokenizer
    # is built from the same metadata directly.
    metadata = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0, "llama.context_length": 128,
    }  # fmt: skip
    mine = Tokenizer.from_str(json.dumps(build_tokenizer(metadata, tmp_path / "sp.gguf").tokenizer))
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    for text in [
        "Hello the world",
        "hello world",
        "the\nworld ☃",
        " a  the",
        "<s>Hello<tool> the</s>",
    ]:
        assert mine.encode(text).ids == reference(text)["input_ids"], text
    assert mine.encode("Hello").ids[0] == 1  # llama.cpp adds BOS to SentencePiece vocabularies
    assert mine.decode(mine.encode("the\nworld ☃").ids) == "the\nworld ☃"


@pytest.mark.parametrize("block", [64, 8])  # whole groups of codes / not: exact float32
def test_column_blocks_move_exactly(block: int) -> None:
    """``Converted.take_column_blocks`` (Qwen3.5's out_proj): quantized codes move by whole
    groups where a block holds whole groups, else the exact values move; float16 scales (the
    32-weight types store them so) widen before dequantizing either way."""
    from backend.weights.gguf_layouts import Converted
    from backend.weights.quantize import QuantSpec

    codes, scales, biases = mx.quantize(mx.random.normal((6, 256), key=mx.random.key(0)), 32, 5)
    tensor = Converted({"weight": codes, "scales": scales.astype(mx.float16),
                        "biases": biases.astype(mx.float16)}, QuantSpec(32, 5))
    values = np.array(mx.dequantize(codes, scales.astype(mx.float16).astype(mx.float32),
                                    biases.astype(mx.float16).astype(mx.float32), 32, 5))
    np.testing.assert_array_equal(np.array(tensor.dense()), values)
    order = np.random.default_rng(0).permutation(256 // block)
    moved = tensor.take_column_blocks(order, block)
    assert (moved.spec is not None) == (block == 64)
    expected = values.reshape(6, -1, block)[:, order].reshape(6, 256)
    np.testing.assert_array_equal(np.array(moved.dense()), expected)


def test_gemma4_tokenizer_uses_the_files_merges(tmp_path: Path) -> None:
    """A Gemma 4 vocabulary (tokenizer.ggml.model == "gemma4", as llama.cpp's converter writes
    it from Gemma's tokenizer.json: pieces, byte tokens, the merges in their order) gives the
    ids of that tokenizer.json (spaces as ``▁``, no space prefix, byte fallback) after BOS."""
    merges = ["h e", "▁ t", "▁t he", "l o", "e l", "l l", "▁ H", "▁H e", "▁He l", "▁Hel lo",
              "o r", "▁ w", "▁w or", "l d", "▁wor ld"]  # fmt: skip
    pieces = ["▁", "t", "h", "e", "l", "o", "w", "r", "d", "H"] + list(dict.fromkeys(
        "".join(m.split(" ")) for m in merges))
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        pieces + ["<start_of_turn>"]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(pieces) + [3]
    metadata = {
        "tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens,
        # Scores that would rank the pieces the other way round: the merges decide.
        "tokenizer.ggml.scores": [float(i) for i in range(len(tokens))],
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.ggml.add_bos_token": True, "gemma4.context_length": 128,
    }  # fmt: skip
    mine = Tokenizer.from_str(json.dumps(build_tokenizer(metadata, tmp_path / "g.gguf").tokenizer))
    special = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True}
               for i, t in enumerate(tokens) if types[i] in (2, 3)]
    reference = Tokenizer.from_str(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ") for m in merges]}}))
    for text in ["Hello the world", "hello world", "the\nworld ☃", " a  the",
                 "Hello<start_of_turn>"]:
        assert mine.encode(text).ids == [2] + reference.encode(text).ids, text
    assert mine.decode(mine.encode("the\nworld ☃").ids) == "the\nworld ☃"
    with pytest.raises(ModelLoadError, match="without its merges"):
        build_tokenizer({k: v for k, v in metadata.items() if k != "tokenizer.ggml.merges"},
                        tmp_path / "g.gguf")


# ---------------------------------------------------------------------------------------------
# Errors


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("hello, I am not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        import_gguf(path, tmp_path / "out")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty.gguf"):
        import_gguf(empty, tmp_path / "out")


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.01])
def test_truncated_gguf(tmp_path: Path, keep: float) -> None:
    write_gguf(
        tmp_path / "m.gguf",
        tiny_hf_weights(),
        lambda name, data: T.Q4_1 if data.ndim == 2 else T.F32,
    )
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated"):
        import_gguf(tmp_path / "cut.gguf", tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_unsupported_architecture_and_pre_tokenizer(tmp_path: Path) -> None:
    write_gguf(tmp_path / "falcon.gguf", tiny_hf_weights(), arch="falcon")
    with pytest.raises(UnknownArchitectureError, match="falcon"):
        import_gguf(tmp_path / "falcon.gguf", tmp_path / "out")
    write_gguf(tmp_path / "odd.gguf", tiny_hf_weights(), pre="made-up-pre")
    with pytest.raises(ModelLoadError, match="made-up-pre"):
        import_gguf(tmp_path / "odd.gguf", tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# The real default model: SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory: pytest.TempPathFactory, default_model_gguf: Path) -> Path:
    return import_gguf(default_model_gguf, tmp_path_factory.mktemp("smollm2") / "model")


@pytest.mark.slow
def test_smollm2_weights_match_transformers(smollm2_folder: Path, default_model_gguf: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_model_gguf.parent), gguf_file=default_model_gguf.name, dtype=torch.float32
    )
    reference = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    config = json.loads((smollm2_folder / "config.json").read_text())
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    assert config["tie_word_embeddings"] is True
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ):
        assert config[key] == getattr(model.config, key), key

    weights = mx.load(str(smollm2_folder / "model.safetensors"))
    quantized = {name.removesuffix(".scales") for name in weights if name.endswith(".scales")}
    assert len(quantized) == 30 * 7 + 1  # every linear layer and the embedding stay quantized
    for name, expected in reference.items():
        if name == "lm_head.weight":  # tied: transformers reports the embedding again
            continue
        got = imported_values(smollm2_folder, name)
        assert got.shape == expected.shape, name
        assert np.abs(got - expected).max() <= 1e-6, name


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2_folder: Path, default_model_gguf: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(default_model_gguf.parent),
                                              gguf_file=default_model_gguf.name)
    mine = Tokenizer.from_file(str(smollm2_folder / "tokenizer.json"))
    texts = [
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "What is the capital of France?",
        "Emoji: 😀🎉👩‍💻 and accents: naïve café, 日本語",
        "def f(x):\n    return x ** 2  # squares\n\n\tprint(f(12345))",
        "  leading spaces, 3.14159 and 2024-01-01 x1y22z333  ",
    ]
    for text in texts:
        assert mine.encode(text).ids == reference(text)["input_ids"], text
        assert mine.decode(mine.encode(text).ids, skip_special_tokens=False) == text
    config = json.loads((smollm2_folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert config["eos_token"] == "<|im_end|>"
    assert json.loads((smollm2_folder / "generation_config.json").read_text())["eos_token_id"] == 2


def test_turn_end_tokens_and_gemma_turns_without_a_template(tmp_path: Path) -> None:
    """llama.cpp stops at control tokens it knows end a turn (Gemma's <end_of_turn>) whatever
    the eos id says; a Gemma 3 file without a chat template gets Gemma's turn format."""
    pieces = ["▁", "H", "i", "▁Hi", "<start_of_turn>", "<end_of_turn>", "user", "model", "\n"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + pieces
    types = [3, 3, 3, 2] + [1, 1, 1, 1, 3, 3, 1, 1, 1]
    metadata = {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_space_prefix": False,
    }  # fmt: skip
    files = build_tokenizer(metadata, tmp_path / "g.gguf")
    assert files.eos_token_ids == [1, tokens.index("<end_of_turn>")]
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(files.tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps(files.tokenizer_config))
    from backend.tokenizer import Tokenizer as ArborTokenizer

    rendered = ArborTokenizer.from_folder(folder).render_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert rendered == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                        "<start_of_turn>model\n")
    with_template = build_tokenizer({**metadata, "tokenizer.chat_template": "{{ 'x' }}"},
                                    tmp_path / "g.gguf")
    assert with_template.tokenizer_config["chat_template"] == "{{ 'x' }}"
    other = build_tokenizer({**metadata, "general.architecture": "llama"}, tmp_path / "g.gguf")
    assert "chat_template" not in other.tokenizer_config
