"""The model store: imports of tiny HF folders and GGUF files, quantization, atomicity,
``resolve`` for every kind of reference, and safetensors validation.

Every test points ``ARBOR_HOME`` at its own temporary folder.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from backend.errors import ArborError, ModelLoadError
from backend.weights import store as store_module
from backend.weights.store import DEFAULT_MODEL_NAME, ModelStore, check_safetensors

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 64, 128, 2, 96

CONFIG = {
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "tie_word_embeddings": True,
}


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelStore:
    monkeypatch.setenv("ARBOR_HOME", str(tmp_path / "home"))
    return ModelStore()


def tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def dense(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": dense(VOCAB, HIDDEN),
        "model.norm.weight": 1 + dense(HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        weights |= {
            f"{p}.self_attn.q_proj.weight": dense(HIDDEN, HIDDEN),
            f"{p}.self_attn.k_proj.weight": dense(HIDDEN // 2, HIDDEN),
            f"{p}.self_attn.v_proj.weight": dense(HIDDEN // 2, HIDDEN),
            f"{p}.self_attn.o_proj.weight": dense(HIDDEN, HIDDEN),
            f"{p}.mlp.gate_proj.weight": dense(INTERMEDIATE, HIDDEN),
            f"{p}.mlp.up_proj.weight": dense(INTERMEDIATE, HIDDEN),
            f"{p}.mlp.down_proj.weight": dense(HIDDEN, INTERMEDIATE),
            f"{p}.input_layernorm.weight": 1 + dense(HIDDEN),
            f"{p}.post_attention_layernorm.weight": 1 + dense(HIDDEN),
        }
    return weights


def write_hf_folder(
    folder: Path, weights: dict[str, np.ndarray], shards: int = 1, config: dict | None = None
) -> Path:
    """A Hugging Face folder: config, tokenizer files, safetensors (sharded with an index when
    ``shards > 1``), and things an import must leave out (a .bin checkpoint, a subfolder)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or CONFIG))
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    (folder / "generation_config.json").write_text('{"eos_token_id": 2}')
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    (folder / "onnx").mkdir()
    names = sorted(weights)
    if shards == 1:
        mx.save_safetensors(
            str(folder / "model.safetensors"), {n: mx.array(weights[n]) for n in names}
        )
        return folder
    weight_map = {}
    for index, part in enumerate(np.array_split(np.array(names), shards)):
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(folder / file), {n: mx.array(weights[n]) for n in part})
        weight_map |= {n: file for n in part}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return folder


