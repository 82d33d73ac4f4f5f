"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.api import GenerateRequest
from backend.engine import Engine
from desktop.cli import main

# Every test here needs the GGUF (tests/conftest.py: it fails, never skips, when it is missing).
pytestmark = pytest.mark.usefixtures("default_model_gguf")

QUESTION = "What is the capital of France?"


def test_default_model_answers_paris(capsys):
    code = main(["generate", "--prompt", QUESTION, "--temperature", "0", "--max-tokens", "24",
                 "--json"])
    assert code == 0
    assert "Paris" in json.loads(capsys.readouterr().out)["text"]


@pytest.fixture(scope="module")
def hf_folder_from_transformers(tmp_path_factory, default_model_gguf) -> Path:
    """The same weights as an HF float32 folder, produced by transformers' own GGUF reader."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = tmp_path_factory.mktemp("smollm2-hf")
    gguf = default_model_gguf
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (dest / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(dest)
    return dest


def test_gguf_import_and_hf_folder_give_same_greedy_tokens(hf_folder_from_transformers,
                                                           default_model_gguf):
    request = GenerateRequest(messages=[{"role": "user", "content": QUESTION}], max_tokens=24)
    from_gguf = list(Engine.load(str(default_model_gguf)).generate(request))[-1]
    from_hf = list(Engine.load(str(hf_folder_from_transformers)).generate(request))[-1]
    assert from_gguf.token_ids == from_hf.token_ids
    assert "Paris" in from_gguf.text
