"""The disk tier's faults through the real server: a full disk, a corrupt index, a read-only
mount, an unwritable directory, missing files. None of them may fail a request or change a
reply: every answer equals a cold server's (temperature 0), the server says once what it did
with the tier, and the tier comes back by itself when the disk does.

The disk is real where this platform allows it: a tmpfs the test mounts (root on Linux),
filled with a ballast file and emptied again, remounted read-only. An unwritable directory is
simulated by injected faults (root may write anywhere). Models: one tiny model per cache kind
(full attention, a sliding window that wraps, hybrid recurrent). Forwards of at most 16 tokens
(row-invariant) make a reply restored from any tier equal a cold one bit for bit.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from backend.engine import Engine
from backend.memory.budgets import CacheBudgets, CacheConfig
from backend.memory.disk import RetryPolicy
from tests.fixtures.faults import FaultPlan, FaultyIO
from tests.fixtures.server import WAIT_S, get_json, running_server
from tests.skip_policy import NOT_ROOT_ON_LINUX, platform_skip, root_on_linux

pytestmark = pytest.mark.cache_faults

KINDS = ("llama", "gemma3", "qwen3_next")
EXACT_CHUNK = 16
KIB = 1024
# Little room on the device, none on the host: the conversation's states live on the disk.
BUDGETS = CacheBudgets(device_bytes=8 * KIB, host_bytes=0, disk_bytes=1 << 30)
QUICK_RETRY = RetryPolicy(first_s=0.05, most_s=0.2)
QUESTIONS = ["hello there", "tell me more", "and then what happened", "why is that",
             "say it again", "one more time", "and the end", "thanks"]


# -- the platform: a tmpfs the test mounts ----------------------------------------------------
@contextmanager
def tmpfs(path: Path, size_kib: int) -> Iterator[Path]:
    if not root_on_linux():
        platform_skip(NOT_ROOT_ON_LINUX, "a tmpfs is mounted to fill the disk for real")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(mount: Path) -> Path:
    """Write a ballast file until the file system is full."""
    ballast = mount / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return ballast


def remount(mount: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mount)], check=True)


# -- a server over a cache dir, and the cold reference ---------------------------------------
def cache_config(directory: Path, io=None) -> CacheConfig:
    return CacheConfig(BUDGETS, directory, capture_interval=16, pre_end=4,
                       disk_retry=QUICK_RETRY, disk_io=io)


@contextmanager
def server(folder: Path, directory: Path, io=None):
    load = lambda: Engine.load(str(folder), cache=cache_config(directory, io),  # noqa: E731
                               prefill_chunk=EXACT_CHUNK)
    with running_server(load) as srv:
        yield srv


class Cold:
    """Replies of a fresh engine that stores nothing: what a cold server answers."""

    def __init__(self, folder: Path) -> None:
        self.engine = Engine.load(str(folder), cache=CacheConfig(CacheBudgets(0, 0, 0), None),
                                  prefill_chunk=EXACT_CHUNK)

    def reply(self, messages: list[dict]) -> str:
        from backend.api import DoneEvent, GenerateRequest

        request = GenerateRequest(messages=messages, max_tokens=8)
        return next(e for e in self.engine.generate(request) if isinstance(e, DoneEvent)).text


class Conversation:
    """A chat through the server's API; every reply is checked against the cold one."""

    def __init__(self, srv, cold: Cold, system: str = "You are terse.") -> None:
        self.srv, self.cold = srv, cold
        self.messages = [{"role": "system", "content": system}]
        self.asked = 0

    def turn(self):
        self.messages.append({"role": "user", "content": QUESTIONS[self.asked % len(QUESTIONS)]
                              + f" #{self.asked}"})
        self.asked += 1
        reply = self.srv.client().chat.completions.create(
            model=self.srv.model, messages=self.messages, max_tokens=8, temperature=0)
        text = reply.choices[0].message.content
        assert text == self.cold.reply(self.messages), f"turn {self.asked} differs from cold"
        self.messages.append({"role": "assistant", "content": text})
        return reply.usage


def turns_until_stored(chat: Conversation, most: int = 6) -> None:
    """Chat on until the disk tier stores again (each turn writes; the back-off is short)."""
    for _ in range(most):
        chat.turn()
        if disk_state(chat.srv)[0] == "on":
            return
    raise AssertionError(f"the disk tier did not store again within {most} turns: "
                         f"{disk_state(chat.srv)}")


