"""The decoder skeleton every architecture shares: embedding, a stack of layers (one cache
each), final norm, and the vocabulary projection kept apart from the hidden states.

Families supply their layers and their cache kinds; parameter names follow the Hugging Face
layout (``model.embed_tokens``, ``model.layers.N``, ``model.norm``, ``lm_head``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from backend.caches.base import Cache
from backend.models.layers import RMSNorm


#: A multimodal checkpoint's language-model prefixes -> the decoder's own (first match wins):
#: Hugging Face ``model.language_model.*``, mlx-community ``language_model.model.*`` and
#: ``language_model.lm_head``.
MULTIMODAL_TEXT_PREFIXES = (("model.language_model.", "model."),
                            ("language_model.model.", "model."), ("language_model.", ""))


def multimodal_text_name(checkpoint_name: str, other_modalities: tuple[str, ...]) -> str | None:
    """The decoder's name for a multimodal checkpoint's tensor or module name: the language
    model's renamed (``MULTIMODAL_TEXT_PREFIXES``), None for another modality's (names that
    start with one of ``other_modalities``, after an optional ``model.``); others unchanged."""
    if checkpoint_name.removeprefix("model.").startswith(other_modalities):
        return None
    for prefix, own in MULTIMODAL_TEXT_PREFIXES:
        if checkpoint_name.startswith(prefix):
            return own + checkpoint_name[len(prefix):]
    return checkpoint_name


class PreNormDecoderLayer(nn.Module):
    """The Llama-style residual block: ``h = x + self_attn(input_layernorm(x))``, then
    ``h + mlp(post_attention_layernorm(h))``. Subclasses build those four modules.
    ``use_cpu_kernels`` may give it a ``fused`` forward for a few rows (models/fused_layer.py)."""

    fused = None  # a FusedLayer, when the layer's parts allow one

    def __call__(self, x: mx.array, cache: Cache) -> mx.array:
        if self.fused is not None:
            out = self.fused(x, cache)
            if out is not None:
                return out
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """tokens -> embedding (optionally scaled) -> layers -> final RMSNorm.

    ``capture(layers)``: every forward then also keeps the outputs of those layers (the
    residual stream after each), concatenated in layer order, as ``captured`` (B, N, k * hidden):
    what a block drafter reads (``models/dflash.py``)."""

    def __init__(self, args: Any, layers: list[nn.Module], norm_offset: float = 0.0,
                 embed_scale: float | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = layers
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, offset=norm_offset)
        self.embed_scale = embed_scale
        # Underscored: not parameters.
        self._capture: frozenset[int] = frozenset()
        self._captured: mx.array | None = None

    def capture(self, layers: list[int]) -> None:
        self._capture = frozenset(layers)

    @property
    def captured(self) -> mx.array | None:
        """The captured layers' outputs of the latest forward (None without ``capture``)."""
        return self._captured

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.embed_tokens(tokens)  # (B, N, hidden)
        if self.embed_scale is not None:
            h = h * mx.array(self.embed_scale, mx.float32).astype(h.dtype)
        return h

    def keep_captured(self, outputs: list[mx.array]) -> None:
        """Keep ``outputs`` (the captured layers' outputs of this forward, in layer order) as
        ``captured``; a subclass's own forward calls it as this one does."""
        if outputs:
            self._captured = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs,
                                                                                 axis=-1)

    def __call__(self, tokens: mx.array, caches: list[Cache]) -> mx.array:
        h = self.embed(tokens)
        kept = []
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            h = layer(h, cache)
            if i in self._capture:
                kept.append(h)
        self.keep_captured(kept)
        return self.norm(h)


class DecoderModel(nn.Module):
    """A backbone plus the vocabulary projection: the embedding's transpose (tied) or an own
    ``lm_head``.

    ``tie_word_embeddings`` chooses the projection, unless the checkpoint ships an
    ``lm_head.weight`` anyway: then that head is used, as transformers and mlx-lm's Gemma 3 do
    (``sanitize`` settles it). Subclasses implement ``make_caches`` and may extend
    ``sanitize`` / ``logits``.
    """

    def __init__(self, args: Any, backbone: Backbone):
        super().__init__()
        self.args = args
        self.model = backbone
        self.tied_head = bool(args.tie_word_embeddings)
        if not self.tied_head:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, tokens: mx.array, caches: list[Cache]) -> mx.array:
        return self.logits(self.hidden(tokens, caches))

    def hidden(self, tokens: mx.array, caches: list[Cache]) -> mx.array:
        """Final normed hidden states (B, N, hidden); prefill chunks stop here (no logits)."""
        return self.model(tokens, caches)

    def draft_head(self) -> nn.Module | None:
        """The multi-token-prediction head the checkpoint ships (a family's ``sanitize`` adds it
        as ``self.mtp``, e.g. Qwen3-Next's ``MTPHead``), or None; ``speculation/mtp.py``
        drafts with it."""
        return self.get("mtp")

    def draft_hidden(self, tokens: mx.array, previous: mx.array,
                     caches: list[Cache]) -> mx.array:
        """The head over pairs: ``tokens`` (B, N) embedded with this model's embedding, each
        with the hidden state before it, ``previous`` (B, N, hidden) -> (B, N, hidden) for
        ``logits``."""
        return self["mtp"](self.model.embed(tokens), previous, caches)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.tied_head:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def parameter_name(self, checkpoint_name: str) -> str | None:
        """This module tree's name for a checkpoint's tensor or module name: the renaming
        ``sanitize`` applies (None: a name it drops). Families whose checkpoints nest the
        decoder under another prefix override it."""
        return checkpoint_name

    def renamed_weights(self, weights: dict[str, mx.array]) -> tuple[dict[str, mx.array], int]:
        """``weights`` under this tree's names (``parameter_name``), and how many it dropped."""
        renamed, dropped = {}, 0
        for name, value in weights.items():
            own = self.parameter_name(name)
            if own is None:
                dropped += 1
            else:
                renamed[own] = value
        return renamed, dropped

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop precomputed RoPE frequencies (the module computes its own), and give a tied
        model the ``lm_head`` its checkpoint ships: a config may say the embeddings are tied
        while the checkpoint holds a distinct head, and the references use that head."""
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.tied_head and "lm_head.weight" in weights:
            self.tied_head = False
            self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)
        return weights
