"""``arbor bench spec``, the checkpoint drafters' rows: what one round of the Qwen3.5 MTP head and
of a DFlash block drafter costs against a plain step, and the acceptance each needs to pay.

On a random Qwen3.5-shaped checkpoint with the published head sizes (``bench/hybrid.py``'s
config: gated-delta heads of 128, attention heads of 256; its width and depth are parameters)
carrying a one-layer MTP head, and a random DFlash drafter for it (five layers of heads of 128
reading five target layers, blocks of 16, as the published Qwen3.5 drafters), after a prompt:

* plain: one target step (a token in, its logits out), the baseline;
* draft(k): the drafter proposing k tokens (MTP: k head steps, each scoring the vocabulary;
  DFlash: one block forward of k + 1 positions, k rows scored);
* verify(k): the target's forward over the k + 1 rows of a round, logits of each, and the
  rollback of a fully rejected round (snapshots scheduled, every cache restored);
* break-even: the per-draft acceptance a at which a round's expected tokens
  (1 - a^(k+1)) / (1 - a) take as long as plain steps would: (draft + verify) / plain. Above it
  drafting k pays on this machine; "never" when even a = 1 does not.

Then both drafters reply through the engine and must give plain decoding's tokens (random
drafters are rejected nearly always: this checks the path, not the speed-up).
Timings belong here, never in tests.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from backend.api import GenerateRequest, SamplingParams, TokenEvent
from backend.engine import Engine
from backend.memory.budgets import CacheConfig
from backend.models.dflash import Model as DFlashModel
from backend.models.dflash import ModelArgs as DFlashArgs
from backend.sampling import Sampler
from backend.speculation.dflash import DFlashDrafter
from backend.speculation.mtp import MTPDrafter
from backend.speculation.rollback import SpeculativeWrite
from backend.weights.loading import load_model

KINDS = ("mtp", "dflash")
DRAFTS = (1, 2, 4, 8, 15)
DFLASH_LAYERS = 5
#: Files that carry a tokenizer, copied from the benchmarked model so the engine can run.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")


@dataclass
class CostRow:
    drafter: str
    drafts: int
    plain_ms: float
    draft_ms: float
    verify_ms: float

    @property
    def break_even(self) -> float | None:
        """The per-draft acceptance at which a round pays as plain steps do (None: never)."""
        return break_even_acceptance(self.drafts,
                                     (self.draft_ms + self.verify_ms) / self.plain_ms)


def break_even_acceptance(drafts: int, round_in_plain_steps: float) -> float | None:
    """The per-draft acceptance ``a`` at which a round of ``drafts`` drafts, costing
    ``round_in_plain_steps`` plain steps, commits as many tokens per second as plain decoding:
    ``1 + a + ... + a^drafts = round_in_plain_steps`` (None: not even when every draft is
    accepted)."""
    def expected(a: float) -> float:
        return sum(a ** j for j in range(drafts + 1))

    if expected(1.0) <= round_in_plain_steps:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid) < round_in_plain_steps else (lo, mid)
    return hi


def write_pair(source: Path, work: Path, hidden_size: int = 1024, layers: int = 8,
               seed: int = 0) -> tuple[Path, Path]:
    """A random Qwen3.5-shaped target with an MTP head (``source``'s vocabulary and tokenizer)
    and a random DFlash drafter for it; returns their folders."""
    import json

    from backend.bench import hybrid
    from backend.tokenizer import Tokenizer

    vocab = Tokenizer.from_folder(source).vocab_size
    config = hybrid.model_config(hidden_size, layers, vocab, family="qwen3_5")
    config["text_config"]["mtp_num_hidden_layers"] = 1
    target = hybrid.write_random_checkpoint(work / f"qwen3_5-{hidden_size}x{layers}", config,
                                            seed)
    path = target / "model.safetensors"
    tensors = dict(mx.load(str(path)))
    rng = np.random.default_rng(seed + 1)
    text = config["text_config"]
    full = text["layer_types"].index("full_attention")
    layer = f"model.language_model.layers.{full}."
    head = {f"mtp.layers.0.{k[len(layer):]}": v for k, v in tensors.items()
            if k.startswith(layer)}
    head["mtp.fc.weight"] = mx.array(rng.normal(0, (2 * hidden_size) ** -0.5,
                                                (hidden_size, 2 * hidden_size)).astype(np.float32))
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        head[f"mtp.{norm}.weight"] = mx.zeros((hidden_size,))
    mx.save_safetensors(str(path), {**tensors, **head}, metadata={"format": "pt"})
    for name in _TOKENIZER_FILES:
        if (Path(source) / name).exists():
            shutil.copyfile(Path(source) / name, target / name)

    heads = max(1, hidden_size // 128)
    step = (layers - 2) / (DFLASH_LAYERS - 1)
    read = sorted({1 + round(i * step) for i in range(DFLASH_LAYERS)})
    drafter = work / f"dflash-{hidden_size}x{layers}"
    drafter.mkdir(parents=True, exist_ok=True)
    dconfig = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
               "hidden_size": hidden_size, "intermediate_size": 19 * hidden_size // 5,
               "num_hidden_layers": DFLASH_LAYERS, "num_attention_heads": heads,
               "num_key_value_heads": max(1, heads // 4), "head_dim": 128,
               "rms_norm_eps": 1e-6, "vocab_size": vocab, "rope_theta": 10000000.0,
               "block_size": 16, "num_target_layers": layers,
               "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": read}}
    (drafter / "config.json").write_text(json.dumps(dconfig, indent=1))
    mx.random.seed(seed)
    model = DFlashModel(DFlashArgs.from_config(dconfig))
    mx.save_safetensors(str(drafter / "model.safetensors"),
                        dict(tree_flatten(model.parameters())), metadata={"format": "pt"})
    return target, drafter


def _best_ms(repeats: int, once: Callable[[], None]) -> float:
    once()  # warm-up: first-call allocations and graph building are not a round's cost
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def round_costs(target: Path, dflash: Path, drafts: tuple[int, ...] = DRAFTS,
                prompt_tokens: int = 256, repeats: int = 5,
                log: Callable[[str], None] = print) -> list[CostRow]:
    loaded = load_model(target)
    model, draft = loaded.model, load_model(dflash).model
    vocab = model.args.vocab_size
    prompt = np.random.default_rng(0).integers(3, vocab - 1, prompt_tokens).tolist()
    greedy = Sampler(SamplingParams())
    rows = []
    for kind in KINDS:
        model.model.capture(draft.args.target_layer_ids if kind == "dflash" else [])
        drafter = MTPDrafter(model) if kind == "mtp" else DFlashDrafter(model, draft)
        caches = model.make_caches()
        hidden = model.hidden(mx.array([prompt]), caches)
        drafter.observe(0, mx.array(prompt), model.model.captured if kind == "dflash" else hidden)
        drafter.feed(prompt)
        mx.eval(hidden, [c.arrays() for c in caches])
        plain_caches = model.make_caches()
        mx.eval(model.hidden(mx.array([prompt]), plain_caches))
        token = mx.array([[prompt[-1]]])

        def plain_step() -> None:
            mx.eval(model.logits(model.hidden(token, plain_caches)))

        plain = _best_ms(repeats, plain_step)
        for k in drafts:
            log(f"{kind}: {k} drafts")

            def propose() -> None:
                out = drafter.propose(prompt + [prompt[-1]], k, greedy, lambda d: None)
                mx.eval(out.tokens, out.logprobs)
                drafter.settle(prompt)

            def verify() -> None:
                tx = SpeculativeWrite(caches, k + 1)
                logits = model.logits(model.hidden(mx.array([prompt[-k - 1:]]), caches))
                mx.eval(logits, [c.arrays() for c in caches])
                tx.commit(0)

            rows.append(CostRow(kind, k, plain, _best_ms(repeats, propose),
                                _best_ms(repeats, verify)))
        drafter.close()
    model.model.capture([])
    return rows


def same_tokens_as_plain(target: Path, dflash: Path, new_tokens: int = 32,
                         depth: int = 4) -> dict[str, bool]:
    """Whether each drafter's greedy reply equals plain decoding's, through the engine."""
    def reply(engine: Engine) -> list[int]:
        request = GenerateRequest(messages=[{"role": "user", "content": "Tell me a story."}],
                                  max_tokens=new_tokens, ignore_eos=True)
        ids = [e.token_id for e in engine.generate(request)
               if isinstance(e, TokenEvent) and e.token_id >= 0]
        return ids

    memory = CacheConfig.memory_only()
    plain = reply(Engine.load(str(target), cache=memory, speculation="none"))
    mtp = Engine.load(str(target), cache=memory, draft_depth=depth)
    block = Engine.load(str(target), cache=memory, draft=str(dflash), draft_depth=depth)
    if (mtp.speculation, block.speculation) != ("mtp", "dflash"):
        raise RuntimeError(f"the engines draft with {mtp.speculation} and "
                           f"{block.speculation}, not the MTP head and the DFlash drafter")
    return {"mtp": reply(mtp) == plain, "dflash": reply(block) == plain}


def run(source: Path, work: Path, hidden_size: int = 1024, layers: int = 8,
        drafts: tuple[int, ...] = DRAFTS, log: Callable[[str], None] = print
        ) -> tuple[list[CostRow], dict[str, bool]]:
    target, dflash = write_pair(source, work, hidden_size, layers)
    return round_costs(target, dflash, drafts, log=log), same_tokens_as_plain(target, dflash)


def format_table(rows: list[CostRow], same: dict[str, bool], hidden_size: int,
                 layers: int) -> str:
    lines = [f"checkpoint drafters on a random Qwen3.5-shaped model (hidden {hidden_size}, "
             f"{layers} layers, published head sizes): one round against a plain step, ms "
             "(best of runs)",
             f"{'drafter':8} {'drafts':>6} {'plain':>8} {'draft':>8} {'verify':>8} "
             f"{'round/plain':>11} {'break-even acceptance':>22}"]
    for r in rows:
        even = "never" if r.break_even is None else f"{r.break_even:.2f}"
        lines.append(f"{r.drafter:8} {r.drafts:6d} {r.plain_ms:8.2f} {r.draft_ms:8.2f} "
                     f"{r.verify_ms:8.2f} {(r.draft_ms + r.verify_ms) / r.plain_ms:11.2f} "
                     f"{even:>22}")
    lines.append("same tokens as plain decoding: " + ", ".join(
        f"{kind} {'yes' if ok else 'NO'}" for kind, ok in same.items()))
    return "\n".join(lines)
