"""``arbor bench cache``: many saved conversations, switched round-robin, against two servers.

The trace: ``conversations`` chats (40) sharing two system prompts of ``system_tokens`` (~1.1k)
tokens, ``turns`` (6) user turns each, visited round-robin, so every conversation sits idle while
all the others run; each reply is ``new_tokens`` (48) greedy tokens. It is sent over HTTP
(streaming, the way a chat client talks) to

* ``arbor serve`` with the given tier budgets (and, with ``defaults``, the machine's defaults),
* mlx-lm's server (``python -m mlx_lm.server``) with its prompt cache of ``mlx_cache_sizes``
  entries,

each a fresh process on the same float32 weights, one after the other. Then every server is
restarted and the last turn of every conversation is replayed.

Per server it reports: the median time to first token of turns >= 2 against turn 1; the share
of each resumed prompt's prior context (everything before its last user message) that the
server served from cache (token-weighted; for Arbor split by source: live caches, device, host,
disk); the server's peak resident memory; and the same after the restart. Timings belong here,
never in tests.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from backend.memory.trie import common_prefix_length
from backend.tokenizer import Tokenizer

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part over "
    "new sound take only little work know place year live me back give most very after thing "
    "our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put "
    "end does another well large must big even such because turn here why ask went men read "
    "need land different home us move try kind hand picture again change off play spell air "
    "away animal house point page letter mother answer found study still learn should America "
    "world river garden engine signal market winter harbor silver orbit lantern meadow"
).split()
READY_TIMEOUT_S = 900


# -- the trace ---------------------------------------------------------------------------------
@dataclass
class Trace:
    systems: list[str]
    assignment: list[int]  # conversation -> system prompt
    users: list[list[str]]  # [conversation][turn]


def _text(rng: random.Random, tokenizer: Tokenizer, tokens: int) -> str:
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words += [rng.choice(WORDS) for _ in range(max(4, (tokens - len(words)) // 2))]
    while len(tokenizer.encode(" ".join(words))) > tokens:
        words.pop()
    return " ".join(words).capitalize() + "."


def make_trace(tokenizer: Tokenizer, conversations: int, turns: int, system_tokens: int,
               seed: int = 0) -> Trace:
    rng = random.Random(seed)
    systems = [f"You are assistant {i + 1}. " + _text(rng, tokenizer, system_tokens)
               for i in range(2)]
    users = [[_text(rng, tokenizer, rng.randrange(25, 60)) + " Please answer briefly."
              for _ in range(turns)] for _ in range(conversations)]
    return Trace(systems, [c % 2 for c in range(conversations)], users)


def prior_context_tokens(tokenizer: Tokenizer, messages: list[dict]) -> int:
    """Tokens of the prompt that come before its last user message (what a cache could hold)."""
    if len(messages) <= 2:
        before = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False)
    else:
        before = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=False)
    return common_prefix_length(before, tokenizer.apply_chat_template(messages))


# -- servers -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A server process on loopback: ``argv`` gets ``--port`` appended."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    arbor: bool = False
    model: str = "default_model"  # the name requests use (Arbor's: from /v1/models)
    port: int = 0
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    def start(self) -> None:
        self.port = free_port()
        self.log_path = Path(tempfile.mkstemp(prefix=f"bench-{self.name}-", suffix=".log")[1])
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.argv + ["--port", str(self.port)], stdout=log,
                                        stderr=subprocess.STDOUT, env={**os.environ, **self.env})
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited at start; see {self.log_path}")
            try:
                status, models = request(self.port, "GET", "/v1/models")
                if status == 200:
                    if self.arbor:
                        self.model = models["data"][0]["id"]
                    return
            except OSError:
                pass
            time.sleep(0.2)  # a benchmark polls a starting process; tests never do this
        raise RuntimeError(f"{self.name} did not start in {READY_TIMEOUT_S} s")

    def peak_rss_bytes(self) -> int:
        """Peak resident set of the server process (Linux: VmHWM; elsewhere 0)."""
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)  # a clean stop: Arbor writes pending states
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def request(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        try:
            return response.status, json.loads(data or b"{}")
        except ValueError:
            return response.status, {}
    finally:
        conn.close()


def stream_chunks(port: int, body: dict, timeout: float) -> Iterator[dict]:
    """The parsed ``data:`` chunks of one streamed chat completion (``body`` is its request)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            yield json.loads(data)
    finally:
        conn.close()


