"""``arbor bench batch`` end to end on a tiny model: arbor serve and mlx-lm's server both serve
concurrent streaming clients, the stall test runs, the step costs are measured, and the report
has its rows (timings themselves are never asserted)."""

from __future__ import annotations

from backend.bench import batch as bench_batch


def test_bench_batch_runs_both_servers(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama")
    rows, stalls, costs = bench_batch.run({"float32": folder}, tmp_path, clients=(1, 2),
                                          new_tokens=6, prompt_words=8, long_words=120,
                                          max_batch=4, log=lambda m: None)
    names = {r.server for r in rows}
    assert any(n.startswith("arbor serve") for n in names)
    assert any(n.startswith("mlx-lm") for n in names)
    assert [r.clients for r in rows] == [1, 2, 1, 2]
    arbor = [r for r in rows if r.server.startswith("arbor")]
    assert all(r.aggregate_tps > 0 and r.ttft_p50 > 0 for r in arbor)
    assert len(stalls) == 2 and all(0 < s.median <= s.p95 <= s.longest for s in stalls)
    assert [n for n, _ in costs] == list(range(1, 17)) and all(ms > 0 for _, ms in costs)
    table = bench_batch.format_table(rows, stalls, costs)
    assert "aggregate" in table and "long prompt" in table and "16: " in table
    assert "longest" in table


def test_a_server_too_slow_alone_keeps_only_its_first_row(tiny_model_dir, tmp_path):
    """A server under ``slowest_tps`` with one client is not run with more (mlx-lm's 4-bit
    path on a CPU would take hours): one row, no stall test, and the table still prints."""
    folder = tiny_model_dir("llama")
    lines = []
    rows, stalls, costs = bench_batch.run({"float32": folder}, tmp_path, clients=(1, 2),
                                          new_tokens=4, prompt_words=8, long_words=60,
                                          max_batch=4, against_mlx_lm=False,
                                          log=lines.append, slowest_tps=1e12,
                                          arbor_args=["--exact-prefill"])
    assert [r.clients for r in rows] == [1] and stalls == []
    assert "--exact-prefill" in rows[0].server  # the flag reached the server (it started)
    assert any("left out" in line for line in lines)
    assert "aggregate" in bench_batch.format_table(rows, stalls, costs)
