"""``arbor bench spec`` end to end on a tiny model: every row runs, the speculative rows report
whether their tokens equal plain decoding's (they must), and the table names the pair ratio
against mlx-lm. Timings themselves are never asserted."""

from __future__ import annotations

import pytest

from backend.bench import spec as bench_spec


def test_bench_spec_rows_and_table(tiny_model_dir, tmp_path):
    rows = bench_spec.run(tiny_model_dir("llama"), tmp_path, new_tokens=12, repeats=1,
                          log=lambda m: None)
    kinds = {(r.engine, r.drafter.split(" (")[0], r.prompts) for r in rows}
    for prompts in ("copy-heavy", "open"):
        assert {("arbor", "plain", prompts), ("arbor", "prompt lookup", prompts),
                ("arbor", "draft model", prompts), ("mlx-lm", "plain", prompts),
                ("mlx-lm", "draft model", prompts)} <= kinds
    clients = f"{bench_spec.CLIENTS} clients"
    assert {("arbor", "plain", clients), ("arbor", "prompt lookup", clients)} <= kinds
    speculative = [r for r in rows if r.engine == "arbor" and r.drafter != "plain"]
    assert all(r.same_tokens is True for r in speculative)
    assert all(r.decode_tps > 0 for r in rows)
    table = bench_spec.format_table(rows, 12)
    assert "arbor / mlx-lm speculative" in table and " NO " not in table


def test_arbor_bench_spec_on_the_command_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from desktop.cli import main

    monkeypatch.setenv("ARBOR_HOME", str(tmp_path / "home"))
    # Small random checkpoints for the assistant and checkpoint-drafter parts: their code
    # paths, not their published shapes (those are for the measurements).
    assert main(["bench", "spec", "--model", str(tiny_model_dir("llama")),
                 "--against", "none", "--new-tokens", "8", "--assistant-size", "256x2",
                 "--drafter-size", "128x4"]) == 0
    table = capsys.readouterr().out
    assert "prompt lookup" in table and "draft model" in table and "mlx-lm" not in table
    assert "Gemma 4 assistant" in table and "same tokens as plain: yes" in table
    assert "dflash" in table and "mtp" in table
    assert table.startswith("native CPU kernels: ")  # the figures say which path they timed


def test_bench_says_when_the_native_kernels_are_off(monkeypatch):
    from backend import kernels
    from desktop.cli import _kernel_state

    monkeypatch.setattr(kernels, "ensure_built", lambda quiet=True: False)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda: "no compiler")
    assert _kernel_state() == "native CPU kernels: OFF (no compiler)"


@pytest.mark.parametrize("flag", ["--assistant-size", "--drafter-size"])
def test_a_malformed_size_is_one_clear_line(flag, tiny_model_dir, tmp_path, monkeypatch, capsys):
    from desktop.cli import main

    monkeypatch.setenv("ARBOR_HOME", str(tmp_path / "home"))
    assert main(["bench", "spec", "--model", str(tiny_model_dir("llama")), "--against", "none",
                 flag, "wide"]) != 0
    assert f"{flag} 'wide' is not HIDDENxLAYERS" in capsys.readouterr().err
