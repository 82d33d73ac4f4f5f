"""Every family Arbor runs imports from GGUF and answers as the same weights do from safetensors.

For each architecture, a tiny random checkpoint (TINY_CONFIGS, widened to K-quants' 256-weight
blocks) is written as llama.cpp's converter writes it (tests/fixtures/gguf_files.py: names,
value changes, metadata, vocabulary and chat template) in llama.cpp's Q4_K_M recipe (Q4_K with
Q6_K tensors and Q5_0 / Q8_0 / F16 fallbacks). The reference is a plain safetensors folder
holding what the GGUF holds, as the ``gguf`` package decodes it. The import must give

* the same logits bit for bit when both are loaded dequantized (the imported values and
  layout are exactly the reference's: every tensor type, every undone converter change);
* the same greedy reply through the engine on its default path (the quantized layers on the
  native kernels, the reference in float32): same tokenizer, chat template and tokens.

The same for every family in each type check 3 of the issue names (Q4_0, Q8_0, Q4_K, Q5_K,
Q6_K: every matrix in that type, with llama.cpp's fallbacks for short rows), and on the llama
family for every tensor type on its own, each weight compared with the gguf package's decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from backend.api import GenerateRequest
from backend.engine import Engine
from backend.memory.budgets import CacheConfig
from backend.tokenizer import Tokenizer
from backend.errors import ModelLoadError
from backend.weights.gguf import import_gguf
from backend.weights.gguf_layouts import hf_config
from backend.weights.loading import load_model
from tests.fixtures.gguf_files import (
    language_config,
    only,
    q4_k_m,
    reference_weights,
    write_gguf_like_llama_cpp,
    write_reference_folder,
)
from tests.fixtures.tiny_models import write_tiny_model

pytestmark = pytest.mark.usefixtures("native_kernels")

WIDE = {"hidden_size": 256, "intermediate_size": 512}
# GGUF architecture -> (TINY_CONFIGS row, what llama.cpp's reading of the file implies): its
# qwen3moe runs every layer's experts and normalizes their weights; its gemma3 ties the
# output to the embedding, uses five sliding layers per global one and 1/sqrt(head_dim).
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3moe": ("qwen3_moe", {"decoder_sparse_step": 1, "norm_topk_prob": True}),
    "gemma3": ("gemma3", {"sliding_window_pattern": 6, "tie_word_embeddings": True,
                          "head_dim": 64, "query_pre_attn_scalar": 64}),
    "qwen3next": ("qwen3_next", {}),
    # Value heads of 64 (more value than key heads: the converter tiles them), so out_proj's
    # 256 input columns are whole K-quant blocks and each head's columns whole groups.
    "qwen35": ("qwen3_5", {"mtp_num_hidden_layers": 0, "linear_value_head_dim": 64}),
    "qwen35moe": ("qwen3_5_moe", {"mtp_num_hidden_layers": 0, "linear_value_head_dim": 64}),
    # GLM-4.7-Flash's MLA with a 256-dim latent (W_UV's rows whole K-quant blocks) and its
    # prediction layer, which llama.cpp appends as one more block.
    "deepseek2": ("glm4_moe_lite", {"kv_lora_rank": 256}),
    # Gemma 4 as llama.cpp writes it: E2B's layout (KV-shared double-wide layers, per-layer
    # inputs) and 26B-A4B's (keys as values, the MoE block) from a multimodal checkpoint.
    "gemma4": ("gemma4_text", {}),
    "gemma4-moe": ("gemma4-moe", {}),
}
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K"]
CHECKED_TYPES = ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]
TOKENS = 16


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            row, overrides = FAMILIES[family]
            made[family] = write_tiny_model(tmp_path_factory.mktemp(family), row,
                                            **WIDE, **overrides)
        return made[family]
    return get


def build(tmp_path: Path, hf: Path, choose) -> tuple[Path, Path, Path]:
    """(GGUF, its import, the reference folder) for ``hf`` written with ``choose``."""
    gguf_path = write_gguf_like_llama_cpp(hf, tmp_path / "model.gguf", choose)
    imported = import_gguf(gguf_path, tmp_path / "imported")
    reference = write_reference_folder(gguf_path, hf, tmp_path / "reference")
    return gguf_path, imported, reference


def dequantized_logits(folder: Path) -> np.ndarray:
    loaded = load_model(folder, cpu_kernels=False)  # every quantized weight dequantized
    assert loaded.quantization is None
    tokens = mx.array(np.random.default_rng(1).integers(0, 380, size=(1, 40)))
    return np.array(loaded.model(tokens, loaded.model.make_caches()))


def greedy_reply(folder: Path) -> list[int]:
    engine = Engine(load_model(folder), Tokenizer.from_folder(folder), folder.name,
                    cache=CacheConfig.memory_only())
    events = list(engine.generate(GenerateRequest(messages=MESSAGES, max_tokens=TOKENS,
                                                  ignore_eos=True)))
    return events[-1].token_ids


def check_answers_alike(imported: Path, reference: Path) -> None:
    assert np.array_equal(dequantized_logits(imported), dequantized_logits(reference))
    assert load_model(imported).cpu_kernels  # the reply below runs the quantized layers
    assert greedy_reply(imported) == greedy_reply(reference)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_q4_k_m_file_of_each_family(family, tiny_hf, tmp_path):
    hf = tiny_hf(family)
    config = language_config(hf)
    tied = config.get("tie_word_embeddings", False)
    _, imported, reference = build(tmp_path, hf, q4_k_m(config["num_hidden_layers"], tied))

    quantization = json.loads((imported / "config.json").read_text())["quantization"]
    layouts = {(spec["bits"], spec["group_size"]) for spec in quantization.values()
               if isinstance(spec, dict)} | {(quantization["bits"], quantization["group_size"])}
    assert (quantization["bits"], quantization["group_size"]) == (4, 32)  # Q4_K, the default
    assert (6, 16) in layouts  # Q6_K tensors kept as they are
    # The language model's type (a multimodal Gemma 4 checkpoint's is gemma4_text).
    assert json.loads((imported / "config.json").read_text())["model_type"] == \
        {"gemma4": "gemma4_text"}.get(config["model_type"], config["model_type"])

    texts = ["Hello world! How are you today?", "Café crème, 日本語 😀 0123"]
    mine = HFTokenizer.from_file(str(imported / "tokenizer.json"))
    theirs = HFTokenizer.from_file(str(hf / "tokenizer.json"))
    assert [mine.encode(t).ids for t in texts] == [theirs.encode(t).ids for t in texts]
    check_answers_alike(imported, reference)


@pytest.mark.parametrize("kind", CHECKED_TYPES)
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"llama"}))  # llama: below
def test_each_family_in_each_checked_type(family, kind, tiny_hf, tmp_path):
    _, imported, reference = build(tmp_path, tiny_hf(family), only(kind))
    check_answers_alike(imported, reference)


@pytest.mark.parametrize("kind", TYPES)
def test_each_tensor_type(kind, tiny_hf, tmp_path):
    """Every matrix in ``kind``: each imported weight, dequantized by MLX, equals the gguf
    package's decoding of its tensor; then the same answers as the reference."""
    gguf_path, imported, reference = build(tmp_path, tiny_hf("llama"), only(kind))
    expected = reference_weights(gguf_path, tiny_hf("llama"))
    weights = mx.load(str(imported / "model.safetensors"))
    config = json.loads((imported / "config.json").read_text())
    quantization = config.get("quantization", {})
    for name, value in expected.items():
        module = name.removesuffix(".weight")
        if f"{module}.scales" in weights:
            spec = quantization.get(module, quantization)
            got = mx.dequantize(weights[name], weights[f"{module}.scales"].astype(mx.float32),
                                weights[f"{module}.biases"].astype(mx.float32),
                                spec["group_size"], spec["bits"])
        else:
            got = weights[name]
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), value, err_msg=name)
    scales = {weights[n].dtype for n in weights if n.endswith((".scales", ".biases"))}
    if kind == "Q8_K":  # float32: no 8-bit affine form is exact
        assert "quantization" not in config and not scales
    else:  # the 32-weight types' scales are float16 values, the K-quants' products are not
        assert scales == ({mx.float32} if kind.endswith("_K") else {mx.float16})
    check_answers_alike(imported, reference)


@pytest.mark.parametrize("change, refused", [
    ({"deepseek2.expert_gating_func": 1}, "DeepSeek-V2"),  # softmax router
    ({"deepseek2.rope.scaling.type": "yarn", "deepseek2.rope.scaling.factor": 40.0},
     "DeepSeek-V3"),
])
def test_other_deepseek2_layouts_are_refused(change, refused, tiny_hf, tmp_path):
    """llama.cpp writes DeepSeek-V2 and V3 as deepseek2 too; Arbor imports GLM-4.7-Flash's."""
    path = write_gguf_like_llama_cpp(tiny_hf("deepseek2"), tmp_path / "m.gguf", only("Q8_0"))
    reader = gguf.GGUFReader(path)
    metadata = {key: field.contents() for key, field in reader.fields.items()}
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    assert hf_config(metadata, "deepseek2", tensors, path)["model_type"] == "glm4_moe_lite"
    with pytest.raises(ModelLoadError, match=refused):
        hf_config({**metadata, **change}, "deepseek2", tensors, path)
