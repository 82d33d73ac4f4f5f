"""``arbor bench spec``'s Gemma 4 assistant rows: what one draft step and one verify block cost
against a plain step, and the acceptance drafting needs to pay, on this machine.

The pair is random, with the published head sizes: an E2B-shaped target (``bench/gemma4.py``:
sliding heads of 256, global heads of 512, windows of 512, KV-shared layers, per-layer inputs)
and an assistant of four layers (three sliding, one global) of width 256 reading its keys,
with a centroid-routed head (clusters of 128 ids, the top 32 scored, as the E2B / E4B
assistants). Widths and depths are smaller than the published models' where the machine needs
it (the caller's choice); the costs are of the real kernels at the real head sizes.

Measured after a ``context``-token prefill, median of ``repeats`` runs each:

* plain step: the target's one-token forward and its logits;
* draft step: one assistant step (the target's embedding of the token, its keys as they stand);
* verify block of k + 1 rows (k drafts): the target's forward and logits of every row, its
  caches rewound after each run.

Break-even acceptance for k drafts: the per-draft acceptance ``a`` (independent per position)
at which a round, ``k`` draft steps and one verify block, commits as many tokens per second as
plain steps: ``(1 - a^(k+1)) / (1 - a) * plain = k * draft + verify(k)``.

The random pair also replies through the engine: speculative tokens must equal plain ones.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from backend.bench import gemma4 as bench_gemma4
from backend.bench.drafters import break_even_acceptance

#: The assistant's shape: the E2B / E4B assistants' width and depth, a centroid head.
ASSISTANT_WIDTH, ASSISTANT_LAYERS, CLUSTER_IDS, TOP_CLUSTERS = 256, 4, 128, 32


@dataclass
class Costs:
    context: int
    plain_s: float
    draft_s: float
    verify_s: dict[int, float]  # drafts k -> seconds of a (k + 1)-row verify block

    def break_even(self, drafts: int) -> float | None:
        """Per-draft acceptance at which ``drafts`` per round pay exactly (None: never, even
        when every draft is accepted)."""
        cost = drafts * self.draft_s + self.verify_s[drafts]
        return break_even_acceptance(drafts, cost / self.plain_s)


def assistant_config(target: dict) -> dict:
    """The assistant's ``config.json`` for the target ``config.json`` (module docstring)."""
    text = target["text_config"]
    vocab = text["vocab_size"]
    layer_types = ["sliding_attention"] * (ASSISTANT_LAYERS - 1) + ["full_attention"]
    heads = max(text["num_key_value_heads"], ASSISTANT_WIDTH // 64)
    return {
        "model_type": "gemma4_assistant", "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": text["hidden_size"], "tie_word_embeddings": True,
        "use_ordered_embeddings": vocab % CLUSTER_IDS == 0 and vocab // CLUSTER_IDS >= TOP_CLUSTERS,
        "num_centroids": max(1, vocab // CLUSTER_IDS), "centroid_intermediate_top_k": TOP_CLUSTERS,
        "text_config": {
            "model_type": "gemma4_text", "hidden_size": ASSISTANT_WIDTH,
            "intermediate_size": 4 * ASSISTANT_WIDTH, "num_hidden_layers": ASSISTANT_LAYERS,
            "layer_types": layer_types, "num_attention_heads": heads,
            "num_key_value_heads": text["num_key_value_heads"],
            "head_dim": text["head_dim"], "global_head_dim": text["global_head_dim"],
            "sliding_window": text["sliding_window"], "num_kv_shared_layers": ASSISTANT_LAYERS,
            "hidden_size_per_layer_input": 0, "use_double_wide_mlp": False,
            "enable_moe_block": False, "attention_k_eq_v": False,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
            "vocab_size": vocab, "max_position_embeddings": 131072,
            "rope_parameters": text["rope_parameters"]},
    }


def write_assistant(folder: Path, config: dict, seed: int = 1) -> Path:
    """Random float32 weights for the assistant ``config`` (matrices scaled by
    ``inputs ** -0.5``, norms near 1, a random cluster ordering)."""
    from backend.models import gemma4_assistant

    rng = np.random.default_rng(seed)
    model = gemma4_assistant.Model(gemma4_assistant.ModelArgs.from_config(config))
    tensors = {}
    for name, param in tree_flatten(model.parameters()):
        shape = tuple(param.shape)
        if name.endswith("token_ordering"):
            value = rng.permutation(shape[0]).astype(np.int32)
        elif len(shape) == 1:
            value = (1 + rng.normal(0.0, 0.05, shape)).astype(np.float32)
        elif name == "model.embed_tokens.weight":
            value = rng.normal(0.0, 1.0, shape).astype(np.float32)
        else:
            value = rng.normal(0.0, shape[-1] ** -0.5, shape).astype(np.float32)
        tensors[name] = mx.array(value)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def _median_seconds(repeats: int, run: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure(target_folder: Path, assistant_folder: Path, context: int = 512,
            max_drafts: int = 8, repeats: int = 7) -> Costs:
    """The module docstring's costs, on weights loaded as the engine loads them."""
    from backend.speculation.assistant import AssistantDrafter
    from backend.weights.loading import load_model

    target = load_model(target_folder).model
    assistant = load_model(assistant_folder).model
    vocab = target.args.vocab_size
    rng = np.random.default_rng(0)
    ids = mx.array(rng.integers(3, vocab, context + max_drafts + 1), dtype=mx.int32)
    caches = target.make_caches()
    drafter = AssistantDrafter(target, assistant, caches)
    prefix = ids[:context]
    drafter.observe(0, prefix, target.hidden(prefix[None], caches))
    mx.eval([c.arrays() for c in caches])

    def rewound(rows: int) -> Callable[[], object]:
        def run():
            out = target.logits(target.hidden(ids[context:context + rows][None], caches))
            mx.eval(out)
            for cache in caches:
                cache.restore(None, context)
            return out
        return run

    position = context  # the drafted token goes here; the target holds [0, context)
    histories = {kind: drafter._visible(cache, position - 1)
                 for kind, cache in drafter.sources.items()}
    previous = drafter._hidden_at(position - 1)
    embedded = target.model.embed(ids[context:context + 1][None])
    mx.eval(histories, previous, embedded)
    return Costs(
        context=context,
        plain_s=_median_seconds(repeats, rewound(1)),
        draft_s=_median_seconds(repeats, lambda: assistant.step(embedded, previous, histories)),
        verify_s={k: _median_seconds(repeats, rewound(k + 1)) for k in range(1, max_drafts + 1)},
    )


def same_tokens(target_folder: Path, assistant_folder: Path, tokenizer_folder: Path,
                new_tokens: int = 48) -> tuple[bool, int, int]:
    """The random pair's greedy reply through the engine, speculative against plain: (equal,
    drafted, accepted). The tokenizer only detokenizes (``tokenizer_folder``'s, ids below the
    random vocabulary)."""
    from backend.api import DoneEvent, GenerateRequest, collect_reply
    from backend.engine import Engine
    from backend.memory.budgets import CacheConfig
    from backend.tokenizer import Tokenizer
    from backend.weights.loading import load_model

    tokenizer = Tokenizer.from_folder(tokenizer_folder)
    target = load_model(target_folder)
    vocab = min(target.model.args.vocab_size, tokenizer.vocab_size)
    prompt = [int(x) for x in np.random.default_rng(1).integers(3, vocab, 24)]

    def reply(engine: Engine) -> tuple[list[int], DoneEvent]:
        return collect_reply(engine.generate(GenerateRequest(
            prompt_ids=prompt, max_tokens=new_tokens, ignore_eos=True)))

    memory = CacheConfig.memory_only()
    plain, _ = reply(Engine(target, tokenizer, "target", memory, speculation="none"))
    spec = Engine(target, tokenizer, "target", memory, draft=load_model(assistant_folder),
                  draft_depth=3)
    ids, done = reply(spec)
    return ids == plain, done.drafted_tokens, done.accepted_tokens


def run(work: Path, tokenizer_folder: Path, hidden_size: int = 1536, layers: int = 10,
        context: int = 512, log: Callable[[str], None] = print) -> tuple[Costs, tuple]:
    config = bench_gemma4.model_config(hidden_size, layers)
    target = work / f"gemma4-e2b-shaped-{hidden_size}x{layers}"
    if not (target / "config.json").exists():
        log(f"writing {target.name}")
        bench_gemma4.write_random_checkpoint(target, config)
    assistant = work / f"{target.name}-assistant"
    if not (assistant / "config.json").exists():
        write_assistant(assistant, assistant_config(config))
    log("measuring the assistant's draft step and verify blocks")
    costs = measure(target, assistant, context)
    log("replying with the random pair, plain and speculative")
    return costs, same_tokens(target, assistant, tokenizer_folder)


def format_rows(costs: Costs, same: tuple[bool, int, int]) -> str:
    equal, drafted, accepted = same
    lines = [f"Gemma 4 assistant (random E2B-shaped pair, context {costs.context}): plain step "
             f"{costs.plain_s * 1e3:.2f} ms, draft step {costs.draft_s * 1e3:.2f} ms "
             f"({costs.draft_s / costs.plain_s:.2f}x plain)",
             f"{'drafts':>6} {'verify ms':>9} {'x plain':>7} {'round ms':>8} {'break-even':>10}"]
    for k, verify in costs.verify_s.items():
        even = costs.break_even(k)
        lines.append(f"{k:6d} {verify * 1e3:9.2f} {verify / costs.plain_s:7.2f} "
                     f"{(k * costs.draft_s + verify) * 1e3:8.2f} "
                     f"{'never' if even is None else f'{100 * even:.0f}%':>10}")
    lines.append(f"same tokens as plain: {'yes' if equal else 'NO'} ({accepted} of {drafted} "
                 "drafts accepted: a random assistant)")
    return "\n".join(lines)
