"""Hybrid-model benchmark: Arbor's chunked gated-delta prefill and decode vs mlx-lm.

Both run the *same* random Qwen3-Next-shaped checkpoint (written once in the Hugging Face
layout, loaded by each library's own loader) in the same process, so the ratios compare code,
not weights or machines. Prefill is timed to the evaluated final hidden state and cache state
(no vocabulary projection, in ``PREFILL_CHUNK``-token chunks as each library's generate loop
does); decode is greedy single-token steps after a prompt, each step evaluated.

    python -m backend.bench_hybrid            # prints the table
    run_hybrid_bench(...) -> list[BenchRow]   # what ``arbor bench`` calls

Scope: throughput figures only. Timed assertions do not belong in tests (shared, noisy
machines); the tests pin correctness.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import backend  # noqa: F401  (loads the system BLAS before mlx.core)
import mlx.core as mx
import numpy as np

#: Prefill chunk used for both libraries (Arbor's engine and mlx-lm's generate both use 2048).
PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class BenchRow:
    phase: str  # "prefill" | "decode"
    tokens: int  # prompt tokens (prefill) or generated tokens (decode)
    arbor_tps: float
    mlx_lm_tps: float | None  # None when mlx-lm is not installed
    same_tokens: bool | None = None  # decode: both engines produced the same greedy tokens

    @property
    def ratio(self) -> float | None:
        return None if not self.mlx_lm_tps else self.arbor_tps / self.mlx_lm_tps


def model_config(hidden_size: int = 1024, num_layers: int = 4, vocab_size: int = 8192) -> dict:
    """A small Qwen3-Next-shaped config: 3 of every 4 layers gated-delta, all MLPs sparse."""
    heads = hidden_size // 128
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 128,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-6,
        "linear_num_key_heads": max(1, heads),
        "linear_num_value_heads": 2 * max(1, heads),
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": hidden_size // 2,
        "shared_expert_intermediate_size": hidden_size // 2,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "full_attention_interval": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                        for i in range(num_layers)],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000.0,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def write_random_checkpoint(folder: Path, config: dict, seed: int = 0) -> Path:
    """Random float32 weights in the Hugging Face Qwen3-Next layout (per-expert tensors)."""
    rng = np.random.default_rng(seed)
    c = config
    d = c["hidden_size"]
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    conv_dim = 2 * hk * dk + hv * dv

    def mat(out: int, inp: int) -> np.ndarray:
        return rng.normal(0.0, inp ** -0.5, (out, inp)).astype(np.float32)

    def small(n: int) -> np.ndarray:
        return rng.normal(0.0, 0.05, (n,)).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.normal(0, 1, (c["vocab_size"], d)).astype(np.float32),
        "model.norm.weight": small(d),
        "lm_head.weight": mat(c["vocab_size"], d),
    }
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = small(d)
        w[f"{p}.post_attention_layernorm.weight"] = small(d)
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            w[f"{a}.in_proj_qkvz.weight"] = mat(2 * hk * dk + 2 * hv * dv, d)
            w[f"{a}.in_proj_ba.weight"] = mat(2 * hv, d)
            w[f"{a}.conv1d.weight"] = rng.normal(0, 0.5, (conv_dim, 1, 4)).astype(np.float32)
            w[f"{a}.dt_bias"] = np.ones(hv, np.float32)
            w[f"{a}.A_log"] = np.log(rng.uniform(1, 16, hv)).astype(np.float32)
            w[f"{a}.norm.weight"] = np.ones(dv, np.float32)
            w[f"{a}.out_proj.weight"] = mat(d, hv * dv)
        else:
            a, hd = f"{p}.self_attn", c["head_dim"]
            w[f"{a}.q_proj.weight"] = mat(2 * c["num_attention_heads"] * hd, d)
            w[f"{a}.k_proj.weight"] = mat(c["num_key_value_heads"] * hd, d)
            w[f"{a}.v_proj.weight"] = mat(c["num_key_value_heads"] * hd, d)
            w[f"{a}.o_proj.weight"] = mat(d, c["num_attention_heads"] * hd)
            w[f"{a}.q_norm.weight"] = small(hd)
            w[f"{a}.k_norm.weight"] = small(hd)
        m, inter = f"{p}.mlp", c["moe_intermediate_size"]
        w[f"{m}.gate.weight"] = mat(c["num_experts"], d)
        for e in range(c["num_experts"]):
            w[f"{m}.experts.{e}.gate_proj.weight"] = mat(inter, d)
            w[f"{m}.experts.{e}.up_proj.weight"] = mat(inter, d)
            w[f"{m}.experts.{e}.down_proj.weight"] = mat(d, inter)
        shared = c["shared_expert_intermediate_size"]
        w[f"{m}.shared_expert.gate_proj.weight"] = mat(shared, d)
        w[f"{m}.shared_expert.up_proj.weight"] = mat(shared, d)
        w[f"{m}.shared_expert.down_proj.weight"] = mat(d, shared)
        w[f"{m}.shared_expert_gate.weight"] = mat(1, d)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in w.items()},
                        metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


# -- the two contenders ----------------------------------------------------------------------

class _Runner:
    """Uniform prefill/decode over one library's model and caches."""

    def __init__(self, hidden: Callable, logits: Callable, make_caches: Callable,
                 cache_arrays: Callable):
        self.hidden, self.logits = hidden, logits
        self.make_caches, self.cache_arrays = make_caches, cache_arrays

    def prefill(self, tokens: mx.array, caches) -> mx.array:
        h = None
        for start in range(0, tokens.shape[1], PREFILL_CHUNK):
            h = self.hidden(tokens[:, start:start + PREFILL_CHUNK], caches)
            mx.eval(h, self.cache_arrays(caches))
        return h

    def decode(self, first: mx.array, caches, steps: int) -> list[int]:
        token, out = first, []
        for _ in range(steps):
            h = self.hidden(token.reshape(1, 1), caches)
            token = mx.argmax(self.logits(h[:, -1]), axis=-1)
            mx.eval(token)
            out.append(int(token.item()))
        return out


