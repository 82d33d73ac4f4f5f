"""The hybrid benchmark runs both engines on one random checkpoint of each family and they
agree."""

import pytest

from backend.bench.hybrid import FAMILIES, format_table, run_hybrid_bench


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hybrid_bench_rows_and_greedy_agreement(family, tmp_path):
    rows = run_hybrid_bench(prompt_lengths=(80,), decode_tokens=4, decode_prompt=70,
                            hidden_size=256, num_layers=4, folder=tmp_path / "ckpt",
                            family=family)
    assert [(r.phase, r.tokens) for r in rows] == [("prefill", 80), ("decode", 4)]
    assert all(r.arbor_tps > 0 and r.mlx_lm_tps > 0 for r in rows)
    # Same weights, greedy decoding: the two engines must pick the same tokens.
    assert rows[-1].same_tokens is True
    table = format_table(rows)
    assert "prefill" in table and "same greedy tokens" in table


def test_hybrid_families_are_read_and_unknown_ones_refused():
    from backend.errors import InvalidRequestError
    from desktop.cli import _hybrid_families

    assert _hybrid_families("all", FAMILIES) == list(FAMILIES)
    assert _hybrid_families("qwen3_5,qwen3_5_moe", FAMILIES) == ["qwen3_5", "qwen3_5_moe"]
    with pytest.raises(InvalidRequestError, match="unknown hybrid families.*qwen4"):
        _hybrid_families("qwen3_5,qwen4", FAMILIES)
