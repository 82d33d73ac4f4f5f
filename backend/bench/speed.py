"""``arbor bench``: our engine and mlx-lm on the same weights, in one run, with ratios.

For each weight format (float32, bfloat16, 4-bit with bf16 scales as mlx-community ships it) the
benchmark writes one model folder from the chosen model, then times prefill of a fixed random
prompt and greedy decode of a fixed number of tokens with

* Arbor's ``Engine.generate`` (the same path the app uses), and
* mlx-lm's ``generate_step`` on the very same folder,

measuring both the same way: prefill tok/s = prompt tokens / time to first token (the best of
up to three runs while they fit a time budget); decode tok/s = (tokens - 1) / time from first to
last token. It also measures this machine's memory read
bandwidth and prints the decode ceiling (bandwidth / bytes of weights read per token) and the
fraction of it each engine reaches. Timing belongs here, never in tests.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from backend import blas, kernels
from backend.api import GenerateRequest
from backend.engine import EXACT_PREFILL_CHUNK, PREFILL_CHUNK, Engine
from backend.errors import MissingDependencyError
from backend.memory.budgets import CacheConfig
from backend.tokenizer import Tokenizer
from backend.weights.loading import load_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json", "special_tokens_map.json")
FORMATS = ("float32", "bfloat16", "4bit")


@dataclass
class Row:
    fmt: str
    engine: str
    prefill_tps: float
    decode_tps: float
    weight_bytes: int


def require_mlx_lm() -> None:
    """Raise ``MissingDependencyError`` when mlx-lm, the reference the benchmarks compare
    against, is not installed (the app's own set-up does not install it)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("mlx_lm") is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        found = False
    if not found:
        raise MissingDependencyError(
            "mlx-lm is not installed: pip install 'arbor-chat[bench]' (or pip install "
            "mlx-lm==0.32.2), or run with --against none for Arbor's rows alone")


def memory_bandwidth_gbs(megabytes: int = 512, threads: int = 2) -> float:
    """Read bandwidth with ``threads`` readers summing disjoint halves of a large array."""
    data = np.ones(megabytes * (1 << 20) // 4, dtype=np.float32)
    parts = np.array_split(data, threads)
    best = 0.0
    for _ in range(3):
        workers = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, data.nbytes / (time.perf_counter() - start) / 1e9)
    return best


def write_variant(source: Path, dest: Path, fmt: str) -> Path:
    """Write ``source`` as a plain HF folder in ``fmt`` (reused if already there)."""
    if (dest / "config.json").is_file():
        return dest
    # Plain MLX layers: the kernels keep quantized weights quantized, we want them dense here.
    loaded = load_model(source, dtype="float32", cpu_kernels=False)
    config = {k: v for k, v in loaded.config.items()
              if k not in ("quantization", "quantization_config")}
    weights = dict(tree_flatten(loaded.model.parameters()))
    if fmt == "bfloat16":
        weights = {k: v.astype(mx.bfloat16) for k, v in weights.items()}
        config["torch_dtype"] = "bfloat16"
    elif fmt == "4bit":
        # The mlx-community layout: group size 64, bf16 scales and biases.
        group, bits = 64, 4
        out = {}
        for name, w in weights.items():
            if name.endswith(".weight") and w.ndim == 2 and w.shape[-1] % group == 0:
                prefix = name[: -len(".weight")]
                q, scales, biases = mx.quantize(w, group_size=group, bits=bits)
                out[name], out[prefix + ".scales"] = q, scales.astype(mx.bfloat16)
                out[prefix + ".biases"] = biases.astype(mx.bfloat16)
            else:
                out[name] = w.astype(mx.bfloat16)
        weights = out
        config["quantization"] = {"group_size": group, "bits": bits}
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, tmp / name)
    tmp.rename(dest)
    return dest


def prompt_ids(vocab: int, n: int) -> list[int]:
    rng = np.random.default_rng(0)
    return [int(t) for t in rng.integers(100, min(vocab, 20000), size=n)]


#: Prefill is timed again (best run kept) while the repeats stay within this many seconds: a
#: single run of a fast engine is noisy on a shared machine, a slow one is timed once.
PREFILL_REPEAT_BUDGET_S = 20.0
PREFILL_MAX_RUNS = 3


def best_prefill(run_once) -> float:
    """Best prefill tok/s of up to PREFILL_MAX_RUNS calls of ``run_once() -> tok/s``."""
    best, spent = 0.0, 0.0
    for runs in range(1, PREFILL_MAX_RUNS + 1):
        start = time.perf_counter()
        best = max(best, run_once())
        spent += time.perf_counter() - start
        if spent + spent / runs > PREFILL_REPEAT_BUDGET_S:  # one more run would not fit
            break
    return best


def time_arbor(folder: Path, prompt: list[int], new_tokens: int) -> tuple[float, float, int]:
    engine = Engine(load_model(folder), Tokenizer.from_folder(folder), folder.name,
                    cache=CacheConfig.memory_only())

    def generate(ids: list[int], tokens: int):
        engine.clear_cache()  # no prefix reuse between runs
        return list(engine.generate(GenerateRequest(prompt_ids=ids, max_tokens=tokens,
                                                    ignore_eos=True)))[-1]

    generate(prompt[:16], 4)  # warm-up: compile, page weights
    done = generate(prompt, new_tokens)
    prefill = max(done.prefill_tps, best_prefill(lambda: generate(prompt, 1).prefill_tps))
    return prefill, done.decode_tps, engine.loaded.parameter_bytes


