"""The GLM-4.7-Flash benchmark runs both engines on one random checkpoint with the published
head sizes, and they agree on the greedy tokens."""

import json

from backend.bench.glm import describe, model_config, run_glm_bench
from backend.bench.hybrid import format_table


def test_glm_bench_rows_and_greedy_agreement(tmp_path):
    rows = run_glm_bench(prompt_lengths=(80,), decode_tokens=4, decode_prompt=70,
                         hidden_size=256, num_layers=3, experts=4, folder=tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config == model_config(256, 3, 4)
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"],
            config["v_head_dim"], config["q_lora_rank"]) == (512, 64, 192, 256, 768)
    assert [(r.phase, r.tokens) for r in rows] == [("prefill", 80), ("decode", 4)]
    assert all(r.arbor_tps > 0 and r.mlx_lm_tps > 0 for r in rows)
    # Same weights, greedy decoding: the two engines must pick the same tokens.
    assert rows[-1].same_tokens is True
    assert "same greedy tokens" in format_table(rows)
    assert "hidden 256, 3 layers, 2 latent-attention heads" in describe(256, 3, 4)
