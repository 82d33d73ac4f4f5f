"""Sliding-window, hybrid recurrent and MoE models: parity, restore-and-regenerate, quantized experts.

The plain parity table (``test_parity.py``) already runs the Gemma 3, Qwen3-Next and Qwen3-MoE rows
(full forward, chunks 7 + 13, decode). This file adds what those rows need beyond it:

1. Qwen3-Next with *long-memory* gates (the tiny model's default decay forgets within a few
   tokens, which would hide state-carrying bugs), 150 tokens so the chunked scan runs several
   chunks, mixed chunk schedules; Gemma 3 with chunks that straddle the window wrap, with and
   without the CPU query blocking. References: transformers (CPU torch) and mlx-lm.
2. For each cache kind (full, rotating, recurrent): snapshot at k, continue, restore to k,
   regenerate == a fresh run (greedy); and a speculative verify transaction (snapshots at each
   draft offset, one batched write, restore to the accepted count) == plain greedy decoding,
   with the sliding window wrapping inside a verify block.
3. Stacked experts quantized to 4 and 8 bits (mlx-community stacked layout and per-expert
   layout) load through the loader and match the dequantized float model; mlx-lm's Qwen3-Next
   layout (stacked experts, (1 + w) norms, conv (C, K, 1)) loads to the same logits.
4. The engine generates with these models, including its prefix-reuse fallback.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from backend.caches import attention
from backend.models.moe import QuantizedSwitchLinear
from backend.weights.loading import load_model
from tests.fixtures.byte_tokenizer import VOCAB_SIZE
from tests.fixtures.references import (
    chunked_logits,
    give_slow_gates,
    mlx_lm_logits,
    random_tokens,
    transformers_logits,
)
from tests.fixtures.tiny_models import write_tiny_model

TOLERANCE = 1e-4


def _max_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


@pytest.fixture(scope="module")
def long_memory_qwen3_next(tmp_path_factory):
    """The tiny Qwen3-Next with slow gates: decay ~0.97 per token instead of ~0.03."""
    return give_slow_gates(write_tiny_model(tmp_path_factory.mktemp("qwen3_next_long"),
                                            "qwen3_next", seed=3))


# -- 1. parity --------------------------------------------------------------------------------

QWEN_SCHEDULES = [
    [150],
    [70, 1, 1, 9, 62, 1, 6],  # chunked and per-token writes, boundaries off the chunk grid
    [3] * 50,
]


def test_qwen3_next_long_memory_matches_transformers_and_mlx_lm(long_memory_qwen3_next):
    folder = long_memory_qwen3_next
    tokens = random_tokens(150)
    reference = transformers_logits(folder, tokens)
    model = load_model(folder, dtype="float32").model
    assert np.abs(reference).max() > 0.5
    for chunks in QWEN_SCHEDULES:
        assert _max_error(chunked_logits(model, tokens, chunks), reference) < TOLERANCE, chunks
    mlx_lm = mlx_lm_logits(folder, tokens)
    assert _max_error(chunked_logits(model, tokens, [150]), mlx_lm) < TOLERANCE


GEMMA_SCHEDULES = [
    [40],
    [5, 11, 3, 9, 1, 1, 6, 4],  # writes straddling the window-8 wrap, single-token steps
    [7, 1, 1, 1, 16, 14],  # exactly full, ring writes, then long writes after a wrap
]


@pytest.mark.parametrize("block", [attention.QUERY_BLOCK, 4])  # 4: blocked CPU attention
def test_gemma3_window_wraps_match_transformers_and_mlx_lm(tiny_model_dir, monkeypatch, block):
    monkeypatch.setattr(attention, "QUERY_BLOCK", block)
    folder = tiny_model_dir("gemma3")
    tokens = random_tokens(40, seed=2)
    reference = transformers_logits(folder, tokens)
    model = load_model(folder, dtype="float32").model
    kinds = {type(c).__name__ for c in model.make_caches()}
    assert kinds == {"RotatingKVCache", "KVCache"}
    for chunks in GEMMA_SCHEDULES:
        assert _max_error(chunked_logits(model, tokens, chunks), reference) < TOLERANCE, chunks
    mlx_lm = mlx_lm_logits(folder, tokens)
    assert _max_error(chunked_logits(model, tokens, [40]), mlx_lm) < TOLERANCE


# -- 2. restore and regenerate, speculative verify ---------------------------------------------

CASES = {"llama": "KVCache", "gemma3": "RotatingKVCache", "qwen3_next": "RecurrentCache"}


def _greedy(model, caches, first: int, steps: int) -> list[int]:
    token, out = first, []
    for _ in range(steps):
        logits = model(mx.array([[token]]), caches)
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
    return out


def _prefill(model, caches, tokens: list[int], chunks: list[int]) -> int:
    pos = 0
    for n in chunks:
        logits = model(mx.array([tokens[pos:pos + n]]), caches)
        pos += n
    return int(mx.argmax(logits[0, -1]).item())


@pytest.fixture(scope="module", params=sorted(CASES))
def case_model(request, tiny_model_dir):
    return request.param, load_model(tiny_model_dir(request.param), dtype="float32").model


def test_snapshot_continue_restore_regenerate_equals_a_fresh_run(case_model):
    case, model = case_model
    prompt = [int(t) for t in random_tokens(24, seed=4)[0]]
    fresh = model.make_caches()
    expected = _greedy(model, fresh, _prefill(model, fresh, prompt, [10, 14]), 16)

    caches = model.make_caches()
    assert any(type(c).__name__ == CASES[case] for c in caches)
    k = 17  # inside the second prefill chunk
    for c in caches:
        c.prepare_snapshots([k])
    first = _prefill(model, caches, prompt, [10, 14])
    assert _greedy(model, caches, first, 16) == expected  # the snapshot changed nothing
    snaps = [c.take_snapshots()[0] for c in caches]
    assert all((s.start, s.end) == (0, k) for s in snaps)
    live = [c.restore(None, k) for c in caches]  # full attention rewinds; the others cannot
    assert live == [type(c).__name__ == "KVCache" for c in caches]
    assert all(c.restore(s, k) for c, s in zip(caches, snaps))
    assert all(c.offset == k for c in caches)
    again = _greedy(model, caches, _prefill(model, caches, prompt[k:], [len(prompt) - k]), 16)
    assert again == expected
    for s in snaps:
        s.close()


def test_speculative_verify_with_restore_equals_plain_greedy(case_model):
    """Drafts that are right, partly right and wrong; every cache commits by restoring to the
    accepted count. Gemma 3's window (8) wraps inside the verify blocks."""
    _, model = case_model
    prompt = [int(t) for t in random_tokens(6, seed=5)[0]]
    plain = model.make_caches()
    first = _prefill(model, plain, prompt, [6])
    expected = [first] + _greedy(model, plain, first, 24)  # plain greedy, 25 tokens

    caches = model.make_caches()
    out, round_ = [_prefill(model, caches, prompt, [6])], 0
    while len(out) < 25:
        # A drafter that proposes 4 tokens: the true continuation, wrong from a varying point.
        wrong_from = round_ % 5
        truth = expected[len(out):len(out) + 4] + [0] * 4
        drafts = [t if i < wrong_from else (t + 7) % VOCAB_SIZE for i, t in enumerate(truth[:4])]
        offset = caches[0].offset
        for c in caches:
            c.prepare_snapshots([offset + i for i in range(1, 5)])
        logits = model(mx.array([[out[-1]] + drafts]), caches)  # one batched verify write
        snaps = [c.take_snapshots() for c in caches]
        predicted = [int(t) for t in np.array(mx.argmax(logits[0], axis=-1))]
        accepted = 0
        while accepted < 4 and drafts[accepted] == predicted[accepted]:
            accepted += 1
        out += drafts[:accepted] + [predicted[accepted]]
        if accepted < 4:  # commit: every cache back to the accepted count
            for c, s in zip(caches, snaps):
                assert c.restore(s[accepted], offset + 1 + accepted)
        for per_cache in snaps:
            for s in per_cache:
                s.close()
        round_ += 1
    assert out[:25] == expected


