"""The Gemma 4 assistant (``gemma4_assistant``): a small drafter checkpoint made for one Gemma 4
target, with the target's vocabulary. It is no language model of its own: it has no keys or
values, and drafts only beside its target (``speculation/assistant.py``).

One draft step for the target's next position ``p`` (the target holds ids ``[0, p)``; ``c``,
the last id it chose, goes at ``p``):

* input: the target's scaled embedding of ``c`` beside a state of the target's width: first
  the target's final (normed) hidden state at ``p - 1``, then the previous step's projected
  output; ``pre_projection`` maps the pair to the assistant's width;
* a few Gemma 4 decoder layers whose attention computes queries only, RoPE'd at ``p - 1`` for
  every step: a layer of attention type t attends to the keys and values of the target's last
  layer computing its own of type t, exactly those the target's own query at ``p - 1`` sees
  (the caller hands them over; ``speculation/assistant.py``);
* final norm, then the logits (the tied embedding, or the centroid-routed head below) and
  ``post_projection`` back to the target's width for the next step.

``use_ordered_embeddings`` (the E2B / E4B assistants): the vocabulary is split into
``num_centroids`` clusters of equal size (``token_ordering`` lists each cluster's ids); the
``centroid_intermediate_top_k`` best-scoring clusters are scored densely and every other id
gets the least selected logit minus one.

Config: the top level names the target's width (``backbone_hidden_size``) and the head;
``text_config`` is a ``gemma4_text`` config whose every layer reads shared keys (no per-layer
inputs, no MoE block, no double-wide MLP). Its ``head_dim`` / ``global_head_dim`` and key-value
head counts are the target's (``check_target``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from backend.caches.base import NO_MASK, KVHistory
from backend.errors import ConfigError
from backend.models import gemma4
from backend.models.base import args_from_config, config_mapping
from backend.models.gemma3 import FULL
from backend.models.layers import RMSNorm

MODEL_TYPES = ("gemma4_assistant",)


@dataclass
class ModelArgs:
    model_type: str
    backbone_hidden_size: int
    text: gemma4.ModelArgs
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True

    # What the loader and the store read of every family's arguments.
    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def num_hidden_layers(self) -> int:
        return self.text.num_hidden_layers

    @property
    def rms_norm_eps(self) -> float:
        return self.text.rms_norm_eps

    @property
    def max_position_embeddings(self) -> int:
        return self.text.max_position_embeddings

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelArgs":
        text = dict(config_mapping(config, "text_config"))
        if not text:
            raise ConfigError("a gemma4_assistant config needs a text_config")
        for key, allowed in (("hidden_size_per_layer_input", 0), ("enable_moe_block", False),
                             ("use_double_wide_mlp", False)):
            if text.get(key) not in (None, allowed):
                raise ConfigError(f"text_config.{key} must be {allowed!r} in an assistant, got "
                                  f"{text[key]!r}")
        layers = text.get("num_hidden_layers")
        if text.get("num_kv_shared_layers") not in (None, 0, layers):
            raise ConfigError(f"every assistant layer reads shared keys: num_kv_shared_layers "
                              f"must be num_hidden_layers ({layers!r}), got "
                              f"{text['num_kv_shared_layers']!r}")
        text.pop("vocab_size_per_layer_input", None)  # 0 in an assistant: no per-layer inputs
        text.update(model_type="gemma4_text", hidden_size_per_layer_input=0,
                    enable_moe_block=False, use_double_wide_mlp=False, num_kv_shared_layers=0)
        top = {k: v for k, v in config.items() if k != "text_config"}
        top.setdefault("tie_word_embeddings", True)
        return args_from_config(cls, top, text=gemma4.ModelArgs.from_config(text))


def target_mismatch(args: ModelArgs, target_args: Any) -> str | None:
    """Why an assistant with ``args`` cannot draft for a target with ``target_args`` (any
    family's arguments), or None: it needs a Gemma 4 target of its width, vocabulary, window
    and head sizes, whose key-value heads its query heads group over."""
    text = args.text
    if not isinstance(target_args, gemma4.ModelArgs):
        return f"it drafts for Gemma 4 targets, not {target_args.model_type!r}"
    wants = {"hidden_size": args.backbone_hidden_size, "vocab_size": text.vocab_size,
             "sliding_window": text.sliding_window}
    if gemma4.SLIDING in text.layer_types:
        wants["head_dim"] = text.head_dim
    if FULL in text.layer_types:
        wants["global_head_dim"] = text.global_head_dim
    for key, value in wants.items():
        if getattr(target_args, key) != value:
            return f"its {key} is {value}, the target's {getattr(target_args, key)}"
    kv_heads = {target_args.num_key_value_heads}
    if target_args.attention_k_eq_v and target_args.num_global_key_value_heads:
        kv_heads.add(target_args.num_global_key_value_heads)
    if any(text.num_attention_heads % heads for heads in kv_heads):
        return (f"its {text.num_attention_heads} query heads do not group over the "
                f"target's key-value heads ({', '.join(map(str, sorted(kv_heads)))})")
    return None


class CentroidHead(nn.Module):
    """The centroid-routed vocabulary projection (module docstring)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        vocab = args.vocab_size
        if vocab % args.num_centroids:
            raise ConfigError(f"vocab_size {vocab} is not a multiple of num_centroids "
                              f"{args.num_centroids}")
        if not 0 < args.centroid_intermediate_top_k <= args.num_centroids:
            raise ConfigError(f"centroid_intermediate_top_k {args.centroid_intermediate_top_k} "
                              f"must be in 1..num_centroids {args.num_centroids}")
        self.centroids = nn.Linear(args.hidden_size, args.num_centroids, bias=False)
        self.token_ordering = mx.zeros((vocab,), dtype=mx.int32)
        self.top_k, self.clusters, self.vocab = (args.centroid_intermediate_top_k,
                                                 args.num_centroids, vocab)

    def __call__(self, h: mx.array, embedding: nn.Module) -> mx.array:
        """``h`` (1, hidden) -> logits (vocab,) over the top clusters' ids; ``embedding`` the
        (vocab, hidden) table the ids are scored with (its rows by calling it: on the CPU
        kernels a float32 table is held as panels)."""
        scores = self.centroids(h)[0]  # (clusters,)
        top = mx.argpartition(scores, kth=-self.top_k)[-self.top_k:]
        ordering = self.token_ordering.reshape(self.clusters, -1)
        ids = ordering[top].reshape(-1)  # (top_k * ids per cluster,)
        chosen = (embedding(ids) @ h[0][:, None])[:, 0].astype(mx.float32)
        floor = mx.min(chosen) - 1.0
        return mx.full((self.vocab,), floor, dtype=mx.float32).at[ids].add(chosen - floor)


class Model(nn.Module):
    """The assistant's modules under the checkpoint's names (module docstring)."""

    #: What pairs it with a target (``speculation/assistant.py``), not a model to chat with.
    drafts_for_target = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        text = args.text
        layers = []
        for kind in text.layer_types:
            # Every layer reads shared keys (kv_source set, no cache slot); the history it is
            # handed holds exactly the keys it may see, so it attends to all of them.
            layer = gemma4.DecoderLayer(text, kind, kv_source=0, cache_slot=None)
            layer.self_attn.mask = NO_MASK
            layers.append(layer)
        self.model = _Layers(text, layers)
        self.pre_projection = nn.Linear(2 * args.backbone_hidden_size, text.hidden_size,
                                        bias=False)
        self.post_projection = nn.Linear(text.hidden_size, args.backbone_hidden_size,
                                         bias=False)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        if args.use_ordered_embeddings:
            self.masked_embedding = CentroidHead(args)

    @property
    def layer_types(self) -> list[str]:
        return list(self.args.text.layer_types)

    def check_target(self, target_args: Any) -> str | None:
        """Why this assistant cannot draft for a target with ``target_args``, or None."""
        return target_mismatch(self.args, target_args)

    def step(self, embedded: mx.array, previous: mx.array,
             histories: dict[str, KVHistory]) -> tuple[mx.array, mx.array]:
        """One draft step: ``embedded`` (1, 1, target width), the target's scaled embedding of
        the newest id, ``previous`` (1, 1, target width) the state before it, ``histories`` the
        target's keys per attention type (query at the drafted position) -> (logits (vocab,),
        the next step's state (1, 1, target width))."""
        h = self.pre_projection(mx.concatenate([embedded, previous.astype(embedded.dtype)],
                                               axis=-1))
        for layer in self.model.layers:
            kind = gemma4.SLIDING if layer.is_sliding else FULL
            h, _ = layer(h, None, histories[kind], None)
        h = self.model.norm(h)
        return self.logits(h[:, -1])[0], self.post_projection(h)

    def logits(self, h: mx.array) -> mx.array:
        """(1, hidden) -> (1, vocab)."""
        if self.args.use_ordered_embeddings:
            return self.masked_embedding(h, self.model.embed_tokens)[None]
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_caches(self) -> list:
        return []  # it reads its target's keys and values

    def parameter_name(self, checkpoint_name: str) -> str | None:
        return checkpoint_name

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """A tied checkpoint's ``lm_head`` dropped (it repeats the embedding); the cluster
        ordering as int32 (stored as int64)."""
        out = {}
        for name, value in weights.items():
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            if name == "masked_embedding.token_ordering":
                value = value.astype(mx.int32)
            out[name] = value
        return out


class _Layers(nn.Module):
    """``model.*``: the embedding (scores the vocabulary), the layers, the final norm."""

    def __init__(self, text: gemma4.ModelArgs, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = layers
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)
