"""Hybrid-model benchmark: Arbor's chunked gated-delta prefill and decode vs mlx-lm.

Both run the *same* random checkpoint of one hybrid family (written once in the Hugging Face
layout, loaded by each library's own loader) in the same process, so the ratios compare code,
not weights or machines. Families (``FAMILIES``): Qwen3-Next (fused projections, all MLPs
sparse), Qwen3.5 (four projections, dense MLPs) and Qwen3.5-MoE (every MLP sparse), with their
published head sizes; and Gemma 4 (sliding / global attention, KV-shared layers; its MoE
layout), whose checkpoints ``bench/gemma4.py`` writes. Checkpoint width and depth are
parameters. Prefill is timed to the
evaluated final hidden state and cache state (no vocabulary projection, in ``PREFILL_CHUNK``-
token chunks as each library's generate loop does); decode is greedy single-token steps after a
prompt, each step evaluated.

    python -m backend.bench.hybrid [--family qwen3_5]   # prints the table
    run_hybrid_bench(...) -> list[BenchRow]             # what ``arbor bench --hybrid`` calls

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

from backend.bench import gemma4 as bench_gemma4

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


#: Checkpoint width and depth when not given.
DEFAULT_HIDDEN, DEFAULT_LAYERS = 1024, 4

#: Families this benchmark writes checkpoints of, and what each looks like.
FAMILIES = {
    "qwen3_next": "Qwen3-Next-shaped: 3/4 layers gated delta, 32 experts top-4 + shared",
    "qwen3_5": "Qwen3.5-shaped: 3/4 layers gated delta, dense MLPs",
    "qwen3_5_moe": "Qwen3.5-MoE-shaped: 3/4 layers gated delta, 32 experts top-4 + shared",
    **bench_gemma4.FAMILIES,
}


def default_layers(family: str) -> int:
    """Checkpoint depth when not given."""
    return bench_gemma4.DEFAULT_LAYERS if family in bench_gemma4.FAMILIES else DEFAULT_LAYERS


def model_config(hidden_size: int = DEFAULT_HIDDEN, num_layers: int = DEFAULT_LAYERS,
                 vocab_size: int = 8192,
                 family: str = "qwen3_next") -> dict:
    """A small config of ``family`` (``FAMILIES``): 3 of every 4 layers gated-delta, head counts
    scaled with ``hidden_size``; gated-delta heads of 128 and Qwen3.5's attention heads of 256
    as in the published models (Qwen3-Next's attention heads: 128). Qwen3.5 configs nest the
    text settings in ``text_config``, as the published multimodal checkpoints do."""
    if family not in FAMILIES:
        raise ValueError(f"unknown hybrid family {family!r} (choose from {', '.join(FAMILIES)})")
    if family in bench_gemma4.FAMILIES:
        return bench_gemma4.model_config(hidden_size, num_layers, vocab_size, family)
    heads = max(1, hidden_size // 128)
    text = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-6,
        "linear_num_key_heads": heads,
        "linear_num_value_heads": 2 * heads,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                        for i in range(num_layers)],
        "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    experts = {"num_experts": 32, "num_experts_per_tok": 4, "decoder_sparse_step": 1,
               "moe_intermediate_size": hidden_size // 2,
               "shared_expert_intermediate_size": hidden_size // 2, "mlp_only_layers": [],
               "norm_topk_prob": True}
    if family == "qwen3_next":
        return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **text,
                **experts, "head_dim": 128, "intermediate_size": 2 * hidden_size,
                "partial_rotary_factor": 0.25, "rope_theta": 10000000.0}
    text.update(head_dim=256, rope_parameters={
        "rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    if family == "qwen3_5_moe":
        text.update(experts, model_type="qwen3_5_moe_text")
        architecture = "Qwen3_5MoeForConditionalGeneration"
    else:
        text.update(model_type="qwen3_5_text", intermediate_size=7 * hidden_size // 2)
        architecture = "Qwen3_5ForConditionalGeneration"
    return {"architectures": [architecture], "model_type": family, "text_config": text,
            "tie_word_embeddings": False}


def write_random_checkpoint(folder: Path, config: dict, seed: int = 0) -> Path:
    """Random float32 weights in the family's Hugging Face layout: Qwen3-Next's fused
    projections and per-expert tensors; Qwen3.5's four projections, ``model.language_model.*``
    names and experts fused per layer (``experts.gate_up_proj``)."""
    if config["model_type"] == "gemma4":
        return bench_gemma4.write_random_checkpoint(folder, config, seed)
    rng = np.random.default_rng(seed)
    qwen3_5 = "text_config" in config
    c = config["text_config"] if qwen3_5 else config
    d = c["hidden_size"]
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    conv_dim = 2 * hk * dk + hv * dv
    decoder = "model.language_model" if qwen3_5 else "model"

    def mat(out: int, inp: int) -> np.ndarray:
        return rng.normal(0.0, inp ** -0.5, (out, inp)).astype(np.float32)

    def small(n: int) -> np.ndarray:
        return rng.normal(0.0, 0.05, (n,)).astype(np.float32)

    w: dict[str, np.ndarray] = {
        f"{decoder}.embed_tokens.weight": rng.normal(0, 1, (c["vocab_size"], d)).astype(
            np.float32),
        f"{decoder}.norm.weight": small(d),
        "lm_head.weight": mat(c["vocab_size"], d),
    }
    for i, kind in enumerate(c["layer_types"]):
        p = f"{decoder}.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = small(d)
        w[f"{p}.post_attention_layernorm.weight"] = small(d)
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            if qwen3_5:
                w[f"{a}.in_proj_qkv.weight"] = mat(conv_dim, d)
                w[f"{a}.in_proj_z.weight"] = mat(hv * dv, d)
                w[f"{a}.in_proj_b.weight"] = mat(hv, d)
                w[f"{a}.in_proj_a.weight"] = mat(hv, d)
            else:
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
        w.update(_mlp(f"{p}.mlp", c, mat, fused_experts=qwen3_5))
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in w.items()},
                        metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def _mlp(m: str, c: dict, mat: Callable[[int, int], np.ndarray],
         fused_experts: bool) -> dict[str, np.ndarray]:
    """One layer's MLP tensors: dense without ``num_experts``, else routed experts (one tensor
    per expert, or fused per layer) and the gated shared expert."""
    d = c["hidden_size"]
    if not c.get("num_experts"):
        inter = c["intermediate_size"]
        return {f"{m}.gate_proj.weight": mat(inter, d), f"{m}.up_proj.weight": mat(inter, d),
                f"{m}.down_proj.weight": mat(d, inter)}
    inter, experts = c["moe_intermediate_size"], c["num_experts"]
    w = {f"{m}.gate.weight": mat(experts, d)}
    if fused_experts:
        w[f"{m}.experts.gate_up_proj"] = np.stack([mat(2 * inter, d) for _ in range(experts)])
        w[f"{m}.experts.down_proj"] = np.stack([mat(d, inter) for _ in range(experts)])
    else:
        for e in range(experts):
            w[f"{m}.experts.{e}.gate_proj.weight"] = mat(inter, d)
            w[f"{m}.experts.{e}.up_proj.weight"] = mat(inter, d)
            w[f"{m}.experts.{e}.down_proj.weight"] = mat(d, inter)
    shared = c["shared_expert_intermediate_size"]
    w[f"{m}.shared_expert.gate_proj.weight"] = mat(shared, d)
    w[f"{m}.shared_expert.up_proj.weight"] = mat(shared, d)
    w[f"{m}.shared_expert.down_proj.weight"] = mat(d, shared)
    w[f"{m}.shared_expert_gate.weight"] = mat(1, d)
    return w


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
    text = getattr(model, "language_model", model)  # Qwen3.5 and Gemma 4 nest their text model
    return _Runner(lambda t, c: text.model(t, c), _mlx_lm_head(text),
                   lambda: make_prompt_cache(model), lambda caches: [c.state for c in caches])


def _mlx_lm_head(text) -> Callable:
    """An mlx-lm text model's vocabulary projection: its ``lm_head`` or the tied embedding,
    soft-capped where the model caps its logits (Gemma 4)."""
    head = text.lm_head if "lm_head" in text else text.model.embed_tokens.as_linear
    cap = getattr(text, "final_logit_softcapping", None)
    return head if cap is None else (lambda h: mx.tanh(head(h) / cap) * cap)


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
                     decode_prompt: int = 512, hidden_size: int = DEFAULT_HIDDEN,
                     num_layers: int | None = None, repeats: int = 1, folder: str | Path | None = None,
                     log: Callable[[str], None] | None = None,
                     family: str = "qwen3_next") -> list[BenchRow]:
    """Prefill tok/s at each prompt length and greedy decode tok/s, Arbor vs mlx-lm, on a
    random checkpoint of ``family`` (``FAMILIES``).

    ``folder``: where to write the random checkpoint (a temporary folder by default);
    ``num_layers``: the family's ``default_layers`` when None.
    """
    config = model_config(hidden_size, num_layers or default_layers(family), family=family)
    vocab = (config.get("text_config") or config)["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(folder or tmp), config)
        return compare_on_checkpoint(path, vocab, prompt_lengths, decode_tokens, decode_prompt,
                                     repeats, log)


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


def describe(family: str, hidden_size: int = DEFAULT_HIDDEN,
             num_layers: int | None = None) -> str:
    """The table's title line for one family's run."""
    num_layers = num_layers or default_layers(family)
    return (f"{FAMILIES[family]}; random, hidden {hidden_size}, {num_layers} layers; "
            f"float32, {mx.default_device()}")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), action="append",
                        help="repeatable (default: qwen3_next)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN)
    parser.add_argument("--layers", type=int, help="default: the family's "
                        f"({DEFAULT_LAYERS}; Gemma 4: {bench_gemma4.DEFAULT_LAYERS})")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    for family in args.family or ["qwen3_next"]:
        rows = run_hybrid_bench(tuple(args.lengths), args.decode, hidden_size=args.hidden,
                                num_layers=args.layers, repeats=args.repeats,
                                log=lambda m: print(m, flush=True), family=family)
        print(describe(family, args.hidden, args.layers))
        print(format_table(rows))


if __name__ == "__main__":
    main()