# -- 3. quantized experts and checkpoint layouts ------------------------------------------------

def _write_folder(folder, config: dict, weights: dict[str, mx.array]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    mx.eval(list(weights.values()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_quantized_experts_load_and_match_the_dequantized_model(tiny_model_dir, tmp_path,
                                                                monkeypatch, bits, layout):
    source = tiny_model_dir("qwen3_moe")
    config = json.loads((source / "config.json").read_text())
    group = 32
    # Off the kernels: its parameters in the checkpoint's layout (float32 panels are not).
    float_model = load_model(source, dtype="float32", cpu_kernels=False).model
    if layout == "stacked":  # mlx-community: sanitized names, experts stacked then quantized
        weights = dict(tree_flatten(float_model.parameters()))
        names = [k for k in weights if ".switch_mlp." in k and k.endswith(".weight")]
    else:  # per-expert 2-D tensors quantized one by one (what a per-tensor import writes)
        weights = mx.load(str(source / "model.safetensors"))
        names = [k for k in weights if ".experts." in k and k.endswith(".weight")]
    dequantized = dict(weights)
    for name in names:
        w, scales, biases = mx.quantize(weights.pop(name), group, bits)
        prefix = name[: -len(".weight")]
        weights.update({name: w, f"{prefix}.scales": scales, f"{prefix}.biases": biases})
        dequantized[name] = mx.dequantize(w, scales, biases, group, bits)
    folder = tmp_path / "quantized"
    _write_folder(folder, {**config, "quantization": {"group_size": group, "bits": bits}},
                  weights)
    reference_folder = tmp_path / "dequantized"
    _write_folder(reference_folder, config, dequantized)

    tokens = random_tokens(40, seed=6)
    schedule = [30, 1, 1, 8]  # grouped expert matmuls for the long write, gathers for the rest
    reference = chunked_logits(load_model(reference_folder, dtype="float32").model, tokens,
                               schedule)
    monkeypatch.setenv("ARBOR_DEQUANTIZE_LIMIT", "0")  # keep the experts quantized
    kept = load_model(folder, dtype="float32")
    assert isinstance(kept.model.model.layers[1].mlp.switch_mlp.gate_proj, QuantizedSwitchLinear)
    assert _max_error(chunked_logits(kept.model, tokens, schedule), reference) < TOLERANCE
    monkeypatch.delenv("ARBOR_DEQUANTIZE_LIMIT")
    expanded = load_model(folder, dtype="float32").model  # CPU default: dequantized at load
    assert _max_error(chunked_logits(expanded, tokens, schedule), reference) < TOLERANCE


def test_qwen3_next_loads_the_mlx_lm_layout(long_memory_qwen3_next, tmp_path):
    """Re-save mlx-lm's own sanitized parameters (stacked experts, norms stored as 1 + w,
    conv weight (C, K, 1)) and load them with Arbor: same logits as the HF folder."""
    from mlx_lm.utils import load_model as mlx_lm_load

    source = long_memory_qwen3_next
    mlx_model, _ = mlx_lm_load(source)
    folder = tmp_path / "mlx_lm_layout"
    shutil.copytree(source, folder)
    (folder / "model.safetensors").unlink()
    weights = dict(tree_flatten(mlx_model.parameters()))
    assert any(".switch_mlp." in k for k in weights)
    _write_folder(folder, json.loads((source / "config.json").read_text()), weights)
    tokens = random_tokens(50, seed=7)
    ours = chunked_logits(load_model(folder, dtype="float32").model, tokens, [20, 30])
    hf = chunked_logits(load_model(source, dtype="float32").model, tokens, [50])
    assert _max_error(ours, hf) < TOLERANCE


# -- 4. the engine -----------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["gemma3", "qwen3_next", "qwen3_moe"])
def test_engine_generates_and_reuses_prefixes(tiny_model_dir, case):
    from backend.api import GenerateRequest
    from backend.engine import Engine
    from backend.tokenizer import Tokenizer

    folder = tiny_model_dir(case)

    def engine() -> Engine:
        return Engine(load_model(folder, dtype="float32"), Tokenizer.from_folder(folder), case)

    def run(e: Engine, prompt: list[int]):
        return list(e.generate(GenerateRequest(prompt_ids=prompt, max_tokens=12)))[-1]

    prompt = [int(t) for t in random_tokens(30, seed=8)[0]]
    warm = engine()
    first = run(warm, prompt)
    assert first.cached_tokens == 0
    # Continuing: the live caches hold the prompt and every reply token but the last (never
    # fed back), whatever their kind.
    follow_up = prompt + first.token_ids + [5, 6]
    second = run(warm, follow_up)
    assert second.cached_tokens == len(prompt) + len(first.token_ids) - 1
    # Branching after 20 tokens: a KV cache rewinds; a Gemma 3 window (8) has wrapped past 20
    # and a recurrent layer cannot rewind at all, so the engine falls back to a full prefill.
    branch = prompt[:20] + [5, 6, 7]
    third = run(warm, branch)
    assert third.cached_tokens == (20 if case == "qwen3_moe" else 0)
    for request, done in ((prompt, first), (follow_up, second), (branch, third)):
        assert done.token_ids == run(engine(), request).token_ids
