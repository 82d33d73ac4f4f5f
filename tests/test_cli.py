"""The ``arbor`` CLI contract: JSON output, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from desktop.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("arbor: error:"), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0]


def test_generate_json_reports_every_field(capsys, tiny_model_dir):
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir("llama")),
                           "--prompt-ids", "5,6,7,8", "--max-tokens", "5", "--json")
    assert code == 0
    result = json.loads(out)
    assert set(result) == {"text", "token_ids", "prompt_tokens", "cached_tokens", "ttft_s",
                           "prefill_tps", "decode_tps", "generated_tokens", "finish_reason",
                           "drafter", "drafted_tokens", "accepted_tokens",
                           "acceptance_by_position"}
    assert result["prompt_tokens"] == 4 and 1 <= result["generated_tokens"] <= 5
    assert result["finish_reason"] in ("stop", "length")


def test_generate_prints_the_reply_then_what_drafting_did(capsys, tiny_model_dir):
    base = ("generate", "--model", str(tiny_model_dir("llama")), "--prompt-ids",
            "5,6,7,8,5,6,7,8,5,6", "--max-tokens", "12")
    code, out, err = run_cli(capsys, *base, "--draft-lookup")
    assert code == 0 and out.strip()
    *_, stats = err.strip().splitlines()  # after any warnings the libraries print
    drafted, accepted = (int(x) for x in re.fullmatch(
        r"\[\d+ tokens, [\d.]+ tok/s; lookup drafted (\d+), accepted (\d+)\]", stats).groups())
    assert 0 <= accepted <= drafted
    code, out, err = run_cli(capsys, *base, "--no-draft")
    assert code == 0 and err.strip().endswith("; no drafting]")


def test_generate_messages_file(capsys, tiny_model_dir, tmp_path):
    msgs = tmp_path / "m.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir("llama")),
                           "--messages", str(msgs), "--max-tokens", "3", "--json")
    assert code == 0 and json.loads(out)["prompt_tokens"] > 3


@pytest.fixture
def broken_copy(tiny_model_dir, tmp_path):
    def make(name: str):
        dest = tmp_path / name
        shutil.copytree(tiny_model_dir("llama"), dest)
        return dest
    return make


def test_truncated_safetensors(capsys, broken_copy):
    folder = broken_copy("truncated")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt", "hi")
    assert_one_line_error(code, err, "truncated", "model.safetensors")


def test_corrupt_safetensors_header(capsys, broken_copy):
    folder = broken_copy("corrupt")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt", "hi")
    assert_one_line_error(code, err, "safetensors")


def test_missing_config_key(capsys, broken_copy):
    folder = broken_copy("nokey")
    config = json.loads((folder / "config.json").read_text())
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt", "hi")
    assert_one_line_error(code, err, "hidden_size")


def test_unknown_architecture(capsys, broken_copy):
    folder = broken_copy("unknown")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "transmogrifier"
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt", "hi")
    assert_one_line_error(code, err, "transmogrifier", "llama")


def test_non_gguf_file(capsys, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"this is not a gguf file at all" * 10)
    code, _, err = run_cli(capsys, "generate", "--model", str(fake), "--prompt", "hi")
    assert_one_line_error(code, err, "model.gguf")


def test_prompt_over_context_length(capsys, tiny_model_dir):
    ids = ",".join(["5"] * 600)  # the tiny model's context is 512
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir("llama")),
                           "--prompt-ids", ids)
    assert_one_line_error(code, err, "600", "512")


@pytest.mark.parametrize("suite", [[], ["spec"], ["cache"]])
def test_bench_without_mlx_lm_says_how_to_get_it(capsys, monkeypatch, tiny_model_dir, suite):
    folder = tiny_model_dir("llama")
    capsys.readouterr()  # (writing the tiny model the first time prints progress)
    monkeypatch.setitem(sys.modules, "mlx_lm", None)  # as if it were not installed
    code, out, err = run_cli(capsys, "bench", *suite, "--model", str(folder))
    assert_one_line_error(code, err, "mlx-lm is not installed", "arbor-chat[bench]", "--against none")
    assert out == ""


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--prompt-ids", "1", "--temperature", "warm"])
    assert info.value.code == 2
    assert_one_line_error(2, capsys.readouterr().err, "--temperature")
    code, _, err = run_cli(capsys, "generate", "--model", "/nonexistent/model", "--prompt", "x")
    assert_one_line_error(code, err, "/nonexistent/model")


def test_errors_have_no_traceback_in_a_real_process(tmp_path):
    """The same contract seen from outside: a subprocess prints one line and exits 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "desktop.cli", "generate", "--model", str(tmp_path),
         "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("arbor: error:")


def test_terminal_chat_keeps_history(tiny_model_dir):
    """`arbor chat` over pipes: two turns, the second reuses the first's prefix."""
    proc = subprocess.run(
        [sys.executable, "-m", "desktop.cli", "chat", "--model", str(tiny_model_dir("llama")),
         "--max-tokens", "4", "--temperature", "0"],
        input="hello\nand again\n/quit\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    stats = [tuple(map(int, m.groups())) for m in
             re.finditer(r"(\d+)/(\d+) prompt tokens cached", proc.stdout)]
    assert len(stats) == 2, proc.stdout
    (first_cached, first_prompt), (second_cached, second_prompt) = stats
    assert first_cached == 0
    # the second prompt starts with the whole first one, which the live caches still hold
    assert first_prompt <= second_cached < second_prompt


def test_no_display_falls_back_to_terminal_chat(default_model_gguf):
    """Without --model the terminal chat opens the default model."""
    env = {"QT_QPA_PLATFORM": "offscreen", "PATH": "/usr/bin:/bin"}
    import os
    env.update({k: v for k, v in os.environ.items() if k.startswith(("ARBOR", "PYTHON", "HOME"))})
    env.pop("DISPLAY", None)
    proc = subprocess.run([sys.executable, "-m", "desktop.cli"], input="/quit\n",
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "terminal chat" in proc.stderr and "arbor chat" in proc.stdout


def test_models_import_list_rm(capsys, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ARBOR_HOME", str(tmp_path / "home"))
    code, out, _ = run_cli(capsys, "models", "import", str(tiny_model_dir("qwen3")), "--name",
                           "tiny-q", "--quantize", "8")
    assert code == 0 and "tiny-q" in out
    code, out, _ = run_cli(capsys, "models", "list")
    assert code == 0 and "tiny-q" in out and "qwen3" in out and "8-bit" in out
    code, out, _ = run_cli(capsys, "generate", "--model", "tiny-q", "--prompt-ids", "5,6",
                           "--max-tokens", "2", "--json")
    assert code == 0 and json.loads(out)["prompt_tokens"] == 2
    code, out, _ = run_cli(capsys, "models", "rm", "tiny-q")
    assert code == 0
    code, out, _ = run_cli(capsys, "models", "list")
    assert "tiny-q" not in out
    code, _, err = run_cli(capsys, "models", "rm", "tiny-q")
    assert_one_line_error(code, err, "tiny-q")
