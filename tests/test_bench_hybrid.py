"""The hybrid benchmark runs both engines on one random checkpoint and they agree."""

from backend.bench_hybrid import format_table, run_hybrid_bench


def test_hybrid_bench_rows_and_greedy_agreement(tmp_path):
    rows = run_hybrid_bench(prompt_lengths=(80,), decode_tokens=4, decode_prompt=70,
                            hidden_size=256, num_layers=4, folder=tmp_path / "ckpt")
    assert [(r.phase, r.tokens) for r in rows] == [("prefill", 80), ("decode", 4)]
    assert all(r.arbor_tps > 0 and r.mlx_lm_tps > 0 for r in rows)
    # Same weights, greedy decoding: the two engines must pick the same tokens.
    assert rows[-1].same_tokens is True
    table = format_table(rows)
    assert "prefill" in table and "same greedy tokens" in table
