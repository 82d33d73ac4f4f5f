"""GLM-4.7-Flash benchmark: Arbor's latent attention and group-limited MoE vs mlx-lm.

Both run the *same* random checkpoint with GLM-4.7-Flash's attention shapes (20 heads per
2048 of width, query rank 768, latent 512, rotary 64, no-position 192, value 256) and its
routing (top-4 of the routed experts plus one shared, expert width 3/4 of the hidden size,
the first layer dense), written once in the Hugging Face layout and loaded by each library's
own loader; width, depth and expert count are parameters (the real model: 2048, 47, 64). The
timing, the greedy-token check and the table are ``bench_hybrid``'s
(``compare_on_checkpoint``).

    python -m backend.bench.glm [--hidden 1024 --layers 4 --experts 16]
    run_glm_bench(...) -> list[BenchRow]          # what ``arbor bench --glm`` calls

Scope: throughput figures only; the tests pin correctness.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable

import backend  # noqa: F401  (loads the system BLAS before mlx.core)
import mlx.core as mx
import numpy as np

from backend.bench.hybrid import BenchRow, compare_on_checkpoint, format_table

#: Checkpoint width, depth and routed experts when not given.
DEFAULT_HIDDEN, DEFAULT_LAYERS, DEFAULT_EXPERTS = 1024, 4, 16


def model_config(hidden_size: int = DEFAULT_HIDDEN, num_layers: int = DEFAULT_LAYERS,
                 experts: int = DEFAULT_EXPERTS, vocab_size: int = 8192) -> dict:
    """A GLM-4.7-Flash-shaped config (module docstring): head sizes as published, head count
    and expert width scaled with ``hidden_size``."""
    return {
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "model_type": "glm4_moe_lite",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 5 * hidden_size,
        "moe_intermediate_size": 3 * hidden_size // 4,
        "num_hidden_layers": num_layers,
        "num_attention_heads": max(1, 20 * hidden_size // 2048),
        "num_key_value_heads": max(1, 20 * hidden_size // 2048),
        "q_lora_rank": 768,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 192,
        "v_head_dim": 256,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.8,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 202752,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def write_random_checkpoint(folder: Path, config: dict, seed: int = 0) -> Path:
    """Random float32 weights in the Hugging Face layout (``kv_b_proj``, per-expert tensors)."""
    rng = np.random.default_rng(seed)
    c = config
    d, h = c["hidden_size"], c["num_attention_heads"]
    rank, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v, q_rank = c["qk_nope_head_dim"], c["v_head_dim"], c["q_lora_rank"]

    def mat(out: int, inp: int) -> np.ndarray:
        return rng.normal(0.0, inp ** -0.5, (out, inp)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return rng.uniform(0.8, 1.2, n).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.normal(0, 1, (c["vocab_size"], d)).astype(np.float32),
        "model.norm.weight": norm(d),
        "lm_head.weight": mat(c["vocab_size"], d),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm(d)
        w[f"{p}.post_attention_layernorm.weight"] = norm(d)
        a = f"{p}.self_attn"
        w[f"{a}.q_a_proj.weight"] = mat(q_rank, d)
        w[f"{a}.q_a_layernorm.weight"] = norm(q_rank)
        w[f"{a}.q_b_proj.weight"] = mat(h * (nope + rope), q_rank)
        w[f"{a}.kv_a_proj_with_mqa.weight"] = mat(rank + rope, d)
        w[f"{a}.kv_a_layernorm.weight"] = norm(rank)
        w[f"{a}.kv_b_proj.weight"] = mat(h * (nope + v), rank)
        w[f"{a}.o_proj.weight"] = mat(d, h * v)
        m = f"{p}.mlp"
        if i < c["first_k_dense_replace"]:
            w.update(_gated_mlp(m, d, c["intermediate_size"], mat))
            continue
        experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
        w[f"{m}.gate.weight"] = mat(experts, d)
        w[f"{m}.gate.e_score_correction_bias"] = rng.normal(0, 0.01, experts).astype(np.float32)
        for e in range(experts):
            w.update(_gated_mlp(f"{m}.experts.{e}", d, inter, mat))
        w.update(_gated_mlp(f"{m}.shared_experts", d, inter * c["n_shared_experts"], mat))
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in w.items()},
                        metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def _gated_mlp(prefix: str, d: int, inter: int,
               mat: Callable[[int, int], np.ndarray]) -> dict[str, np.ndarray]:
    return {f"{prefix}.gate_proj.weight": mat(inter, d), f"{prefix}.up_proj.weight": mat(inter, d),
            f"{prefix}.down_proj.weight": mat(d, inter)}


def run_glm_bench(prompt_lengths: tuple[int, ...] = (1024, 4096), decode_tokens: int = 32,
                  decode_prompt: int = 512, hidden_size: int = DEFAULT_HIDDEN,
                  num_layers: int = DEFAULT_LAYERS, experts: int = DEFAULT_EXPERTS,
                  repeats: int = 1, folder: str | Path | None = None,
                  log: Callable[[str], None] | None = None) -> list[BenchRow]:
    """Prefill tok/s at each prompt length and greedy decode tok/s, Arbor vs mlx-lm, on one
    random GLM-4.7-Flash-shaped checkpoint (``folder``: where to write it; temporary by
    default)."""
    config = model_config(hidden_size, num_layers, experts)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(folder or tmp), config)
        return compare_on_checkpoint(path, config["vocab_size"], prompt_lengths, decode_tokens,
                                     decode_prompt, repeats, log)


def describe(hidden_size: int = DEFAULT_HIDDEN, num_layers: int = DEFAULT_LAYERS,
             experts: int = DEFAULT_EXPERTS) -> str:
    """The table's title line."""
    heads = model_config(hidden_size, num_layers, experts)["num_attention_heads"]
    return (f"GLM-4.7-Flash-shaped random model: hidden {hidden_size}, {num_layers} layers, "
            f"{heads} latent-attention heads (latent 512 + rope 64), {experts} experts top-4 + "
            f"shared; float32, {mx.default_device()}")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--decode-prompt", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN)
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    parser.add_argument("--experts", type=int, default=DEFAULT_EXPERTS)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    rows = run_glm_bench(tuple(args.lengths), args.decode, args.decode_prompt,
                         hidden_size=args.hidden, num_layers=args.layers, experts=args.experts,
                         repeats=args.repeats, log=lambda m: print(m, flush=True))
    print(describe(args.hidden, args.layers, args.experts))
    print(format_table(rows))


if __name__ == "__main__":
    main()
