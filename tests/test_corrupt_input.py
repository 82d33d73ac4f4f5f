"""Bad input is one line, never a traceback, and costs nothing already stored.

Each case damages one thing in a copy of a real tiny model (a config field, a weight file, a GGUF
header) and runs the real CLI on it: ``arbor generate --model <it>`` and ``arbor models import
<it>`` must each print exactly one line ``arbor: error: ...`` naming the file and the field or
tensor, and exit with status 2; ``Engine.load`` raises the ``ModelLoadError`` behind that line;
and the model store, which already holds a model, is byte for byte as it was.

Fault classes covered: config sizes that are zero, negative, missing or of the wrong type, head
counts that do not divide, unknown or incomplete RoPE scaling, bad quantization blocks, unknown
or malformed ``model_type``; weight files that are truncated, have a corrupt header, miss
tensors (experts among them), carry unknown tensors, wrong shapes or wrong dtypes; GGUF files
with a bad magic, truncated, with metadata of the wrong type or missing, an unknown
architecture, or tensors that do not fit the metadata.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from backend.engine import Engine
from backend.errors import ModelLoadError
from backend.weights.store import ModelStore
from desktop.cli import main
from tests.test_gguf import HEAD_DIM, HEADS, HIDDEN, LAYERS, tiny_hf_weights, write_gguf
from tests.test_loading import write_quantized

Fault = Callable[[Path], None]
DELETE = object()  # as a config value: remove the key

# ---------------------------------------------------------------------------------------------
# Damaging a copy


def set_config(**changes: Any) -> Fault:
    def fault(folder: Path) -> None:
        path = folder / "config.json"
        config = json.loads(path.read_text())
        for key, value in changes.items():
            if value is DELETE:
                config.pop(key, None)
            else:
                config[key] = value
        path.write_text(json.dumps(config))
    return fault


def write_file(name: str, data: bytes) -> Fault:
    def fault(folder: Path) -> None:
        (folder / name).write_bytes(data)
    return fault


def truncate(name: str, keep: float) -> Fault:
    def fault(folder: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: int(len(data) * keep)])
    return fault


def edit_weights(change: Callable[[dict[str, mx.array]], None]) -> Fault:
    def fault(folder: Path) -> None:
        path = folder / "model.safetensors"
        weights = dict(mx.load(str(path)))
        change(weights)
        mx.save_safetensors(str(path), weights)
    return fault


def drop(*names: str) -> Fault:
    def change(weights: dict[str, mx.array]) -> None:
        for name in names:
            del weights[name]
    return edit_weights(change)


def replace(name: str, make: Callable[[mx.array], mx.array]) -> Fault:
    def change(weights: dict[str, mx.array]) -> None:
        weights[name] = make(weights[name])
    return edit_weights(change)


def add(**tensors: mx.array) -> Fault:
    return edit_weights(lambda weights: weights.update(tensors))


def fuse_experts_without_down(weights: dict[str, mx.array]) -> None:
    """transformers' in-memory expert layout (``experts.gate_up_proj``) missing its
    ``experts.down_proj``."""
    prefix = "model.layers.1.mlp.experts"
    gate_up = [mx.concatenate([weights.pop(f"{prefix}.{e}.gate_proj.weight"),
                               weights.pop(f"{prefix}.{e}.up_proj.weight")]) for e in range(8)]
    for e in range(8):
        del weights[f"{prefix}.{e}.down_proj.weight"]
    weights[f"{prefix}.gate_up_proj"] = mx.stack(gate_up)


EXPERTS = "model.layers.1.mlp.experts"
ROPE = {"rope_theta": 10000.0}

# (source model, fault, what the one line must name besides the file)
FOLDER_FAULTS = {
    # -- config sizes: zero, negative, missing, wrong type ------------------------------------
    "heads-zero": ("llama", set_config(num_attention_heads=0), ["num_attention_heads"]),
    "heads-negative": ("llama", set_config(num_attention_heads=-4), ["num_attention_heads"]),
    "heads-string": ("llama", set_config(num_attention_heads="4"), ["num_attention_heads"]),
    "hidden-zero": ("llama", set_config(hidden_size=0), ["hidden_size"]),
    "layers-zero": ("llama", set_config(num_hidden_layers=0), ["num_hidden_layers"]),
    "intermediate-null": ("llama", set_config(intermediate_size=None), ["intermediate_size"]),
    "vocab-missing": ("llama", set_config(vocab_size=DELETE), ["vocab_size"]),
    "vocab-float": ("llama", set_config(vocab_size=383.5), ["vocab_size"]),
    "head-dim-zero": ("llama", set_config(head_dim=0), ["head_dim"]),
    "context-negative": ("llama", set_config(max_position_embeddings=-1),
                         ["max_position_embeddings"]),
    "eps-string": ("llama", set_config(rms_norm_eps="tiny"), ["rms_norm_eps"]),
    "tie-string": ("llama", set_config(tie_word_embeddings="yes"), ["tie_word_embeddings"]),
    "activation-unknown": ("llama", set_config(hidden_act="relu7"), ["hidden_act", "relu7"]),
    "window-zero": ("llama", set_config(sliding_window=0), ["sliding_window"]),
    # -- head counts that do not divide ------------------------------------------------------
    "heads-not-multiple-of-kv": ("llama", set_config(num_attention_heads=3),
                                 ["num_attention_heads 3", "num_key_value_heads 2"]),
    "kv-heads-negative": ("llama", set_config(num_key_value_heads=-2), ["num_key_value_heads"]),
    "hidden-not-multiple-of-heads": ("llama", set_config(hidden_size=62, head_dim=DELETE),
                                     ["hidden_size 62", "num_attention_heads 4"]),
    # -- RoPE ---------------------------------------------------------------------------------
    "rope-unknown-type": ("llama", set_config(rope_parameters={**ROPE, "rope_type": "dynamic",
                                                               "factor": 2.0}), ["dynamic"]),
    "rope-scaling-string": ("llama", set_config(rope_scaling="linear"), ["rope_scaling"]),
    "rope-linear-no-factor": ("llama", set_config(rope_parameters={**ROPE, "rope_type": "linear"}),
                              ["factor"]),
    "rope-yarn-negative-factor": ("llama", set_config(rope_parameters={
        **ROPE, "rope_type": "yarn", "factor": -4.0}), ["factor"]),
    "rope-llama3-degenerate": ("llama", set_config(rope_parameters={
        **ROPE, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
        "high_freq_factor": 2.0}), ["low_freq_factor"]),
    "rope-theta-zero": ("llama", set_config(rope_parameters={"rope_theta": 0}), ["rope_theta"]),
    "rope-theta-string": ("llama", set_config(rope_parameters={"rope_theta": "big"}),
                          ["rope_theta"]),
    # -- model_type and the file itself -------------------------------------------------------
    "model-type-unknown": ("llama", set_config(model_type="transmogrifier"),
                           ["transmogrifier", "llama"]),
    "model-type-number": ("llama", set_config(model_type=5), ["model_type"]),
    "model-type-missing": ("llama", set_config(model_type=DELETE), ["model_type"]),
    "config-not-json": ("llama", write_file("config.json", b"{model_type: llama"), ["config"]),
    "config-a-list": ("llama", write_file("config.json", b"[1, 2]"), ["model_type"]),
    # -- family-specific fields ---------------------------------------------------------------
    "moe-top-k-over-experts": ("qwen3_moe", set_config(num_experts_per_tok=100),
                               ["num_experts_per_tok 100", "num_experts 8"]),
    "moe-no-experts": ("qwen3_moe", set_config(num_experts=0), ["num_experts"]),
    "moe-sparse-step-zero": ("qwen3_moe", set_config(decoder_sparse_step=0),
                             ["decoder_sparse_step"]),
    "moe-expert-size-zero": ("qwen3_moe", set_config(moe_intermediate_size=0),
                             ["moe_intermediate_size"]),
    "moe-mlp-only-layers-string": ("qwen3_moe", set_config(mlp_only_layers="1"),
                                   ["mlp_only_layers"]),
    "next-linear-heads-zero": ("qwen3_next", set_config(linear_num_key_heads=0),
                               ["linear_num_key_heads"]),
    "next-linear-heads-not-dividing": ("qwen3_next", set_config(linear_num_value_heads=3),
                                       ["linear_num_value_heads 3"]),
    "next-rotary-zero": ("qwen3_next", set_config(partial_rotary_factor=0),
                         ["partial_rotary_factor"]),
    "next-rotary-over-one": ("qwen3_next", set_config(partial_rotary_factor=3.0),
                             ["partial_rotary_factor"]),
    "next-conv-kernel-zero": ("qwen3_next", set_config(linear_conv_kernel_dim=0),
                              ["linear_conv_kernel_dim"]),
    "next-layer-types-short": ("qwen3_next", set_config(layer_types=["full_attention"]),
                               ["layer_types"]),
    "next-experts-without-size": ("qwen3_next", set_config(moe_intermediate_size=0),
                                  ["moe_intermediate_size"]),
    "gemma-window-zero": ("gemma3", set_config(sliding_window=0), ["sliding_window"]),
    "gemma-attention-scalar-zero": ("gemma3", set_config(query_pre_attn_scalar=0),
                                    ["query_pre_attn_scalar"]),
    "gemma-activation-unknown": ("gemma3", set_config(hidden_activation="relu7"),
                                 ["hidden_activation"]),
    "gemma-rope-block-string": ("gemma3", set_config(rope_parameters={"full_attention": "x"}),
                                ["rope_parameters"]),
    "gemma-layer-types-string": ("gemma3", set_config(layer_types="full"), ["layer_types"]),
    # -- quantization block -------------------------------------------------------------------
    "quant-group-zero": ("llama-q4", set_config(quantization={"group_size": 0, "bits": 4}),
                         ["quantization.group_size"]),
    "quant-bits-seven": ("llama-q4", set_config(quantization={"group_size": 64, "bits": 7}),
                         ["quantization.bits"]),
    "quant-mode-unknown": ("llama-q4", set_config(quantization={"group_size": 64, "bits": 4,
                                                                "mode": "mxfp4"}), ["mxfp4"]),
    "quant-block-string": ("llama-q4", set_config(quantization="yes"), ["quantization"]),
    "quant-block-missing": ("llama-q4", set_config(quantization=DELETE),
                            ["scales", "no quantization"]),
    "quant-group-disagrees": ("llama-q4", set_config(quantization={"group_size": 32, "bits": 4}),
                              ["scales", "shape"]),
    # -- weight files -------------------------------------------------------------------------
    "weights-truncated": ("llama", truncate("model.safetensors", 0.9),
                          ["model.safetensors", "truncated"]),
    "weights-header-garbage": ("llama", write_file("model.safetensors",
                                                   b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"),
                               ["model.safetensors", "header"]),
    "weights-header-length-huge": ("llama", write_file("model.safetensors",
                                                       b"\xff" * 8 + b"{}"),
                                   ["model.safetensors", "header"]),
    "weights-none": ("llama", lambda f: (f / "model.safetensors").unlink(), ["no .safetensors"]),
    "index-names-missing-shard": ("llama", write_file("model.safetensors.index.json", json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}).encode()),
        ["model-00002-of-00002.safetensors"]),
    "index-corrupt": ("llama", write_file("model.safetensors.index.json", b"[]"), ["index"]),
    "tensor-missing": ("llama", drop("model.norm.weight"), ["missing tensors", "model.norm.weight"]),
    "tensor-wrong-shape": ("llama", replace("model.layers.0.mlp.up_proj.weight", lambda w: w.T),
                           ["model.layers.0.mlp.up_proj.weight", "[64, 128]", "[128, 64]"]),
    "tensor-unknown": ("llama", add(**{"model.layers.0.mystery.weight": mx.zeros((4,))}),
                       ["unexpected tensors", "model.layers.0.mystery.weight"]),
    "tensor-integer-dtype": ("llama", replace("model.norm.weight", lambda w: w.astype(mx.int32)),
                             ["model.norm.weight", "int32"]),
    "expert-missing": ("qwen3_moe", drop(f"{EXPERTS}.3.up_proj.weight"),
                       [f"{EXPERTS}.3.up_proj.weight"]),
    "experts-all-missing": ("qwen3_moe", drop(*[f"{EXPERTS}.{e}.{p}.weight" for e in range(8)
                                                for p in ("gate_proj", "up_proj", "down_proj")]),
                            ["model.layers.1.mlp.switch_mlp"]),
    "expert-odd-shape": ("qwen3_moe", replace(f"{EXPERTS}.5.gate_proj.weight", lambda w: w[:16]),
                         [f"{EXPERTS}.5.gate_proj.weight", "[16, 64]"]),
    "experts-fused-without-down": ("qwen3_moe", edit_weights(fuse_experts_without_down),
                                   [f"{EXPERTS}.down_proj"]),
    "router-missing": ("qwen3_moe", drop("model.layers.1.mlp.gate.weight"),
                       ["model.layers.1.mlp.gate.weight"]),
    "next-expert-missing": ("qwen3_next", drop(f"{EXPERTS}.2.down_proj.weight"),
                            [f"{EXPERTS}.2.down_proj.weight"]),
    "next-qkvz-short": ("qwen3_next", replace("model.layers.0.linear_attn.in_proj_qkvz.weight",
                                              lambda w: w[:100]),
                        ["in_proj_qkvz", "128 rows"]),
    "next-conv-flat": ("qwen3_next", replace("model.layers.0.linear_attn.conv1d.weight",
                                             lambda w: w[:, 0, :]), ["conv1d"]),
    "gemma-norm-missing": ("gemma3", drop("model.layers.2.pre_feedforward_layernorm.weight"),
                           ["model.layers.2.pre_feedforward_layernorm.weight"]),
    "quant-scales-short": ("llama-q4", replace("model.layers.0.mlp.up_proj.scales",
                                               lambda s: s[:, :-1]),
                           ["model.layers.0.mlp.up_proj.scales", "shape"]),
    "quant-weight-not-packed": ("llama-q4", replace("model.layers.0.mlp.up_proj.weight",
                                                    lambda w: w.astype(mx.float32)),
                                ["model.layers.0.mlp.up_proj.weight", "uint32"]),
    "quant-biases-missing": ("llama-q4", drop("model.layers.1.self_attn.o_proj.biases"),
                             ["model.layers.1.self_attn.o_proj.biases"]),
    "quant-scales-on-a-norm": ("llama-q4", add(**{"model.norm.scales": mx.ones((1,)),
                                                  "model.norm.biases": mx.zeros((1,))}),
                               ["model.norm"]),
}

# ---------------------------------------------------------------------------------------------
# Running the CLI and watching the store


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str]) -> str:
    """Run the CLI; assert one ``arbor: error:`` line naming every needle and exit status 2;
    return the message."""
    code = main(argv)
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("arbor: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0].removeprefix("arbor: error: ")


def store_snapshot(root: Path) -> dict[str, str]:
    """Every path under the store root, with a digest of each file's bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


