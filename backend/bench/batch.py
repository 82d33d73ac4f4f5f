"""``arbor bench batch``: many clients streaming at once, against ``arbor serve`` and mlx-lm's
server on the same weights, one after the other in one run.

For each weight format (float32, 4-bit) and each server, ``clients`` (1, 2, 4, 8, 16) streaming
chat clients start together, each asking for ``new_tokens`` tokens of a reply to its own
prompt (~``prompt_tokens`` tokens). Per row it reports the aggregate tokens per second (all
tokens over the wall time from the first request to the last token), the median per-client
decode rate (tokens after the first over the time since the first), the median and 95th
percentile time to first token, and the 95th percentile gap between two tokens of one client.

Then the stall test: four clients stream, and once each has its first tokens a client with a
``long_prompt`` (4k) token prompt arrives; reported: the four clients' median and 95th
percentile inter-token gap while that prompt was prefilling and after, and their longest gap
(the long prompt's prefill steps).

Finally what one batched step costs per row count (1..16 rows of one decode token each, every
row its own sequence) against a one-row step, in-process on the same weights.
Timings belong here, never in tests.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from backend.bench.cache import (Server, WORDS, arbor_server, chunk_text, mlx_lm_server,
                                 stream_chunks)

CLIENTS = (1, 2, 4, 8, 16)


@dataclass
class Stream:
    """One client's request: when it was sent and when each token arrived."""

    start: float
    arrivals: list[float]

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.start if self.arrivals else float("nan")

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


@dataclass
class Row:
    server: str
    weights: str
    clients: int
    aggregate_tps: float
    client_tps: float
    ttft_p50: float
    ttft_p95: float
    gap_p95: float


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def prompt_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def stream_tokens(port: int, model: str, content: str, max_tokens: int,
                  on_token: Callable[[], None] | None = None) -> Stream:
    """Stream one chat completion; the arrival time of every content chunk (one per token)."""
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}  # Arbor's extension; mlx-lm ignores it (a reply may end early)
    stream = Stream(time.perf_counter(), [])
    for chunk in stream_chunks(port, body, timeout=3600):
        if chunk_text(chunk):
            stream.arrivals.append(time.perf_counter())
            if on_token is not None:
                on_token()
    return stream