def disk_state(srv) -> tuple[str, str]:
    stats = get_json(srv.url, "/v1/arbor/cache")
    return stats["disk_mode"], stats["disk_note"]


def disk_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("backend.memory") and r.levelno >= logging.WARNING
            and "checksum" not in r.getMessage()]


@pytest.fixture(scope="module")
def colds(tiny_model_dir):
    made: dict[str, Cold] = {}

    def get(kind: str) -> Cold:
        if kind not in made:
            made[kind] = Cold(tiny_model_dir(kind))
        return made[kind]
    return get


# -- check 1: the disk fills, is full at start, frees up again --------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_disk_that_fills_up_and_frees_again(kind, tiny_model_dir, colds, tmp_path, caplog):
    folder, cold = tiny_model_dir(kind), colds(kind)
    caplog.set_level(logging.WARNING, logger="backend.memory")
    with tmpfs(tmp_path / "disk", 16 * 1024) as mount:
        with server(folder, mount) as srv:
            chat = Conversation(srv, cold)
            for _ in range(2):
                chat.turn()
            assert disk_state(srv)[0] == "on"
            ballast = fill(mount)  # the disk fills mid-conversation
            for _ in range(3):
                chat.turn()
            mode, note = disk_state(srv)
            assert mode == "read-only" and "full" in note, (mode, note)
            full = [line for line in disk_lines(caplog) if "full" in line]
            assert len(full) == 1, disk_lines(caplog)  # once, not per request
            ballast.unlink()  # space comes back: the tier stores again without a restart
            turns_until_stored(chat)
            chat.turn()
        # A restart reads what was stored after the disk came back.
        with server(folder, mount) as srv:
            chat.srv = srv
            usage = chat.turn()
            assert usage.model_extra["arbor"]["cached_by_tier"]["disk"] > 0, usage


@pytest.mark.parametrize("kind", KINDS)
def test_a_disk_full_at_start_then_a_restart_after_it(kind, tiny_model_dir, colds, tmp_path,
                                                      caplog):
    folder, cold = tiny_model_dir(kind), colds(kind)
    caplog.set_level(logging.WARNING, logger="backend.memory")
    with tmpfs(tmp_path / "disk", 16 * 1024) as mount:
        with server(folder, mount) as srv:  # some states stored, then the disk fills
            chat = Conversation(srv, cold)
            chat.turn()
            ballast = fill(mount)
            chat.turn()
        with server(folder, mount) as srv:  # full at start: start-up deletes, index writes fail
            chat.srv = srv
            chat.turn()
            other = Conversation(srv, cold, system="You are verbose.")
            other.turn()
            other.turn()
            assert disk_state(srv)[0] != "on"
            ballast.unlink()
            turns_until_stored(other)
        with server(folder, mount) as srv:  # a restart after a disk-full run
            chat.srv = other.srv = srv
            chat.turn()
            usage = other.turn()
            assert usage.model_extra["arbor"]["cached_by_tier"]["disk"] > 0
    assert not any("Traceback" in line for line in disk_lines(caplog))


