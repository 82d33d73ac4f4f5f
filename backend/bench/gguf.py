"""``arbor bench gguf --model FILE.gguf``: a GGUF imported with its quantized tensors kept
against the float16 import Arbor used to make of it, in one run.

Two folders from the same file:

* **kept**: today's import (every affine llama.cpp type as MLX affine codes of the same values;
  ``weights/gguf.py``);
* **float16**: the earlier import's layout, rebuilt from the kept folder: Q4_0, Q4_1 and Q8_0
  tensors stay quantized (float32 scales), every other quantized tensor (the K-quants, Q5_0,
  Q5_1) is dequantized to float16, as the importer then did.

With ``against_mlx_lm``, mlx-lm 0.32.2 runs the float16 folder too (its loader quantizes with
``mx.quantize``, which refuses the groups of 16 that the kept folder's Q6_K / Q3_K / Q2_K
tensors need, so the kept folder is Arbor's alone).

Each row reports the folder's bytes on disk and decode / prefill tok/s (median over
``repeats`` rounds after a warm-up round; the rows take turns prompt by prompt, so load on
this shared machine falls on all alike), and whether its greedy tokens equal those of the
row it is compared with: the kept folder's for Arbor's float16 row (float16 rounds some
K-quant values: a near-tie may differ), Arbor's float16 row for mlx-lm (the same weights).
Plain greedy decoding, no drafting. Timings belong here, never in tests.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import mlx.core as mx

from backend.api import DoneEvent, GenerateRequest
from backend.engine import Engine
from backend.memory.budgets import CacheConfig
from backend.tokenizer import Tokenizer
from backend.weights.gguf import import_gguf
from backend.weights.gguf_layouts import hf_tensor_name
from backend.weights.loading import load_model
from backend.weights.quantize import quantization_block, read_quantization, spec_for

PROMPTS = (
    "The capital of France is",
    "Write a short story about a robot who learns to paint.",
    "List three facts about the moon:",
)

#: The types the earlier importer kept quantized (repacked to MLX affine groups of 32).
EARLIER_KEPT = frozenset({"Q4_0", "Q4_1", "Q8_0"})


KEPT, FLOAT16, MLX_LM = "K-quants kept", "float16 import", "float16 import, mlx-lm"


@dataclass
class Row:
    variant: str
    disk_bytes: int
    decode_tps: float
    prefill_tps: float
    same_tokens: bool | None  # None: the row the others are compared with


def _tensor_types(path: Path, arch: str) -> dict[str, str]:
    """Module path -> the GGUF type of its weight (names ``assemble`` merges are left out)."""
    types = {}
    for tensor in gguf.GGUFReader(path).tensors:
        try:
            name = hf_tensor_name(tensor.name, arch)
        except KeyError:
            continue
        types[name.removesuffix(".weight")] = tensor.tensor_type.name
    return types


def float16_import(kept: Path, path: Path, dest: Path) -> Path:
    """``kept``'s folder as the earlier importer wrote it (module docstring) at ``dest``."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(kept, dest)
    config = json.loads((kept / "config.json").read_text())
    arch = str(gguf.GGUFReader(path).get_field("general.architecture").contents())
    types = _tensor_types(path, arch)
    default, overrides = read_quantization(config)
    weights = mx.load(str(kept / "model.safetensors"))
    layers = {}
    for module in [k.removesuffix(".scales") for k in weights if k.endswith(".scales")]:
        spec = spec_for(module, default, overrides)
        scales, biases = (weights[f"{module}.{n}"].astype(mx.float32) for n in ("scales", "biases"))
        if types.get(module) in EARLIER_KEPT:
            weights[f"{module}.scales"], weights[f"{module}.biases"] = scales, biases
            layers[module] = spec
            continue
        weights[f"{module}.weight"] = mx.dequantize(
            weights[f"{module}.weight"], scales, biases, spec.group_size, spec.bits
        ).astype(mx.float16)
        del weights[f"{module}.scales"], weights[f"{module}.biases"]
        layers[module] = None
    config["quantization"] = quantization_block(layers)
    if not any(layers.values()):
        del config["quantization"]
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dest


def _disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


Runner = Callable[[list[int], int], tuple[list[int], float, float]]


