"""`arbor serve` from the command line: the loopback rule, one-line errors, the prefix-cache
flags (shared with `arbor chat`), and a real server process started, used and stopped."""

from __future__ import annotations

import io
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading

import openai
import pytest

import backend.memory.budgets as budgets_module
from backend.memory.budgets import MIB, CacheConfig
from backend.batch_default import default_max_batch
from backend.server.run import is_loopback
from desktop.cli import _cache_config, build_parser, cmd_chat, main
from tests.fixtures.server import WAIT_S, get_json
from tests.test_cli import assert_one_line_error
from tests.test_installed_dependencies import runtime_closure


def test_the_server_comes_with_a_plain_install():
    closure = runtime_closure("arbor-chat")
    assert {"fastapi", "uvicorn", "starlette", "pydantic", "httptools",
            "uvloop"} <= set(closure), sorted(closure)
    assert "openai" not in closure  # only the tests talk to it with the client


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7"])
def test_a_non_loopback_host_without_a_key_refuses_to_start(capsys, host):
    # the check comes before the model loads: the missing model is never reached
    code = main(["serve", "--host", host, "--model", "/nonexistent/model"])
    assert_one_line_error(code, capsys.readouterr().err, f"--host {host}", "--api-key")


def test_loopback_means_every_address_is_loopback():
    assert all(map(is_loopback, ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.0.2.7", "no-such-host.invalid"]))


def test_a_model_that_fails_to_load_is_one_line(tiny_model_dir, tmp_path):
    """The model loads on the engine thread; its error still reaches the command line."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir("llama"), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    proc = subprocess.run([sys.executable, "-m", "desktop.cli", "serve", "--model", str(broken),
                           "--port", "0"], capture_output=True, text=True, timeout=WAIT_S)
    assert_one_line_error(proc.returncode, proc.stderr, "truncated", "model.safetensors")
    assert proc.stdout == ""  # never announced


def test_a_port_in_use_is_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--port", str(port), "--model", "/nonexistent/model"])
    assert_one_line_error(code, capsys.readouterr().err, f"127.0.0.1:{port}")


@pytest.fixture
def steady_disk(monkeypatch):
    """The disk default follows the free space, which other processes change: hold it still."""
    monkeypatch.setattr(budgets_module, "_free_disk_bytes", lambda path: 50 << 30)


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_cache_flags_set_the_budgets(command, steady_disk):
    defaults = CacheConfig.default()
    parse = build_parser().parse_args
    assert _cache_config(parse([command])) == defaults
    config = _cache_config(parse([command, "--cache-device-mb", "64", "--cache-host-mb", "0",
                                  "--cache-disk-mb", "100"]))
    assert (config.budgets.device_bytes, config.budgets.host_bytes,
            config.budgets.disk_bytes) == (64 * MIB, 0, 100 * MIB)
    assert config.directory == defaults.directory
    for flags in (["--no-disk-cache"], ["--cache-disk-mb", "0"]):
        memory_only = _cache_config(parse([command, *flags]))
        assert memory_only.budgets.disk_bytes == 0 and memory_only.directory is None
        assert memory_only.budgets.device_bytes == defaults.budgets.device_bytes


def test_chat_takes_the_same_cache_flags(tiny_model_dir):
    """`arbor chat --no-disk-cache` writes nothing to the disk tier, where a chat with the
    default budgets stores its new states."""
    disk_tier = CacheConfig.default().directory

    def chat(*flags: str) -> str:
        args = build_parser().parse_args(["chat", "--model", str(tiny_model_dir("llama")),
                                          "--max-tokens", "3", *flags])
        out = io.StringIO()
        assert cmd_chat(args, stdin=io.StringIO("hello\n/quit\n"), stdout=out) == 0
        return out.getvalue()

    assert "prompt tokens cached" in chat("--no-disk-cache")
    assert not disk_tier.exists()
    chat()
    assert any(disk_tier.iterdir())


def test_help_shows_this_machines_default_budgets(capsys, steady_disk):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    budgets = CacheConfig.default().budgets
    assert budgets.disk_bytes == 5 << 30  # a tenth of the free space
    for tier, value in (("device", budgets.device_bytes), ("host", budgets.host_bytes),
                        ("disk", budgets.disk_bytes)):
        assert f"--cache-{tier}-mb N {tier} tier budget in MiB (default here: " \
               f"{value // MIB})" in out


def test_the_default_batch_follows_the_cores_this_process_may_use(capsys):
    assert [default_max_batch(cpus, gpu=False) for cpus in (1, 2, 3, 8, 64)] == [4, 8, 12, 32, 32]
    assert default_max_batch(1, gpu=True) == 32
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    here = default_max_batch(gpu=False)
    assert f"(default: 4 per core, here {here}; 32 on a GPU)" in out
    assert build_parser().parse_args(["serve"]).max_batch is None  # the serve command asks


def test_parsing_the_command_line_does_not_import_mlx():
    """``arbor app`` shows its window before MLX loads: the parser (its --help texts too) must
    not import it."""
    code = ("import sys; from desktop.cli import build_parser; build_parser(); "
            "sys.exit('mlx.core' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("flag, value", [("--cache-host-mb", "-1"), ("--port", "70000")])
def test_bad_flag_values_are_one_line(capsys, flag, value):
    with pytest.raises(SystemExit) as info:
        main(["serve", flag, value])
    assert_one_line_error(info.value.code, capsys.readouterr().err, flag)


def test_a_served_process_with_a_key_on_all_addresses(tiny_model_dir, tmp_path):
    """The real command: every address with a key, the cache flags reach the engine, the
    drafter's round costs settled before it answers, 401 without the key, a reply with it, and
    Ctrl-C stops it cleanly (exit status 0)."""
    profiles = tmp_path / "profiles"
    proc = subprocess.Popen(
        [sys.executable, "-m", "desktop.cli", "serve", "--model", str(tiny_model_dir("llama")),
         "--host", "0.0.0.0", "--port", "0", "--api-key", "sesame",
         "--cache-device-mb", "64", "--no-disk-cache"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "ARBOR_PROFILES_DIR": str(profiles)})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],
                     daemon=True).start()
    try:
        announced = lines.get(timeout=WAIT_S)
        assert announced.startswith("arbor serve: ") and "(API key required)" in announced
        assert [f for f in profiles.glob("*.json") if f.name != "hashes.json"]
        port = int(announced.split("http://0.0.0.0:")[1].split("/")[0])
        url = f"http://127.0.0.1:{port}"
        model = announced.split()[2]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0,
                               timeout=WAIT_S)
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.usage.completion_tokens >= 1
        assert get_json(url, "/health")["status"] == "ok"  # liveness needs no key
        tiers = client.get("/arbor/cache", cast_to=object)["tiers"]
        assert tiers["device"]["budget"] == 64 * MIB and tiers["disk"]["budget"] == 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=WAIT_S) == 0, proc.stderr.read()
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