def load_all(folder: Path) -> dict[str, mx.array]:
    arrays: dict[str, mx.array] = {}
    for file in sorted(folder.glob("*.safetensors")):
        arrays |= mx.load(str(file))
    return arrays


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A tiny F32 llama GGUF with a 256-byte vocabulary (enough for the store's purposes)."""
    weights = tiny_weights(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    spelled = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    writer.add_token_list(["<|endoftext|>"] + [spelled[b] for b in range(VOCAB - 2)] + ["AB"])
    writer.add_token_types([3] + [1] * (VOCAB - 1))
    writer.add_token_merges([f"{spelled[65]} {spelled[66]}"])  # "A B"
    writer.add_eos_token_id(0)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    leaf = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
            "post_attention_layernorm": "ffn_norm"}  # fmt: skip
    for name, value in weights.items():
        if name not in names:
            _, _, layer, rest = name.split(".", 3)
            names[name] = f"blk.{layer}.{leaf[rest.removesuffix('.weight')]}.weight"
        writer.add_tensor(names[name], value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def parameter_count(weights: dict[str, np.ndarray]) -> int:
    return sum(value.size for value in weights.values())


# ---------------------------------------------------------------------------------------------
# Importing Hugging Face folders


def test_store_root_follows_arbor_home(store: ModelStore, tmp_path: Path) -> None:
    assert store.root == tmp_path / "home" / "models"
    assert store.list() == []


@pytest.mark.parametrize("shards", [1, 3])
def test_import_hf_folder_as_is(store: ModelStore, tmp_path: Path, shards: int) -> None:
    weights = tiny_weights()
    src = write_hf_folder(tmp_path / "Tiny-Llama", weights, shards=shards)
    model = store.import_path(src)

    assert model.name == "Tiny-Llama" and model.path == store.root / "Tiny-Llama"
    assert (model.architecture, model.quantization) == ("llama", None)
    assert model.parameters == parameter_count(weights)
    assert model.size_bytes > sum(v.nbytes for v in weights.values())
    files = {p.name for p in model.path.iterdir()}
    assert {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= files
    assert "pytorch_model.bin" not in files and "onnx" not in files
    assert ("model.safetensors.index.json" in files) == (shards > 1)
    for name, value in load_all(model.path).items():
        np.testing.assert_array_equal(np.array(value), weights[name])
    assert store.list() == [model]
    assert store.get("Tiny-Llama") == model


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shards", [1, 2])
def test_import_with_quantize(store: ModelStore, tmp_path: Path, bits: int, shards: int) -> None:
    weights = tiny_weights()
    src = write_hf_folder(tmp_path / "tiny", weights, shards=shards)
    model = store.import_path(src, name="tiny-q", quantize=bits)

    config = json.loads((model.path / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": bits}
    assert model.quantization == f"{bits}-bit g64"
    assert model.parameters == parameter_count(weights)
    arrays = load_all(model.path)
    linear = [n for n, v in weights.items() if v.ndim == 2]
    assert len(linear) == 1 + 7 * LAYERS  # the embedding and every projection
    for name in linear:
        module = name.removesuffix(".weight")
        assert arrays[name].dtype == mx.uint32
        assert arrays[f"{module}.scales"].dtype == mx.float32
        got = mx.dequantize(
            arrays[name],
            arrays[f"{module}.scales"],
            arrays[f"{module}.biases"],
            group_size=64,
            bits=bits,
        )
        assert np.abs(np.array(got) - weights[name]).max() < (0.04 if bits == 4 else 0.003), name
    np.testing.assert_array_equal(
        np.array(arrays["model.norm.weight"]), weights["model.norm.weight"]
    )
    if shards > 1:
        index = json.loads((model.path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(arrays)


def test_quantize_keeps_already_quantized_weights(store: ModelStore, tmp_path: Path) -> None:
    """An mlx-community folder with one 4-bit group-32 layer: --quantize 8 leaves that layer's
    bytes alone and records it as an override."""
    weights = {name: mx.array(value) for name, value in tiny_weights().items()}
    module = "model.layers.0.mlp.down_proj"
    packed, scales, biases = mx.quantize(weights.pop(f"{module}.weight"), group_size=32, bits=4)
    weights |= {f"{module}.weight": packed, f"{module}.scales": scales, f"{module}.biases": biases}
    src = tmp_path / "mlx-community-tiny"
    src.mkdir()
    mx.save_safetensors(str(src / "model.safetensors"), weights)
    config = {
        **CONFIG,
        "quantization": {"group_size": 32, "bits": 4},
        "quantization_config": {"group_size": 32, "bits": 4},
    }
    (src / "config.json").write_text(json.dumps(config))

    model = store.import_path(src, quantize=8)
    out = json.loads((model.path / "config.json").read_text())
    assert out["quantization"] == {
        "group_size": 64,
        "bits": 8,
        module: {"group_size": 32, "bits": 4},
    }
    assert out["quantization_config"] == out["quantization"]
    assert model.quantization == "8-bit g64 + 4-bit g32"  # the default first
    arrays = load_all(model.path)
    for suffix in ("weight", "scales", "biases"):
        np.testing.assert_array_equal(
            np.array(arrays[f"{module}.{suffix}"]), np.array(weights[f"{module}.{suffix}"])
        )
    assert model.parameters == parameter_count(tiny_weights())


def test_names_conflicts_and_removal(store: ModelStore, tmp_path: Path) -> None:
    first = store.import_path(write_hf_folder(tmp_path / "a", tiny_weights(0)), name="m")
    assert store.import_path(tmp_path / "a", name="m") == first  # the same import again: a no-op
    other = write_hf_folder(tmp_path / "b", tiny_weights(1))
    with pytest.raises(ModelLoadError, match="'m' already exists"):
        store.import_path(other, name="m")
    with pytest.raises(ModelLoadError, match="already exists"):
        store.import_path(tmp_path / "a", name="m", quantize=4)  # same source, other options
    with pytest.raises(ModelLoadError, match="invalid model name"):
        store.import_path(other, name="../escape")
    store.import_path(other, name="n")
    assert [m.name for m in store.list()] == ["m", "n"]

    store.remove("m")
    assert [m.name for m in store.list()] == ["n"]
    with pytest.raises(ModelLoadError, match=r"no stored model named 'm' \(available: n\)"):
        store.get("m")
    with pytest.raises(ModelLoadError, match="available: n"):
        store.remove("m")
    assert [p.name for p in store.root.iterdir()] == ["n"]


def test_failed_import_leaves_nothing_behind(store: ModelStore, tmp_path: Path) -> None:
    # 1. A truncated shard is caught by validation before anything is written.
    src = write_hf_folder(tmp_path / "broken", tiny_weights(), shards=2)
    shard = sorted(src.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="truncated"):
        store.import_path(src)
    # 2. A failure half-way through writing (here: cancelled from the progress callback).
    good = write_hf_folder(tmp_path / "good", tiny_weights())

    def cancel(fraction: float, message: str) -> None:
        raise ArborError("cancelled")

    with pytest.raises(ArborError, match="cancelled"):
        store.import_path(good, quantize=4, progress=cancel)
    with pytest.raises(ModelLoadError, match="unreadable"):
        (tmp_path / "bad-config").mkdir()
        (tmp_path / "bad-config" / "config.json").write_text("{not json")
        store.import_path(tmp_path / "bad-config")
    assert store.list() == []
    assert list(store.root.iterdir()) == []  # no half-written folders either


def test_leftovers_of_dead_processes_are_swept(store: ModelStore, tmp_path: Path) -> None:
    store.root.mkdir(parents=True)
    dead = store.root / ".partial-999999999-abc"  # no such pid
    (dead / "half").mkdir(parents=True)
    alive = store.root / f".partial-{os.getpid()}-xyz"
    alive.mkdir()
    store.import_path(write_hf_folder(tmp_path / "m", tiny_weights()))
    assert not dead.exists() and alive.exists()


# ---------------------------------------------------------------------------------------------
# GGUF files and resolve()


def test_import_gguf_file(store: ModelStore, tmp_path: Path) -> None:
    model = store.import_path(write_tiny_gguf(tmp_path / "Tiny.F32.gguf"), quantize=8)
    assert model.name == "Tiny.F32"
    assert (model.architecture, model.quantization) == ("llama", "8-bit g64")
    assert model.parameters == parameter_count(tiny_weights())
    assert (model.path / "tokenizer.json").is_file()


def test_resolve_each_kind_of_reference(
    store: ModelStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write_hf_folder(tmp_path / "hf-folder", tiny_weights())
    assert store.resolve(folder) == folder  # a folder is used in place, not imported
    assert store.resolve(str(folder)) == folder
    assert store.list() == []

    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf")
    imported = store.resolve(gguf_path)
    assert imported == store.root / "tiny"
    calls = []
    monkeypatch.setattr("backend.weights.gguf.import_gguf", lambda *a, **k: calls.append(a))
    assert store.resolve(str(gguf_path)) == imported and calls == []  # imported once
    assert store.resolve("tiny") == imported  # and now a store name
    monkeypatch.undo()

    os.utime(gguf_path, ns=(0, 0))  # the file changed: re-imported in place of the stale entry
    assert store.resolve(gguf_path) == imported
    assert json.loads((imported / "arbor_import.json").read_text())["mtime_ns"] == 0
    assert [m.name for m in store.list()] == ["tiny"]

    # A different file with the same stem does not clobber the first one.
    (tmp_path / "elsewhere").mkdir()
    second = store.resolve(write_tiny_gguf(tmp_path / "elsewhere" / "tiny.gguf", seed=1))
    assert second != imported and second.name.startswith("tiny-")

    with pytest.raises(ModelLoadError, match="not a model folder, a .gguf file or a stored model"):
        store.resolve("no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        store.resolve(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="not a model"):
        store.resolve(tmp_path / "notes.txt")


def test_default_model_missing_is_a_load_error(
    store: ModelStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(store_module, "DEFAULT_MODEL_DIR", tmp_path / "not-installed")
    with pytest.raises(ModelLoadError, match="default model is not installed: reinstall Arbor"):
        store.resolve(None)


def test_default_model_that_moved_with_the_app_stays_the_default(
    store: ModelStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The app copied or reinstalled elsewhere, same data dir: its embedded file is still the
    default model (reused while unchanged, replaced once changed), never 'already exists'."""
    import shutil

    first = tmp_path / "app one" / "default_model"
    first.mkdir(parents=True)
    monkeypatch.setattr(store_module, "DEFAULT_MODEL_DIR", first)
    write_tiny_gguf(first / "tiny.gguf")
    path = store.resolve(None)
    moved = tmp_path / "app two" / "default_model"
    moved.mkdir(parents=True)
    shutil.copy2(first / "tiny.gguf", moved / "tiny.gguf")  # same bytes, size and mtime
    monkeypatch.setattr(store_module, "DEFAULT_MODEL_DIR", moved)
    with monkeypatch.context() as patched:
        patched.setattr("backend.weights.gguf.import_gguf",
                        lambda *a, **k: pytest.fail("an unchanged default model was imported again"))
        assert store.resolve(None) == path
    write_tiny_gguf(moved / "tiny.gguf", seed=1)  # an update of the app brings another file
    assert store.resolve(None) == path
    record = json.loads((path / store_module.IMPORT_RECORD).read_text())
    assert record["source"] == str((moved / "tiny.gguf").resolve())


@pytest.mark.slow
@pytest.mark.usefixtures("default_model_gguf")  # fails, never skips, without the default model
def test_resolve_none_imports_the_default_model_once(
    store: ModelStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = store.resolve(None)
    assert path == store.root / DEFAULT_MODEL_NAME
    model = store.get(DEFAULT_MODEL_NAME)
    # Q4_1 blocks of 32, the embedding Q8_0
    assert (model.architecture, model.quantization) == ("llama", "4-bit g32 + 8-bit g32")
    assert model.parameters == 134_515_008  # SmolLM2-135M, embedding tied
    monkeypatch.setattr(
        "backend.weights.gguf.import_gguf", lambda *a, **k: pytest.fail("imported twice")
    )
    assert store.resolve(None) == path


# ---------------------------------------------------------------------------------------------
# check_safetensors


def test_check_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "ok.safetensors"
    mx.save_safetensors(str(path), {"a": mx.zeros((3, 4)), "b": mx.zeros((2,), dtype=mx.bfloat16)})
    infos = check_safetensors(path)
    assert (infos["a"].dtype, infos["a"].shape, infos["b"].dtype) == ("F32", (3, 4), "BF16")

    data = path.read_bytes()
    cases = {
        "short.safetensors": data[:-4],  # data shorter than the header says
        "tiny.safetensors": data[:5],  # not even a header length
        "header.safetensors": data[:20],  # header cut off
        "garbage.safetensors": struct.pack("<Q", 7) + b"{nope!}",
        "huge.safetensors": struct.pack("<Q", 1 << 40) + b"{}",
    }
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_len])
    header["a"]["shape"] = [3, 5]  # byte range no longer matches the shape
    bad = json.dumps(header).encode()
    cases["shape.safetensors"] = struct.pack("<Q", len(bad)) + bad + data[8 + header_len :]
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
            check_safetensors(tmp_path / name)
    with pytest.raises(ModelLoadError, match="cannot read"):
        check_safetensors(tmp_path / "missing.safetensors")