def _arbor_runner(folder: Path) -> Runner:
    """``(ids, new_tokens) -> (tokens, decode tok/s, prefill tok/s)`` through Arbor's engine."""
    engine = Engine(load_model(folder), Tokenizer.from_folder(folder), folder.name,
                    cache=CacheConfig.memory_only())

    def generate(ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
        done = list(engine.generate(GenerateRequest(
            prompt_ids=ids, max_tokens=new_tokens, ignore_eos=True, draft="none")))[-1]
        assert isinstance(done, DoneEvent)
        return done.token_ids, done.decode_tps, done.prefill_tps
    return generate


def _mlx_lm_runner(folder: Path) -> Runner:
    """The same through mlx-lm's ``generate_step`` (greedy), timed as the engine times itself:
    prefill up to the first token, decode from the first token to the last."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model as mlx_lm_load

    model, _ = mlx_lm_load(folder)

    def generate(ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
        start = time.perf_counter()
        first = last = start
        tokens: list[int] = []
        for token, _ in generate_step(mx.array(ids), model, max_tokens=new_tokens):
            last = time.perf_counter()
            tokens.append(int(token))
            if len(tokens) == 1:
                first = last
        decode = (len(tokens) - 1) / max(last - first, 1e-9)
        return tokens, decode, len(ids) / max(first - start, 1e-9)
    return generate


def run(path: Path, work: Path, new_tokens: int = 128, repeats: int = 5,
        against_mlx_lm: bool = True,
        log: Callable[[str], None] = lambda message: None) -> list[Row]:
    """Import ``path`` both ways under ``work`` and time them (module docstring)."""
    work.mkdir(parents=True, exist_ok=True)
    log(f"importing {path.name}")
    kept = import_gguf(path, work / "gguf-kept")
    float16 = float16_import(kept, path, work / "gguf-float16")
    folders = {KEPT: kept, FLOAT16: float16}
    runners = {KEPT: _arbor_runner(kept), FLOAT16: _arbor_runner(float16)}
    compared_with = {FLOAT16: KEPT}
    if against_mlx_lm:
        folders[MLX_LM] = float16
        runners[MLX_LM] = _mlx_lm_runner(float16)
        compared_with[MLX_LM] = FLOAT16
    tokenizer = Tokenizer.from_folder(kept)
    decode: dict[str, list[float]] = {v: [] for v in runners}
    prefill: dict[str, list[float]] = {v: [] for v in runners}
    tokens: dict[str, list[list[int]]] = {v: [] for v in runners}
    for round_ in range(repeats + 1):  # round 0 warms up (compiles, first touches)
        log(f"round {round_} of {repeats}")
        for prompt in PROMPTS:
            # A different last id each round, so no round restores the last one's cache.
            ids = tokenizer.encode(prompt, add_special_tokens=True) + [round_]
            for variant, generate in runners.items():
                reply, decode_tps, prefill_tps = generate(ids, new_tokens)
                if round_:
                    decode[variant].append(decode_tps)
                    prefill[variant].append(prefill_tps)
                tokens[variant].append(reply)
    return [Row(v, _disk_bytes(folders[v]), statistics.median(decode[v]),
                statistics.median(prefill[v]),
                tokens[v] == tokens[compared_with[v]] if v in compared_with else None)
            for v in runners]


def format_table(rows: list[Row], file_bytes: int, new_tokens: int) -> str:
    lines = [f"GGUF file {file_bytes / 2**20:.1f} MiB; {new_tokens} new tokens, greedy, "
             "medians",
             "| import | on disk | decode | prefill | same greedy tokens |",
             "| --- | --- | --- | --- | --- |"]
    same = {None: "(reference)", True: "yes", False: "no"}
    for r in rows:
        lines.append(f"| {r.variant} | {r.disk_bytes / 2**20:.1f} MiB | {r.decode_tps:.1f} tok/s"
                     f" | {r.prefill_tps:.0f} tok/s | {same[r.same_tokens]} |")
    kept, f16 = rows[0], rows[1]
    lines.append(f"kept / float16: {kept.disk_bytes / f16.disk_bytes:.2f}x the bytes, "
                 f"{kept.decode_tps / f16.decode_tps:.2f}x the decode speed")
    for r in rows[2:]:
        lines.append(f"kept / {r.variant}: {kept.decode_tps / r.decode_tps:.2f}x the decode "
                     "speed")
    return "\n".join(lines)
