"""llama.cpp's block types as MLX affine quantization: every type that stays quantized decodes,
through ``mx.dequantize``, to exactly what the ``gguf`` package's own decoder gives; the layouts
MLX cannot multiply (codes of 2/3/5/6 bits on the kernels, groups of 16) load and run.

The blocks are random bytes with finite scales: every bit of every field is exercised, which a
quantizer's output (codes clustered by the data) would not do.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from backend import kernels
from backend.weights.gguf_quants import AFFINE_TYPES, pack_codes, q8_k_values, to_affine
from backend.weights.quantize import QuantSpec, widen_codes
from tests.fixtures.kquants import encode

# Byte offsets of each type's float16 scale fields (d, and dmin / m where the type has one).
SCALE_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
                "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(name: str, lead: tuple[int, ...], cols: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks of type ``name`` for ``lead`` rows of ``cols`` weights, with finite
    float16 scales of both signs (random bytes there could be NaN or infinite)."""
    rng = np.random.default_rng(seed)
    block, block_bytes = gguf.GGML_QUANT_SIZES[T[name]]
    blocks = rng.integers(0, 256, size=(*lead, cols // block, block_bytes), dtype=np.uint8)
    for start in SCALE_FIELDS[name]:
        scale = rng.uniform(-0.02, 0.02, size=(*blocks.shape[:-1], 1)).astype(np.float16)
        blocks[..., start:start + 2] = scale.view(np.uint8)
    return blocks.reshape(*lead, -1)


def mlx_values(raw: np.ndarray, name: str) -> np.ndarray:
    affine = to_affine(raw, name)
    values = mx.dequantize(mx.array(pack_codes(affine.codes, affine.bits)),
                           mx.array(affine.scales), mx.array(affine.biases),
                           group_size=affine.group_size, bits=affine.bits)
    return np.array(values)


def test_every_affine_type_is_covered():
    assert AFFINE_TYPES == set(SCALE_FIELDS)


@pytest.mark.parametrize("name", sorted(SCALE_FIELDS))
def test_mlx_dequantizes_each_type_to_the_gguf_packages_values(name):
    raw = random_blocks(name, (3, 5), 512)
    expected = gguf.quants.dequantize(raw, T[name])
    got = mlx_values(raw, name)
    assert got.shape == expected.shape == (3, 5, 512)
    np.testing.assert_array_equal(got, expected)
    # Bit for bit, but for the sign of zero: where a negative scale meets a zero code offset,
    # the gguf package computes -0.0 (scale * 0) and MLX +0.0 (scale * c - scale * c).
    differ = got.view(np.uint32) != expected.view(np.uint32)
    assert (expected[differ] == 0).all()


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_layouts_of_the_k_quants(name):
    affine = to_affine(random_blocks(name, (2,), 512), name)
    assert (affine.bits, affine.group_size) == {"Q4_K": (4, 32), "Q5_K": (5, 32),
                                                "Q6_K": (6, 16)}[name]
    assert affine.scales.shape == (2, 512 // affine.group_size) == affine.biases.shape
    assert affine.codes.max() < 2 ** affine.bits


def test_encoded_k_quants_are_close_to_their_source():
    """The test encoders (tests/fixtures/kquants.py) write valid blocks of the right values."""
    x = (np.random.default_rng(1).standard_normal((4, 512)) * 0.05).astype(np.float32)
    for name, tolerance in (("Q4_K", 0.06), ("Q5_K", 0.03), ("Q6_K", 0.02), ("Q2_K", 0.3),
                            ("Q3_K", 0.2)):
        values = gguf.quants.dequantize(encode(x, name), T[name])
        assert np.abs(values - x).max() <= tolerance * np.abs(x).max(), name
    q8k = q8_k_values(encode(x, "Q8_K"))
    assert np.abs(q8k - x).max() <= 0.005 * np.abs(x).max()


def test_q8_k_is_d_times_q():
    x = (np.random.default_rng(2).standard_normal((3, 256)) * 0.05).astype(np.float32)
    raw = encode(x, "Q8_K").reshape(3, 292)
    d = np.ascontiguousarray(raw[:, :4]).view(np.float32)
    q = np.ascontiguousarray(raw[:, 4:260]).view(np.int8).astype(np.float32)
    np.testing.assert_array_equal(q8_k_values(raw), d * q)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_codes_is_mlx_layout(bits):
    codes = np.random.default_rng(bits).integers(0, 2 ** bits, size=(3, 7, 256)).astype(np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == np.uint32 and packed.shape == (3, 7, 256 * bits // 32)
    ones = mx.ones((3, 7, 8))
    unpacked = mx.dequantize(mx.array(packed), ones, mx.zeros_like(ones), group_size=32,
                             bits=bits)
    np.testing.assert_array_equal(np.array(unpacked), codes)


@pytest.mark.parametrize("bits,group", [(2, 16), (3, 16), (5, 32), (6, 16), (4, 16)])
def test_widened_codes_hold_the_same_values(bits, group):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2 ** bits, size=(6, 256)).astype(np.uint8)
    scales = mx.array(rng.standard_normal((6, 256 // group)).astype(np.float32))
    biases = mx.array(rng.standard_normal((6, 256 // group)).astype(np.float32))
    packed = mx.array(pack_codes(codes, bits))
    wide = widen_codes(packed, QuantSpec(group, bits))
    assert wide.shape == (6, 64) and wide.dtype == mx.uint32
    assert mx.array_equal(mx.dequantize(wide, scales, biases, group, 8),
                          mx.dequantize(packed, scales, biases, group, bits))


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_kernels_multiply_8_bit_codes_in_groups_of_16(rows):
    """Q6_K-sized groups: the kernel product (few rows) and the dequantize + BLAS one (many)
    equal the product with MLX's own dequantized matrix."""
    assert kernels.quantized_layout_supported(8, 16)
    assert not kernels.quantized_layout_supported(4, 16)
    rng = np.random.default_rng(rows)
    wq = mx.array(pack_codes(rng.integers(0, 256, size=(24, 512)).astype(np.uint8), 8))
    scales = mx.array((rng.standard_normal((24, 32)) * 0.01).astype(np.float32))
    biases = mx.array((rng.standard_normal((24, 32)) * 0.01).astype(np.float32))
    x = mx.array(rng.standard_normal((rows, 512)).astype(np.float32))
    dense = mx.dequantize(wq, scales, biases, group_size=16, bits=8)
    assert mx.array_equal(kernels.dequantize(wq, scales, biases, 16, 8), dense)
    got = kernels.quantized_linear(x, wq, scales, biases, 16, 8)
    expected = np.array(x @ dense.T)  # float32 sums of 512 terms in another order
    np.testing.assert_allclose(np.array(got), expected, rtol=1e-4,
                               atol=1e-5 * np.abs(expected).max())


def _quantized_folder(tmp_path, specs: dict[str, QuantSpec]):
    """A tiny llama folder whose named layers hold affine codes in ``specs``' layouts."""
    import json

    from safetensors.numpy import load_file, save_file

    from tests.fixtures.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "m", "llama", hidden_size=256, intermediate_size=256)
    weights = load_file(folder / "model.safetensors")
    rng = np.random.default_rng(0)
    block: dict = {}
    for module, spec in specs.items():
        rows, cols = weights[f"{module}.weight"].shape
        codes = rng.integers(0, 2 ** spec.bits, size=(rows, cols)).astype(np.uint8)
        weights[f"{module}.weight"] = pack_codes(codes, spec.bits)
        groups = cols // spec.group_size
        weights[f"{module}.scales"] = (rng.standard_normal((rows, groups)) * 0.004).astype(
            np.float32)
        weights[f"{module}.biases"] = (rng.standard_normal((rows, groups)) * 0.01).astype(
            np.float32)
        block[module] = spec.as_config()
    save_file(weights, folder / "model.safetensors", metadata={"format": "mlx"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": 64, "bits": 4, **block}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


SMALL_LAYOUTS = {
    "model.layers.0.self_attn.v_proj": QuantSpec(16, 6),  # Q6_K
    "model.layers.1.mlp.down_proj": QuantSpec(16, 3),  # Q3_K
    "model.layers.0.mlp.up_proj": QuantSpec(32, 5),  # Q5_K
    "lm_head": QuantSpec(16, 2),  # Q2_K
}


@pytest.mark.usefixtures("native_kernels")
def test_layouts_mlx_cannot_multiply_load_on_both_paths(tmp_path, monkeypatch):
    """On the kernels, 2/3/5/6-bit codes become 8-bit codes of the same values (groups of 16
    too); without them, groups of 16 are dequantized and 5-bit codes stay on MLX's own
    quantized matmul. Both give the logits of the same weights dequantized up front."""
    from backend.models.cpu_linear import KernelQuantizedLinear
    from backend.weights.loading import load_model

    folder = _quantized_folder(tmp_path, SMALL_LAYOUTS)
    tokens = mx.array(np.random.default_rng(3).integers(0, 380, size=(1, 24)))

    def logits(loaded):
        return np.array(loaded.model(tokens, loaded.model.make_caches()))

    reference = logits(load_model(folder, cpu_kernels=False))  # everything dequantized
    on_kernels = load_model(folder)
    assert on_kernels.cpu_kernels
    modules = dict(on_kernels.model.named_modules())
    for path, spec in SMALL_LAYOUTS.items():
        layer = modules[path]
        assert isinstance(layer, KernelQuantizedLinear)
        assert (layer.bits, layer.group_size) == (8, spec.group_size)
    np.testing.assert_allclose(logits(on_kernels), reference, rtol=1e-4, atol=1e-4)

    monkeypatch.setenv("ARBOR_DEQUANTIZE_LIMIT", "0")  # keep MLX's quantized layers
    plain = load_model(folder, cpu_kernels=False)
    modules = dict(plain.model.named_modules())
    assert isinstance(modules["model.layers.0.mlp.up_proj"], nn.QuantizedLinear)
    assert modules["model.layers.0.mlp.up_proj"].bits == 5
    for path in ("model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj", "lm_head"):
        assert type(modules[path]) is nn.Linear, path  # groups of 16: dequantized
    np.testing.assert_allclose(logits(plain), reference, rtol=1e-4, atol=1e-4)


#: Stacked experts of every Qwen3-MoE layer in K-quant layouts (llama.cpp's ``ffn_*_exps``).
EXPERT_LAYOUTS = {"gate_proj": QuantSpec(16, 6),  # Q6_K
                  "up_proj": QuantSpec(32, 5),  # Q5_K
                  "down_proj": QuantSpec(16, 3)}  # Q3_K


def _quantized_moe_folder(tmp_path):
    """A tiny Qwen3-MoE folder whose experts are stacked (``mlp.switch_mlp.*``, as the GGUF
    import writes them) and hold random codes in ``EXPERT_LAYOUTS``."""
    import json

    from safetensors.numpy import load_file, save_file

    from tests.fixtures.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "moe", "qwen3_moe", decoder_sparse_step=1)
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    rng = np.random.default_rng(5)
    block: dict = {}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp"
        for proj, spec in EXPERT_LAYOUTS.items():
            stacked = np.stack([weights.pop(f"{prefix}.experts.{e}.{proj}.weight")
                                for e in range(config["num_experts"])])
            experts, rows, cols = stacked.shape
            codes = rng.integers(0, 2 ** spec.bits, size=(experts * rows, cols)).astype(np.uint8)
            module = f"{prefix}.switch_mlp.{proj}"
            weights[f"{module}.weight"] = pack_codes(codes, spec.bits).reshape(experts, rows, -1)
            groups = (experts, rows, cols // spec.group_size)
            weights[f"{module}.scales"] = (rng.standard_normal(groups) * 0.03 / 2 ** spec.bits
                                           ).astype(np.float32)
            weights[f"{module}.biases"] = (rng.standard_normal(groups) * 0.02).astype(np.float32)
            block[module] = spec.as_config()
    save_file(weights, folder / "model.safetensors", metadata={"format": "mlx"})
    config["quantization"] = {"group_size": 64, "bits": 4, **block}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.usefixtures("native_kernels")
def test_stacked_experts_in_groups_of_16_stay_quantized(tmp_path, monkeypatch):
    """GGUF experts in Q6_K / Q3_K (groups of 16, which MLX's gather_qmm does not take) load as
    8-bit codes of the same values on the kernels' gathered product; Q5_K experts keep their
    5-bit codes on gather_qmm. A prefill (experts one dense product each) and decode steps
    (gathered pairs) give the logits of the same weights dequantized up front; without the
    kernels the groups of 16 are dequantized at load."""
    from backend.models.moe import QuantizedSwitchLinear, SwitchLinear
    from backend.weights.loading import load_model

    folder = _quantized_moe_folder(tmp_path)
    tokens = mx.array(np.random.default_rng(6).integers(0, 380, size=(1, 40)))

    def logits(loaded):
        model = loaded.model
        caches = model.make_caches()
        prefill = model(tokens[:, :36], caches)  # 36 tokens: one dense product per expert
        steps = [model(tokens[:, i:i + 1], caches) for i in range(36, 40)]  # gathered pairs
        return np.concatenate([np.array(prefill)] + [np.array(s) for s in steps], axis=1)

    reference = logits(load_model(folder, cpu_kernels=False))  # everything dequantized
    on_kernels = load_model(folder)
    assert on_kernels.cpu_kernels
    modules = dict(on_kernels.model.named_modules())
    for proj, spec in EXPERT_LAYOUTS.items():
        layer = modules[f"model.layers.0.mlp.switch_mlp.{proj}"]
        assert isinstance(layer, QuantizedSwitchLinear) and layer.native_ops
        widened = 8 if spec.group_size == 16 else spec.bits
        assert (layer.bits, layer.group_size) == (widened, spec.group_size), proj
    np.testing.assert_allclose(logits(on_kernels), reference, rtol=1e-4, atol=1e-4)

    monkeypatch.setenv("ARBOR_DEQUANTIZE_LIMIT", "0")  # keep MLX's quantized layers
    plain = load_model(folder, cpu_kernels=False)
    modules = dict(plain.model.named_modules())
    assert modules["model.layers.0.mlp.switch_mlp.up_proj"].bits == 5
    for proj in ("gate_proj", "down_proj"):  # groups of 16: dequantized
        assert type(modules[f"model.layers.0.mlp.switch_mlp.{proj}"]) is SwitchLinear, proj
    np.testing.assert_allclose(logits(plain), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("native", [False, True])
def test_stacked_experts_in_groups_of_16_multiply_on_every_path(native, request):
    """``QuantizedSwitchLinear`` with 8-bit codes in groups of 16: gathered pairs and one
    expert's rows equal the products with the dequantized stack, through the kernel
    (``native``) and through MLX (the picked experts dequantized)."""
    from backend.models.moe import QuantizedSwitchLinear

    if native:
        request.getfixturevalue("native_kernels")
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 256, size=(6 * 24, 64)).astype(np.uint8)
    weight = mx.array(pack_codes(codes, 8).reshape(6, 24, 16))
    scales = mx.array((rng.standard_normal((6, 24, 4)) * 0.01).astype(np.float32))
    biases = mx.array((rng.standard_normal((6, 24, 4)) * 0.1).astype(np.float32))
    layer = QuantizedSwitchLinear.from_arrays(weight, scales, biases, 16, 8)
    layer.native_ops = native
    dense = np.array(mx.dequantize(weight, scales, biases, 16, 8), np.float64)  # (6, 24, 64)
    x = mx.array(rng.standard_normal((2, 3, 1, 1, 64)).astype(np.float32))
    indices = mx.array(rng.integers(0, 6, size=(2, 3, 2)).astype(np.uint32))
    if native:  # the kernel takes the layout
        assert kernels.gather_quantized_linear(x.reshape(6, 64), weight, scales, biases,
                                               indices[..., 0].reshape(6), 16, 8) is not None
    got = np.array(layer(x, indices))  # SwitchGLU's shapes: (B, N, 1, 1, D) by (B, N, k)
    want = np.einsum("bnd,bnkod->bnko", np.array(x, np.float64)[:, :, 0, 0],
                     dense[np.array(indices)])[..., None, :]
    assert got.shape == want.shape == (2, 3, 2, 1, 24)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    rows = mx.array(rng.standard_normal((40, 64)).astype(np.float32))
    np.testing.assert_allclose(np.array(layer.expert(rows, 4)),
                               np.array(rows, np.float64) @ dense[4].T, rtol=1e-5, atol=1e-5)