def _arbor_runner(folder: Path) -> _Runner:
    from backend.weights.loading import load_model

    model = load_model(folder, dtype="float32").model
    return _Runner(model.hidden, model.logits, model.make_caches,
                   lambda caches: [c.arrays() for c in caches])


def _mlx_lm_runner(folder: Path) -> _Runner | None:
    try:
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load_model as mlx_lm_load
    except ImportError:
        return None
    model, _ = mlx_lm_load(folder)
    return _Runner(lambda t, c: model.model(t, c), model.lm_head,
                   lambda: make_prompt_cache(model), lambda caches: [c.state for c in caches])


def _prefill_tps(runner: _Runner, tokens: mx.array, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        caches = runner.make_caches()
        gc.collect()
        t0 = time.perf_counter()
        runner.prefill(tokens, caches)
        best = min(best, time.perf_counter() - t0)
        del caches
    return tokens.shape[1] / best


def _decode_tps(runner: _Runner, prompt: mx.array, steps: int) -> tuple[float, list[int]]:
    caches = runner.make_caches()
    runner.prefill(prompt[:, :-1], caches)
    runner.decode(prompt[:, -1], caches, 2)  # warm the single-token graphs
    caches = runner.make_caches()
    runner.prefill(prompt[:, :-1], caches)
    t0 = time.perf_counter()
    tokens = runner.decode(prompt[:, -1], caches, steps)
    return steps / (time.perf_counter() - t0), tokens


def run_hybrid_bench(prompt_lengths: tuple[int, ...] = (1024, 4096), decode_tokens: int = 32,
                     decode_prompt: int = 512, hidden_size: int = 1024, num_layers: int = 4,
                     repeats: int = 1, folder: str | Path | None = None,
                     log: Callable[[str], None] | None = None) -> list[BenchRow]:
    """Prefill tok/s at each prompt length and greedy decode tok/s, Arbor vs mlx-lm.

    ``folder``: where to write the random checkpoint (a temporary folder by default).
    """
    config = model_config(hidden_size, num_layers)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(folder or tmp), config)
        return compare_on_checkpoint(path, config["vocab_size"], prompt_lengths, decode_tokens,
                                     decode_prompt, repeats, log)


def compare_on_checkpoint(path: Path, vocab_size: int, prompt_lengths: tuple[int, ...],
                          decode_tokens: int, decode_prompt: int, repeats: int = 1,
                          log: Callable[[str], None] | None = None) -> list[BenchRow]:
    """Prefill tok/s at each prompt length and greedy decode tok/s of Arbor and mlx-lm, each
    loading the checkpoint at ``path`` with its own loader (the family benchmarks share it)."""
    log = log or (lambda _msg: None)
    runners = {"arbor": _arbor_runner(path), "mlx-lm": _mlx_lm_runner(path)}
    rng = np.random.default_rng(1)
    rows: list[BenchRow] = []
    warm = mx.array(rng.integers(0, vocab_size, (1, 256)))
    for runner in runners.values():
        if runner is not None:
            runner.prefill(warm, runner.make_caches())  # compile / warm kernels
    for n in prompt_lengths:
        tokens = mx.array(rng.integers(0, vocab_size, (1, n)))
        figures = {}
        for name, runner in runners.items():
            log(f"prefill {n} tokens: {name}")
            figures[name] = None if runner is None else _prefill_tps(runner, tokens, repeats)
        rows.append(BenchRow("prefill", n, figures["arbor"], figures["mlx-lm"]))
    prompt = mx.array(rng.integers(0, vocab_size, (1, decode_prompt)))
    figures, outputs = {}, {}
    for name, runner in runners.items():
        log(f"decode {decode_tokens} tokens: {name}")
        if runner is not None:
            figures[name], outputs[name] = _decode_tps(runner, prompt, decode_tokens)
    same = outputs["arbor"] == outputs["mlx-lm"] if "mlx-lm" in outputs else None
    rows.append(BenchRow("decode", decode_tokens, figures["arbor"], figures.get("mlx-lm"), same))
    return rows


def format_table(rows: list[BenchRow]) -> str:
    lines = [f"{'phase':<8} {'tokens':>6} {'arbor tok/s':>12} {'mlx-lm tok/s':>13} {'ratio':>7}"]
    for r in rows:
        theirs = "-" if r.mlx_lm_tps is None else f"{r.mlx_lm_tps:13.1f}"
        ratio = "-" if r.ratio is None else f"{r.ratio:6.2f}x"
        line = f"{r.phase:<8} {r.tokens:>6} {r.arbor_tps:12.1f} {theirs:>13} {ratio:>7}"
        if r.same_tokens is not None:
            line += "  same greedy tokens" if r.same_tokens else "  greedy tokens differ"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    rows = run_hybrid_bench(tuple(args.lengths), args.decode, hidden_size=args.hidden,
                            num_layers=args.layers, repeats=args.repeats,
                            log=lambda m: print(m, flush=True))
    print(f"Qwen3-Next-shaped random model: hidden {args.hidden}, {args.layers} layers "
          f"(3/4 gated delta), 32 experts top-4 + shared; float32, {mx.default_device()}")
    print(format_table(rows))


if __name__ == "__main__":
    main()