def time_mlx_lm(folder: Path, prompt: list[int], new_tokens: int) -> tuple[float, float, int]:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model as mlx_lm_load

    model, _ = mlx_lm_load(folder)
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))

    def generate(ids: list[int], tokens: int) -> tuple[float, float]:
        start = time.perf_counter()
        first = last = start
        count = 0
        for count, _ in enumerate(generate_step(mx.array(ids), model, max_tokens=tokens), 1):
            last = time.perf_counter()
            if count == 1:
                first = last
        return len(ids) / (first - start), (count - 1) / max(last - first, 1e-9)

    generate(prompt[:16], 4)  # warm-up
    prefill, decode = generate(prompt, new_tokens)
    prefill = max(prefill, best_prefill(lambda: generate(prompt, 1)[0]))
    return prefill, decode, weight_bytes


def run(source: Path, work_dir: Path, formats: tuple[str, ...] = FORMATS, prompt_tokens: int = 512,
        new_tokens: int = 128, against_mlx_lm: bool = True, log=print) -> list[Row]:
    vocab = int(json.loads((source / "config.json").read_text())["vocab_size"])
    prompt = prompt_ids(vocab, prompt_tokens)
    rows = []
    for fmt in formats:
        folder = write_variant(source, work_dir / f"{source.name}-{fmt}", fmt)
        log(f"[{fmt}] arbor ...")
        rows.append(Row(fmt, "arbor", *time_arbor(folder, prompt, new_tokens)))
        if against_mlx_lm:
            log(f"[{fmt}] mlx-lm ...")
            rows.append(Row(fmt, "mlx-lm", *time_mlx_lm(folder, prompt, new_tokens)))
    return rows


#: Prompt lengths ``exact_prefill_costs`` times: a new chat message, a long one, a document.
EXACT_COST_LENGTHS = (64, 256, 1024, 4096)


def exact_prefill_costs(folder: Path, lengths: tuple[int, ...] = EXACT_COST_LENGTHS,
                        repeats: int = 3) -> list[tuple[int, float, float]]:
    """(prompt tokens, prefill tok/s in ``PREFILL_CHUNK``s, in exact chunks) per length: what
    exact prefill costs by prompt length (BLAS is at its best on a few hundred rows, the
    kernels' 64-row chunks are not). The engines take turns; each keeps its best."""
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    engines = [Engine(load_model(folder), Tokenizer.from_folder(folder), folder.name,
                      cache=CacheConfig.memory_only(), prefill_chunk=chunk)
               for chunk in (PREFILL_CHUNK, EXACT_PREFILL_CHUNK)]
    out = []
    for n in lengths:
        ids = prompt_ids(vocab, n)
        best = [0.0, 0.0]
        for _ in range(repeats):
            for i, engine in enumerate(engines):
                engine.clear_cache()
                done = list(engine.generate(GenerateRequest(prompt_ids=ids, max_tokens=1,
                                                            ignore_eos=True)))[-1]
                best[i] = max(best[i], done.prefill_tps)
        out.append((n, best[0], best[1]))
    return out


def format_exact_costs(costs: list[tuple[int, float, float]]) -> str:
    lines = [f"exact prefill ({EXACT_PREFILL_CHUNK}-token chunks, cached == cold) by prompt "
             "length, against plain prefill:"]
    for n, plain, exact in costs:
        lines.append(f"  {n:5} tokens: {plain:6.0f} vs {exact:6.0f} tok/s, costs prefill "
                     f"{100 * (plain / exact - 1):3.0f}%")
    return "\n".join(lines)


def format_table(rows: list[Row], bandwidth_gbs: float) -> str:
    native = kernels.isa() or f"off ({kernels.unavailable_reason()})"
    lines = [f"BLAS: {blas.active_blas}   native CPU kernels: {native}   "
             f"device: {mx.default_device()}   memory read bandwidth: {bandwidth_gbs:.1f} GB/s",
             f"{'weights':9} {'engine':8} {'prefill tok/s':>13} {'decode tok/s':>12} "
             f"{'weights read':>12} {'ceiling':>8} {'of ceiling':>10}"]
    by_fmt: dict[str, dict[str, Row]] = {}
    for r in rows:
        ceiling = bandwidth_gbs * 1e9 / r.weight_bytes
        lines.append(f"{r.fmt:9} {r.engine:8} {r.prefill_tps:13.1f} {r.decode_tps:12.1f} "
                     f"{r.weight_bytes / 1e6:10.0f}MB {ceiling:8.1f} "
                     f"{100 * r.decode_tps / ceiling:9.0f}%")
        by_fmt.setdefault(r.fmt, {})[r.engine] = r
    for fmt, pair in by_fmt.items():
        if "arbor" in pair and "mlx-lm" in pair:
            a, m = pair["arbor"], pair["mlx-lm"]
            lines.append(f"{fmt:9} ratio arbor/mlx-lm: prefill {a.prefill_tps / m.prefill_tps:.2f}x"
                         f"  decode {a.decode_tps / m.decode_tps:.2f}x")
    return "\n".join(lines)