# -- check 2: a damaged cache dir at start-up -------------------------------------------------
def _overwrite(path: Path, offset: int | None, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset if offset is not None else max(0, path.stat().st_size // 2))
        f.write(data)


DAMAGES = {
    "overwritten pages": lambda d: _overwrite(d / "index.sqlite3", 4096, os.urandom(8192)),
    "overwritten header": lambda d: _overwrite(d / "index.sqlite3", 0, os.urandom(100)),
    "zero bytes": lambda d: (d / "index.sqlite3").write_bytes(b""),
    "garbage wal": lambda d: (d / "index.sqlite3-wal").write_bytes(os.urandom(40000)),
    "missing files": lambda d: [p.unlink() for p in (d / "nodes").iterdir()],
    "leftover temporaries": lambda d: [(d / "nodes" / "x.safetensors.tmp-999999").write_bytes(
        b"x"), (d.parent / "hashes.tmp-999999").write_bytes(b"{")],
}


def _populate(folder: Path, directory: Path, cold: Cold) -> Conversation:
    with server(folder, directory) as srv:
        chat = Conversation(srv, cold)
        for _ in range(3):
            chat.turn()
    return chat


def _store_dir(directory: Path) -> Path:
    (store,) = [p for p in directory.iterdir() if (p / "index.sqlite3").exists()]
    return store


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_cache_dir_still_starts_and_answers(damage, tiny_model_dir, colds, tmp_path,
                                                      caplog):
    folder, cold = tiny_model_dir("llama"), colds("llama")
    chat = _populate(folder, tmp_path, cold)
    store = _store_dir(tmp_path)
    DAMAGES[damage](store)
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="backend.memory")
    with server(folder, tmp_path) as srv:
        chat.srv = srv
        for _ in range(2):
            chat.turn()
        mode, note = disk_state(srv)
        assert mode == "on", note  # a fresh index, or the old one without what was lost
        lines = disk_lines(caplog)
        assert len(lines) <= 1, lines  # says once what it did with the tier
    if damage.startswith("overwritten"):
        assert list(store.glob("index.sqlite3.corrupt-*")), "the corrupt index is kept aside"
        assert "moved aside" in lines[0]
    if damage == "missing files":
        assert "no file" in lines[0]
    if damage == "leftover temporaries":
        assert not list(store.glob("nodes/*.tmp-*")) and not list(tmp_path.glob("hashes.tmp-*"))


def test_a_read_only_mount_serves_what_it_holds(tiny_model_dir, colds, tmp_path, caplog):
    folder, cold = tiny_model_dir("llama"), colds("llama")
    with tmpfs(tmp_path / "disk", 4096) as mount:
        chat = _populate(folder, mount, cold)
        remount(mount, "ro")
        caplog.set_level(logging.WARNING, logger="backend.memory")
        with server(folder, mount) as srv:
            chat.srv = srv
            usage = chat.turn()
            assert usage.model_extra["arbor"]["cached_by_tier"]["disk"] > 0  # read from disk
            chat.turn()
            mode, note = disk_state(srv)
            assert mode == "read-only" and "read-only file system" in note, (mode, note)
            assert len(disk_lines(caplog)) == 1, disk_lines(caplog)
        remount(mount, "rw")


def test_an_unwritable_cache_dir_runs_without_storing(tiny_model_dir, colds, tmp_path, caplog):
    """Root writes anywhere, so the directory's refusal is injected (every file and SQLite call
    that would create or change something fails with EACCES, as for a user without rights)."""
    folder, cold = tiny_model_dir("llama"), colds("llama")

    def refuse(site: str) -> Exception:
        return PermissionError(errno.EACCES, f"Permission denied (injected at {site})")

    plan = FaultPlan(refuse)
    plan.arm("mkdir", 1, persistent=True)
    caplog.set_level(logging.WARNING, logger="backend.memory")
    with server(folder, tmp_path / "cache", io=FaultyIO(plan)) as srv:
        chat = Conversation(srv, cold)
        for _ in range(3):
            chat.turn()
        mode, note = disk_state(srv)
        assert mode == "off" and "not writable" in note, (mode, note)
        assert len(disk_lines(caplog)) == 1, disk_lines(caplog)


# -- the real command: start-up says it in one line -------------------------------------------
@pytest.mark.parametrize("damage", ["overwritten header", "read-only mount"])
def test_arbor_serve_starts_over_a_damaged_cache_dir(damage, tiny_model_dir, colds, tmp_path):
    folder, cold = tiny_model_dir("llama"), colds("llama")
    with tmpfs(tmp_path / "disk", 4096) as mount:
        _populate(folder, mount / "prefix-cache", cold)  # where the command keeps its cache
        if damage == "read-only mount":
            remount(mount, "ro")
        else:
            DAMAGES[damage](_store_dir(mount / "prefix-cache"))
        env = {**os.environ, "ARBOR_CACHE_DIR": str(mount)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "desktop.cli", "serve", "--model", str(folder), "--port", "0",
             "--cache-device-mb", "1", "--cache-host-mb", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],
                         daemon=True).start()
        try:
            announced = lines.get(timeout=WAIT_S)
            assert announced.startswith("arbor serve: "), announced
            url = announced.split(" at ")[1].split("/v1")[0]
            import openai

            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                   timeout=WAIT_S)
            messages = [{"role": "user", "content": "hello there"}]
            reply = client.chat.completions.create(model=announced.split()[2],
                                                   messages=messages, max_tokens=8,
                                                   temperature=0)
            assert reply.choices[0].message.content == cold.reply(messages)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=WAIT_S) == 0
            err = proc.stderr.read()
            assert "Traceback" not in err, err
            said = [line for line in err.splitlines() if line.startswith("prefix cache:")]
            assert len(said) == 1, err
            assert ("read-only" if damage == "read-only mount" else "moved aside") in said[0]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if damage == "read-only mount":
                remount(mount, "rw")
    shutil.rmtree(tmp_path, ignore_errors=True)