@pytest.fixture
def kept_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir) -> ModelStore:
    """A store that already holds one model ("keep")."""
    monkeypatch.setenv("ARBOR_HOME", str(tmp_path / "home"))
    store = ModelStore()
    store.import_path(tiny_model_dir("llama"), name="keep")
    return store


@pytest.fixture(scope="session")
def source_folders(tiny_model_dir, tmp_path_factory) -> Callable[[str], Path]:
    """Pristine tiny models by name; ``llama-q4`` is the llama in the mlx-community layout."""
    def get(name: str) -> Path:
        if name == "llama-q4":
            dest = tmp_path_factory.getbasetemp() / "corrupt-llama-q4"
            if not dest.exists():
                write_quantized(tiny_model_dir("llama"), dest, bits=4, group=64)
            return dest
        return tiny_model_dir(name)
    return get


def assert_refused_everywhere(capsys, store: ModelStore, model: Path, needles: list[str]) -> None:
    before = store_snapshot(store.root)
    message = refused(capsys, ["generate", "--model", str(model), "--prompt-ids", "1,2",
                               "--max-tokens", "1"], needles)
    with pytest.raises(ModelLoadError) as info:
        Engine.load(str(model))
    assert str(info.value) == message
    refused(capsys, ["models", "import", str(model), "--name", "broken"], needles)
    assert store_snapshot(store.root) == before
    assert store.names() == ["keep"]


