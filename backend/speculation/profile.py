"""Round costs known before the first round: measured once per model, dtype and machine, kept.

The depth controller (``depth.py``) weighs each depth's expected tokens against what a round of
that depth costs. Learning those costs within a reply starts from plain decoding and tries the
depths one by one, so a short reply, or the first reply after every start, drafts little. So
the costs are measured beforehand (``measure_round_costs``: a plain step in a pipelined run, and
a verify block of 2 .. max_depth + 1 rows with its snapshots and rollback, on scratch caches)
and stored (``ProfileStore``: one JSON file per model and dtype under
``backend.paths.profiles_dir()``), keyed by what makes them stale:

* the model's fingerprint (config, weight bytes, dtype, compute path: ``memory/fingerprint.py``);
* Arbor's version (kernels and decode loops change between versions);
* the machine (CPU model and count, OS, MLX version).

A stored profile whose key differs is measured again and replaced. The costs are those of the
target; drafting with prompt lookup costs nothing more, so they are the lookup rounds' whole cost
(other drafters add their own drafting and keep learning it within the reply). Real rounds refine
the seeded costs as they come; nothing here is a promise about speed, only a better start.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

import mlx.core as mx

from backend.feeds import Feed
from backend.speculation.rollback import SpeculativeWrite

log = logging.getLogger(__name__)

PROFILE_VERSION = 1
#: Context the scratch caches hold before timing (rounds are timed at a short context).
CONTEXT_TOKENS = 32
WARMUP, REPEATS = 1, 3  # sweeps over the depths: untimed (kernels, graph caches), then timed
PLAIN_STEPS = 4  # plain steps per timed run (after the first, which waits for its own)
Answer = Callable[[list[Feed]], list[tuple]]


def arbor_version() -> str:
    try:
        return metadata.version("arbor-chat")
    except metadata.PackageNotFoundError:
        return "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def machine() -> str:
    """What the costs were measured on: a different CPU, OS or MLX makes them stale."""
    return (f"{platform.system()} {platform.machine()} {_cpu_model()} x{os.cpu_count()} "
            f"mlx {mx.__version__}")


def profile_key(fingerprint: str) -> dict[str, str]:
    return {"fingerprint": fingerprint, "arbor": arbor_version(), "machine": machine(),
            "format": str(PROFILE_VERSION)}


class ProfileStore:
    """Round-cost profiles under ``directory``, one file per ``name`` (model and dtype). A
    profile is read only when its key matches; reading or writing never fails a request (a
    profile is a head start, not a requirement)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def path(self, name: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        return self.directory / f"{safe}.json"

    def load(self, name: str, key: dict[str, str]) -> dict[int, float] | None:
        """The stored costs by depth, or None when there are none or they are stale."""
        try:
            data = json.loads(self.path(name).read_text())
            if data.get("key") != key:
                return None
            return {int(depth): float(seconds) for depth, seconds in data["costs"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def save(self, name: str, key: dict[str, str], costs: dict[int, float]) -> None:
        path = self.path(name)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"key": key, "costs": {str(d): s for d, s in
                                                             sorted(costs.items())}}, indent=1))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot store the round-cost profile %s: %s", path, exc)
            tmp.unlink(missing_ok=True)


def measure_round_costs(answer: Answer, make_caches: Callable[[], list], vocab_size: int,
                        max_depth: int, clock: Callable[[], float] = time.perf_counter
                        ) -> dict[int, float]:
    """Seconds per round by depth on scratch caches, through ``answer`` (the scheduler's
    batched forward, so the kernels are those of real rounds). Depth 0: one step of a pipelined
    run of plain steps (each queued before the previous token is read, as plain decoding does).
    Depth N: a verify block of N + 1 rows (the current token and N drafts), with the
    speculative write's snapshots, every row's logits and argmax read on the host, and one
    token kept, as a round after a verify round does. Each the least over ``REPEATS`` sweeps:
    a stall of the shared machine only ever makes a run slower."""
    caches = make_caches()
    ids = [(7 * i + 3) % vocab_size for i in range(CONTEXT_TOKENS)]
    hidden = answer([Feed(mx.array(ids), caches, "none")])[0][0]
    mx.eval(hidden, [c.arrays() for c in caches])
    token = mx.array([ids[-1]], dtype=mx.int32)
    costs: dict[int, float] = {}

    def plain_run(steps: int) -> float:
        nonlocal token
        start = clock()
        logits = answer([Feed(token, caches, "last")])[0][1]
        pending = mx.argmax(logits[-1]).astype(mx.int32).reshape(1)
        mx.async_eval(pending)
        for _ in range(steps):
            logits = answer([Feed(pending, caches, "last")])[0][1]
            ahead = mx.argmax(logits[-1]).astype(mx.int32).reshape(1)
            mx.async_eval(ahead)
            pending.item()  # the host reads token t while t + 1 computes
            pending = ahead
        pending.item()
        token = pending
        return (clock() - start) / (steps + 1)

    def verify_round(depth: int) -> float:
        nonlocal token
        block = mx.concatenate([token, mx.full((depth,), int(token.item()), mx.int32)])
        start = clock()
        tx = SpeculativeWrite(caches, depth + 1)
        try:
            logits = answer([Feed(block, caches, "all")])[0][1]
            chosen = mx.argmax(logits, axis=-1)
            chosen.tolist()
            tx.commit(1)
        except BaseException:
            tx.abort()
            raise
        token = chosen[:1].astype(mx.int32)
        return clock() - start

    # Sweeps over every depth, the least of each kept: a slow spell of the shared machine
    # then falls on all depths alike instead of on whichever was being timed.
    for sweep in range(WARMUP + REPEATS):
        for depth in range(max_depth + 1):
            seconds = plain_run(PLAIN_STEPS) if depth == 0 else verify_round(depth)
            if sweep >= WARMUP:
                costs[depth] = min(costs.get(depth, seconds), seconds)
    for cache in caches:
        cache.free()
    return costs


def profiled_costs(store: ProfileStore | None, name: str, fingerprint: Callable[[], str],
                   measure: Callable[[], dict[int, float]]) -> dict[int, float]:
    """The stored profile ``name`` when it is current, else measured now (and stored)."""
    if store is None:
        return measure()
    try:
        store.directory.mkdir(parents=True, exist_ok=True)  # the fingerprint memo lives there
    except OSError:
        pass
    key = profile_key(fingerprint())
    costs = store.load(name, key)
    if costs is None:
        costs = measure()
        store.save(name, key, costs)
    return costs