def chunk_text(chunk: dict) -> str:
    """The content a streamed chunk adds ("" for role, usage and empty chunks)."""
    return "".join((choice.get("delta") or {}).get("content") or ""
                   for choice in chunk.get("choices") or [])


def stream_chat(port: int, model: str, messages: list[dict],
                max_tokens: int) -> tuple[float, str, dict]:
    """(time to first content, reply text, usage) of one streamed chat completion."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, pieces, usage = None, [], {}
    for chunk in stream_chunks(port, body, timeout=600):
        text = chunk_text(chunk)
        if text:
            if ttft is None:
                ttft = time.perf_counter() - start
            pieces.append(text)
        if chunk.get("usage"):
            usage = chunk["usage"]
    return (ttft if ttft is not None else time.perf_counter() - start), "".join(pieces), usage


def arbor_tier_hits(port: int) -> dict[str, int] | None:
    status, stats = request(port, "GET", "/v1/arbor/cache")
    if status != 200:
        return None
    hits = {tier: int(t["hits"]) for tier, t in stats["tiers"].items()}
    hits["live"] = int(stats["live_hits"])
    return hits


# -- running the trace -------------------------------------------------------------------------
@dataclass
class TurnResult:
    conversation: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    prior_tokens: int
    by_tier: dict[str, int]


def run_turns(server: Server, trace: Trace, tokenizer: Tokenizer, histories: list[list[dict]],
              turns: range, new_tokens: int, log: Callable[[str], None],
              record: bool = True) -> list[TurnResult]:
    results = []
    for turn in turns:
        for conv, users in enumerate(trace.users):
            system = {"role": "system", "content": trace.systems[trace.assignment[conv]]}
            messages = [system] + histories[conv] + [{"role": "user", "content": users[turn]}]
            before = arbor_tier_hits(server.port) if server.arbor else None
            ttft, reply, usage = stream_chat(server.port, server.model, messages, new_tokens)
            after = arbor_tier_hits(server.port) if server.arbor else None
            by_tier = {k: after[k] - before[k] for k in after} if before and after else {}
            details = usage.get("prompt_tokens_details") or {}
            results.append(TurnResult(conv, turn, ttft, int(usage.get("prompt_tokens", 0)),
                                      int(details.get("cached_tokens") or 0),
                                      prior_context_tokens(tokenizer, messages), by_tier))
            if record:
                histories[conv] += [messages[-1], {"role": "assistant", "content": reply}]
        log(f"  {server.name}: turn {turn + 1} done")
    return results


@dataclass
class Summary:
    name: str
    first_ttft_s: float
    later_ttft_s: float
    cached_share: float
    tier_share: dict[str, float]
    peak_rss_bytes: int
    restart_ttft_s: float
    restart_share: float
    restart_tier_share: dict[str, float]
    restart_peak_rss_bytes: int
    # Per turn: the median TTFT and prompt length (later turns attend over longer contexts).
    by_turn: list[tuple[float, int]] = field(default_factory=list)

    @property
    def ttft_ratio(self) -> float:
        return self.later_ttft_s / self.first_ttft_s


def _shares(results: list[TurnResult]) -> tuple[float, dict[str, float]]:
    prior = sum(r.prior_tokens for r in results) or 1
    cached = sum(min(r.cached_tokens, r.prior_tokens) for r in results)
    tiers: dict[str, float] = {}
    for r in results:
        # A replayed prompt is cached past its prior context (its last user turn too): count
        # each tier's part of the prior context only.
        scale = min(r.cached_tokens, r.prior_tokens) / r.cached_tokens if r.cached_tokens else 0
        for tier, n in r.by_tier.items():
            tiers[tier] = tiers.get(tier, 0.0) + n * scale
    return cached / prior, {t: n / prior for t, n in tiers.items()}


def run_server(server: Server, trace: Trace, tokenizer: Tokenizer, new_tokens: int,
               log: Callable[[str], None]) -> Summary:
    histories: list[list[dict]] = [[] for _ in trace.users]
    turns = len(trace.users[0])
    log(f"{server.name}: starting")
    server.start()
    try:
        results = run_turns(server, trace, tokenizer, histories, range(turns), new_tokens, log)
        rss = server.peak_rss_bytes()
    finally:
        server.stop()
    log(f"{server.name}: restarting, replaying the last turns")
    for h in histories:  # the last turn is sent again, as it was
        del h[-2:]
    server.start()
    try:
        replay = run_turns(server, trace, tokenizer, histories, range(turns - 1, turns),
                           new_tokens, log, record=False)
        restart_rss = server.peak_rss_bytes()
    finally:
        server.stop()
    first = [r.ttft_s for r in results if r.turn == 0]
    later = [r for r in results if r.turn > 0]
    share, tiers = _shares(later)
    restart_share, restart_tiers = _shares(replay)
    by_turn = [(statistics.median(r.ttft_s for r in results if r.turn == t),
                int(statistics.median(r.prompt_tokens for r in results if r.turn == t)))
               for t in range(turns)]
    return Summary(server.name, statistics.median(first),
                   statistics.median(r.ttft_s for r in later), share, tiers, rss,
                   statistics.median(r.ttft_s for r in replay), restart_share, restart_tiers,
                   restart_rss, by_turn)


def arbor_server(folder: Path, name: str, cache_args: list[str], cache_dir: Path) -> Server:
    argv = [sys.executable, "-m", "desktop.cli", "serve", "--model", str(folder), *cache_args]
    return Server(name, argv, env={"ARBOR_CACHE_DIR": str(cache_dir)}, arbor=True)


def mlx_lm_server(folder: Path, entries: int) -> Server:
    # The system OpenBLAS for mlx-lm too (as in our process), so only the servers differ.
    launcher = ("import backend.blas as b, runpy, sys; b.preload_system_blas(); "
                "sys.argv = ['mlx_lm.server'] + sys.argv[1:]; "
                "runpy.run_module('mlx_lm.server', run_name='__main__')")
    argv = [sys.executable, "-c", launcher, "--model", str(folder),
            "--prompt-cache-size", str(entries), "--max-tokens", "512"]
    return Server(f"mlx-lm ({entries} entries)", argv)


def format_table(summaries: list[Summary], trace_line: str) -> str:
    def tiers(d: dict[str, float]) -> str:
        keys = [k for k in ("live", "device", "host", "disk") if d.get(k)]
        return " ".join(f"{k} {100 * d[k]:.1f}%" for k in keys) or "-"

    lines = [trace_line,
             f"{'server':34} {'TTFT t1':>8} {'TTFT t>=2':>9} {'ratio':>6} {'cached':>7} "
             f"{'peak RSS':>9}  {'after restart: TTFT  cached  peak RSS':38}  by tier"]
    for s in summaries:
        lines.append(
            f"{s.name:34} {s.first_ttft_s:8.3f} {s.later_ttft_s:9.3f} {s.ttft_ratio:5.2f}x "
            f"{100 * s.cached_share:6.1f}% {s.peak_rss_bytes / 1e9:7.2f}GB  "
            f"{s.restart_ttft_s:20.3f} {100 * s.restart_share:6.1f}% "
            f"{s.restart_peak_rss_bytes / 1e9:8.2f}GB  {tiers(s.tier_share)} | after restart: "
            f"{tiers(s.restart_tier_share)}")
    for s in summaries:
        lines.append(f"{s.name}: TTFT by turn (prompt tokens) " + ", ".join(
            f"t{t + 1} {ttft:.3f} s ({tokens})" for t, (ttft, tokens) in enumerate(s.by_turn)))
    return "\n".join(lines)


def run(folder: Path, work_dir: Path, conversations: int = 40, turns: int = 6,
        new_tokens: int = 48, system_tokens: int = 1100,
        arbor_runs: list[tuple[str, list[str]]] | None = None,
        mlx_cache_sizes: tuple[int, ...] = (10,), log: Callable[[str], None] = print
        ) -> tuple[list[Summary], str]:
    """Run the trace against every server; ``arbor_runs``: (label, extra serve arguments)."""
    tokenizer = Tokenizer.from_folder(folder)
    trace = make_trace(tokenizer, conversations, turns, system_tokens)
    servers = []
    for i, (label, args) in enumerate(arbor_runs or [("defaults", [])]):
        cache_dir = work_dir / f"prefix-cache-{i}"
        if cache_dir.exists():
            import shutil

            shutil.rmtree(cache_dir)
        servers.append(arbor_server(folder, f"arbor serve ({label})", args, cache_dir))
    servers += [mlx_lm_server(folder, n) for n in mlx_cache_sizes]
    summaries = [run_server(s, trace, tokenizer, new_tokens, log) for s in servers]
    line = (f"{conversations} conversations x {turns} turns, round-robin; 2 system prompts of "
            f"~{system_tokens} tokens; {new_tokens} new tokens per reply; {folder.name}")
    return summaries, format_table(summaries, line)
