"""``arbor bench cache`` end to end on a tiny model: both servers start, the trace runs, the
restart replays, and the report has its figures (timings themselves are never asserted)."""

from __future__ import annotations

from backend.bench import cache as bench_cache
from backend.tokenizer import Tokenizer


def test_trace_shares_two_system_prompts_round_robin(tiny_model_dir):
    tokenizer = Tokenizer.from_folder(tiny_model_dir("llama"))
    trace = bench_cache.make_trace(tokenizer, conversations=4, turns=3, system_tokens=80)
    assert trace.assignment == [0, 1, 0, 1] and len(trace.users[0]) == 3
    for system in trace.systems:
        assert 80 <= len(tokenizer.encode(system)) <= 100
    messages = [{"role": "system", "content": trace.systems[0]},
                {"role": "user", "content": trace.users[0][0]},
                {"role": "assistant", "content": "fine"},
                {"role": "user", "content": trace.users[0][1]}]
    prior = bench_cache.prior_context_tokens(tokenizer, messages)
    whole = tokenizer.apply_chat_template(messages)
    assert whole[:prior] == tokenizer.apply_chat_template(messages[:3],
                                                          add_generation_prompt=False)[:prior]
    assert 0 < prior < len(whole)


def test_bench_cache_runs_both_servers_and_a_restart(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama")
    summaries, table = bench_cache.run(
        folder, tmp_path, conversations=3, turns=2, new_tokens=6, system_tokens=50,
        arbor_runs=[("tiny budgets", ["--cache-device-mb", "1", "--cache-host-mb", "1"])],
        mlx_cache_sizes=(10,), log=lambda m: None)
    arbor, mlx_lm = summaries
    assert arbor.name.startswith("arbor serve") and mlx_lm.name.startswith("mlx-lm")
    assert arbor.cached_share > 0.5 and arbor.peak_rss_bytes > 0
    assert arbor.restart_tier_share.get("disk", 0) > 0  # the restart was served from disk
    assert 0 <= mlx_lm.cached_share <= 1
    assert "after restart" in table and arbor.name in table and mlx_lm.name in table
    # Each turn's TTFT beside its prompt length: later turns carry the conversation so far.
    assert len(arbor.by_turn) == 2 and arbor.by_turn[1][1] > arbor.by_turn[0][1] > 0
    assert f"{arbor.name}: TTFT by turn (prompt tokens) t1 " in table