def concurrent_streams(server: Server, contents: list[str], max_tokens: int) -> list[Stream]:
    results: list[Stream | None] = [None] * len(contents)

    def one(i: int) -> None:
        results[i] = stream_tokens(server.port, server.model, contents[i], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(contents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def row(server: Server, weights: str, streams: list[Stream]) -> Row:
    tokens = sum(len(s.arrivals) for s in streams)
    wall = max(s.arrivals[-1] for s in streams if s.arrivals) - min(s.start for s in streams)
    rates = [(len(s.arrivals) - 1) / (s.arrivals[-1] - s.arrivals[0])
             for s in streams if len(s.arrivals) > 1]
    ttfts = [s.ttft for s in streams]
    gaps = [g for s in streams for g in s.gaps]
    return Row(server.name, weights, len(streams), tokens / wall, statistics.median(rates),
               percentile(ttfts, 0.5), percentile(ttfts, 0.95), percentile(gaps, 0.95))


class Stall(NamedTuple):
    """The stall test of one server: the four streaming clients' inter-token gaps over their
    whole replies (median, 95th percentile, the longest: the prefill steps of the long prompt
    are a few gaps of each reply, which the percentile does not see), the long prompt's TTFT."""

    server: str
    weights: str
    median: float
    p95: float
    longest: float
    long_ttft: float


def stall_test(server: Server, rng: random.Random, long_words: int, new_tokens: int,
               weights: str) -> Stall:
    """Four clients stream; a long prompt arrives once each has its first tokens."""
    started = threading.Semaphore(0)
    results: list[Stream | None] = [None] * 4

    def one(i: int) -> None:
        seen = [0]

        def token() -> None:
            seen[0] += 1
            if seen[0] == 3:
                started.release()
        results[i] = stream_tokens(server.port, server.model, prompt_text(rng, 40),
                                   new_tokens, token)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for _ in range(4):
        started.acquire()
    long = stream_tokens(server.port, server.model, prompt_text(rng, long_words), 4)
    for t in threads:
        t.join()
    gaps = [g for s in results if s is not None for g in s.gaps]
    return Stall(server.name, weights, statistics.median(gaps), percentile(gaps, 0.95),
                 max(gaps), long.ttft)


def step_costs(folder: Path, rows: range = range(1, 17), context: int = 300,
               repeats: int = 7) -> list[tuple[int, float]]:
    """(rows, ms) of one batched decode step, every row its own sequence at ``context``."""
    import mlx.core as mx

    from backend.caches.segments import layer_segments
    from backend.weights.loading import load_model

    model = load_model(folder).model
    rng = random.Random(0)
    vocab = model.args.vocab_size
    lanes = []
    for _ in range(max(rows)):
        caches = model.make_caches()
        for at in range(0, context, 256):
            ids = [rng.randrange(3, vocab) for _ in range(min(256, context - at))]
            mx.eval(model.hidden(mx.array(ids)[None], caches))
        lanes.append(caches)
    out = []
    for n in rows:
        times = []
        for _ in range(repeats):
            ids = mx.array([rng.randrange(3, vocab) for _ in range(n)])
            t0 = time.perf_counter()
            logits = model.logits(model.hidden(ids[None], layer_segments(lanes[:n], [1] * n)))
            mx.eval(logits)
            times.append(time.perf_counter() - t0)
            for caches in lanes[:n]:
                for cache in caches:
                    cache.restore(None, context)
        out.append((n, 1000 * statistics.median(times[1:])))
    return out


def servers(folder: Path, work: Path, max_batch: int, against_mlx_lm: bool,
            arbor_args: list[str] = ()) -> list[Server]:
    flags = ["--max-batch", str(max_batch), *arbor_args]
    made = [arbor_server(folder, f"arbor serve ({' '.join(flags)})",
                         flags + ["--no-disk-cache"], work / "cache")]
    if against_mlx_lm:
        mlx = mlx_lm_server(folder, 10)
        mlx.argv += ["--decode-concurrency", "32", "--prompt-concurrency", "8"]
        mlx.name = "mlx-lm server (decode-concurrency 32)"
        made.append(mlx)
    return made


#: A server slower than this alone (tokens/s) is not run with more clients: mlx-lm's 4-bit
#: path on a CPU makes about 0.5, and its 4..16-client rows would take over an hour.
SLOWEST_TPS = 2.0


def run(variants: dict[str, Path], work: Path, clients: tuple[int, ...] = CLIENTS,
        new_tokens: int = 64, prompt_words: int = 60, long_words: int = 3000,
        max_batch: int = 16, against_mlx_lm: bool = True,
        log: Callable[[str], None] = print, slowest_tps: float = SLOWEST_TPS,
        arbor_args: list[str] = ()) -> tuple[list[Row], list[Stall], list]:
    """``variants``: weight format -> model folder; ``arbor_args``: more ``arbor serve``
    flags (``--exact-prefill``). Returns the rows, the stall tests and the step costs (of the
    first variant). A server under ``slowest_tps`` with the first client count keeps only
    that row (no stall test)."""
    rows, stalls = [], []
    for weights, folder in variants.items():
        for server in servers(folder, work, max_batch, against_mlx_lm, list(arbor_args)):
            log(f"{server.name}, {weights}: starting")
            server.start()
            try:
                rng = random.Random(0)
                stream_tokens(server.port, server.model, "warm up", 4)
                for n in clients:
                    contents = [prompt_text(rng, prompt_words) for _ in range(n)]
                    rows.append(row(server, weights, concurrent_streams(server, contents,
                                                                        new_tokens)))
                    log(f"  {n} clients: {rows[-1].aggregate_tps:.1f} tok/s")
                    if rows[-1].aggregate_tps < slowest_tps:
                        log(f"  under {slowest_tps:g} tok/s: its other rows and the stall "
                            "test are left out")
                        break
                else:
                    stalls.append(stall_test(server, rng, long_words, new_tokens * 2, weights))
            finally:
                server.stop()
    first = next(iter(variants.values()))
    return rows, stalls, step_costs(first)


def format_table(rows: list[Row], stalls: list[Stall], costs: list[tuple[int, float]]) -> str:
    lines = [f"{'server':50} {'weights':8} {'clients':>7} {'aggregate':>10} {'x1':>6} "
             f"{'per client':>10} {'TTFT p50':>9} {'TTFT p95':>9} {'gap p95':>8}"]
    base = {}
    for r in rows:
        if r.clients == 1:
            base[(r.server, r.weights)] = r.aggregate_tps
        ratio = r.aggregate_tps / base.get((r.server, r.weights), r.aggregate_tps)
        lines.append(f"{r.server:50} {r.weights:8} {r.clients:>7} {r.aggregate_tps:>7.1f} t/s "
                     f"{ratio:>5.2f}x {r.client_tps:>6.1f} t/s {r.ttft_p50:>8.2f}s "
                     f"{r.ttft_p95:>8.2f}s {1000 * r.gap_p95:>6.0f}ms")
    lines.append("")
    lines.append("a long prompt arriving while 4 clients stream (their inter-token gaps):")
    for st in stalls:
        lines.append(f"  {st.server:50} {st.weights:8} median {1000 * st.median:.0f} ms, p95 "
                     f"{1000 * st.p95:.0f} ms ({st.p95 / st.median:.2f}x), longest "
                     f"{1000 * st.longest:.0f} ms ({st.longest / st.median:.1f}x), the long "
                     f"prompt's TTFT {st.long_ttft:.1f} s")
    lines.append("")
    one = costs[0][1]
    lines.append("one batched decode step by rows (each row its own sequence), vs one row:")
    lines.append("  " + "  ".join(f"{n}: {ms:.1f} ms ({ms / one:.2f}x)" for n, ms in costs))
    return "\n".join(lines)