# ---------------------------------------------------------------------------------------------
# Model folders


@pytest.mark.parametrize("case", sorted(FOLDER_FAULTS))
def test_damaged_folder_is_refused_in_one_line(case, source_folders, kept_store, capsys,
                                               tmp_path):
    source, fault, needles = FOLDER_FAULTS[case]
    folder = tmp_path / "broken"
    shutil.copytree(source_folders(source), folder)
    fault(folder)
    capsys.readouterr()  # writing a tiny model the first time reports progress
    assert_refused_everywhere(capsys, kept_store, folder, [str(folder), *needles])


def test_the_undamaged_sources_load(source_folders, kept_store, capsys):
    """The faults above are the only thing wrong: each source model runs as it is."""
    for source in sorted({source for source, _, _ in FOLDER_FAULTS.values()}):
        code = main(["generate", "--model", str(source_folders(source)), "--prompt-ids", "1,2",
                     "--max-tokens", "1"])
        assert code == 0, (source, capsys.readouterr().err)


# ---------------------------------------------------------------------------------------------
# GGUF files


def gguf_with(tmp_path: Path, name: str = "broken.gguf", weights=None, **options) -> Path:
    path = tmp_path / name
    write_gguf(path, tiny_hf_weights() if weights is None else weights, **options)
    return path


def without(*names: str) -> dict[str, np.ndarray]:
    weights = tiny_hf_weights()
    for name in names:
        del weights[name]
    return weights


def reshaped(name: str, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    weights = tiny_hf_weights()
    weights[name] = np.zeros(shape, np.float32)
    return weights


def damage_bytes(change: Callable[[bytes], bytes]) -> Callable[[Path], Path]:
    def make(tmp_path: Path) -> Path:
        path = gguf_with(tmp_path)
        path.write_bytes(change(path.read_bytes()))
        return path
    return make


def with_metadata(**fields: Any) -> Callable[[Path], Path]:
    return lambda tmp_path: gguf_with(
        tmp_path, metadata={k.replace("__", "."): v for k, v in fields.items()})


QWEN2_BIASES_ONLY_Q = {f"blk.{i}.attn_q.bias": np.zeros(HEADS * HEAD_DIM, np.float32)
                       for i in range(LAYERS)}

GGUF_FAULTS: dict[str, tuple[Callable[[Path], Path], list[str]]] = {
    "bad-magic": (damage_bytes(lambda b: b"GGUX" + b[4:]), ["not a GGUF file"]),
    "empty": (damage_bytes(lambda b: b""), ["not a GGUF file"]),
    "truncated-in-tensors": (damage_bytes(lambda b: b[: int(len(b) * 0.6)]), ["truncated"]),
    "truncated-in-header": (damage_bytes(lambda b: b[:200]), ["truncated"]),
    "header-garbage": (damage_bytes(lambda b: b[:4] + bytes(range(256)) * 8), ["corrupt"]),
    "heads-string": (with_metadata(llama__attention__head_count="four"),
                     ["llama.attention.head_count", "'four'"]),
    "heads-zero": (with_metadata(llama__attention__head_count=0), ["llama.attention.head_count"]),
    "layers-missing": (with_metadata(llama__block_count=None), ["llama.block_count"]),
    "hidden-missing": (with_metadata(llama__embedding_length=None), ["llama.embedding_length"]),
    "hidden-not-multiple-of-heads": (with_metadata(llama__attention__head_count=6),
                                     ["llama.embedding_length 64", "head_count 6"]),
    "kv-heads-not-dividing": (with_metadata(llama__attention__head_count_kv=3),
                              ["num_attention_heads 4", "num_key_value_heads 3"]),
    "eps-string": (with_metadata(llama__attention__layer_norm_rms_epsilon="small"),
                   ["layer_norm_rms_epsilon"]),
    "rope-base-zero": (with_metadata(llama__rope__freq_base=0.0), ["llama.rope.freq_base"]),
    "rope-scaling-factor-string": (with_metadata(llama__rope__scaling__type="linear",
                                                 llama__rope__scaling__factor="x"),
                                   ["llama.rope.scaling.factor"]),
    "context-negative": (with_metadata(llama__context_length=-5), ["llama.context_length"]),
    "architecture-number": (with_metadata(general__architecture=7), ["architecture 7"]),
    "architecture-unknown": (lambda tmp: gguf_with(tmp, arch="falcon"), ["falcon"]),
    "vocabulary-missing": (with_metadata(tokenizer__ggml__tokens=None), ["tokenizer vocabulary"]),
    "vocabulary-numbers": (with_metadata(tokenizer__ggml__tokens=[1, 2, 3]),
                           ["tokenizer.ggml.tokens"]),
    "token-types-short": (with_metadata(tokenizer__ggml__token_type=[1, 1]),
                          ["tokenizer.ggml.token_type", "2 entries"]),
    "eos-string": (with_metadata(tokenizer__ggml__eos_token_id="end"),
                   ["tokenizer.ggml.eos_token_id"]),
    "tensor-missing": (lambda tmp: gguf_with(tmp, weights=without(
        "model.layers.1.mlp.up_proj.weight")), ["missing tensors", "layers.1.mlp.up_proj"]),
    "tensor-wrong-shape": (lambda tmp: gguf_with(tmp, weights=reshaped(
        "model.layers.0.mlp.up_proj.weight", (128, HIDDEN))),
        ["model.layers.0.mlp.up_proj.weight", "[128, 64]"]),
    "tensor-unknown": (lambda tmp: gguf_with(tmp, extra_tensors={
        "blk.0.mystery.weight": np.zeros(4, np.float32)}), ["blk.0.mystery.weight"]),
    "qwen2-without-all-biases": (lambda tmp: gguf_with(
        tmp, arch="qwen2", pre="qwen2", extra_tensors=QWEN2_BIASES_ONLY_Q),
        ["missing tensors", "k_proj.bias"]),
    "embedding-missing": (lambda tmp: gguf_with(tmp, weights=without(
        "model.embed_tokens.weight")), ["token_embd.weight"]),
}


@pytest.mark.parametrize("case", sorted(GGUF_FAULTS))
def test_damaged_gguf_is_refused_in_one_line(case, kept_store, capsys, tmp_path):
    make, needles = GGUF_FAULTS[case]
    path = make(tmp_path)
    assert_refused_everywhere(capsys, kept_store, path, ["broken.gguf", *needles])


def test_the_undamaged_gguf_loads(kept_store, capsys, tmp_path):
    path = gguf_with(tmp_path, name="fine.gguf")
    code = main(["generate", "--model", str(path), "--prompt-ids", "1,2", "--max-tokens", "1"])
    assert code == 0, capsys.readouterr().err


def test_a_damaged_update_of_an_imported_gguf_keeps_the_earlier_import(kept_store, capsys,
                                                                        tmp_path):
    """A GGUF imported on first use and then replaced by a broken file of the same name: the
    re-import fails in one line and the earlier import is still there, unchanged."""
    path = gguf_with(tmp_path, name="model.gguf")
    assert main(["generate", "--model", str(path), "--prompt-ids", "1,2", "--max-tokens",
                 "1"]) == 0
    capsys.readouterr()
    assert kept_store.names() == ["keep", "model"]
    before = store_snapshot(kept_store.root)
    path.write_bytes(path.read_bytes()[:300])
    refused(capsys, ["generate", "--model", str(path), "--prompt-ids", "1,2"],
            ["model.gguf", "truncated"])
    assert store_snapshot(kept_store.root) == before
    assert main(["generate", "--model", "model", "--prompt-ids", "1,2", "--max-tokens", "1"]) == 0
