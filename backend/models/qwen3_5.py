"""Qwen3.5 and Qwen3.6, dense (``qwen3_5``) and MoE (``qwen3_5_moe``): Qwen3-Next's hybrid
layers in a multimodal checkpoint, of which Arbor runs the language model.

The decoder is Qwen3-Next's (``qwen3_next.py``): gated-delta linear attention on a
``RecurrentCache`` and gated full attention with partial rotary embeddings on a ``KVCache``
(every ``full_attention_interval``-th layer, or as ``layer_types`` says), (1 + w) RMS norms, and
a dense gated MLP (``qwen3_5``) or a sparse MoE with a sigmoid-gated shared expert on every
layer (``qwen3_5_moe``). What differs:

* Four input projections in the linear-attention layers (``in_proj_qkv``, already grouped by
  kind, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) instead of two fused ones; the CPU fast path
  stacks them into one product (``stackable_projections``).
* The config nests the language model's settings in ``text_config`` (a flat config is read as
  is). Rotary embeddings are multimodal (``mrope_section``); for text every section sees the
  same position, which is plain RoPE over the rotary dims.
* Tensor names: ``model.language_model.*`` (Hugging Face) or ``language_model.model.*`` and
  ``language_model.lm_head`` (mlx-community) become ``model.*`` and ``lm_head``
  (``parameter_name``, which also renames per-module quantization settings). The vision tower
  (``model.visual.*``, ``vision_tower.*``) is left out, with one logged line: images are not
  supported.
* Multi-token prediction: a Hugging Face checkpoint ships ``mtp.*`` (config
  ``mtp_num_hidden_layers``), the same head as Qwen3-Next's; it is held as ``self.mtp``
  (``draft_head()``). A MoE head stores its experts one tensor each, the decoder stacks them
  (``gate_up_proj``): both are stacked. The mlx-community layout has no head (mlx-lm strips it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from backend.errors import ConfigError
from backend.models import qwen3_next
from backend.models.base import config_mapping
from backend.models.decoder import multimodal_text_name
from backend.models.gated_delta import GatedDeltaMixer

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")

log = logging.getLogger(__name__)

#: Prefixes of the vision tower's tensors (Hugging Face ``model.visual.``, mlx-community).
_VISION_PREFIXES = ("visual.", "vision_tower.")


@dataclass
class ModelArgs(qwen3_next.ModelArgs):
    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        """The language model's arguments: ``text_config`` when the config nests one (the
        multimodal checkpoints), else the config itself; ``model_type`` is the outer one."""
        text = dict(config_mapping(config, "text_config") or config)
        text["model_type"] = config.get("model_type")
        if text.get("tie_word_embeddings") is None and "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        if text.get("attn_output_gate", True) is not True:
            raise ConfigError(f"attn_output_gate {text['attn_output_gate']!r} is not supported "
                              "(Qwen3.5 gates every attention output)")
        return super().from_config(text)


class GatedDeltaNet(GatedDeltaMixer):
    """The gated-delta mixer with Qwen3.5's four projections of one input."""

    #: Projections of one input that ``use_cpu_kernels`` may stack into one matrix.
    stackable_projections = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    stacked = None  # their StackedProjections, when stacked

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.in_proj_qkv = nn.Linear(args.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(args.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(args.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(args.hidden_size, self.num_v_heads, bias=False)

    def _split_projections(self, x: mx.array
                           ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        b, n, _ = x.shape
        if self.stacked is not None:
            mixed, z, beta_in, decay_in = self.stacked(x)
        else:
            mixed, z = self.in_proj_qkv(x), self.in_proj_z(x)  # [q | k | v], (B, N, Hv * Dv)
            beta_in, decay_in = self.in_proj_b(x), self.in_proj_a(x)  # (B, N, Hv) each
        return mixed, z.reshape(b, n, self.num_v_heads, self.head_v_dim), beta_in, decay_in


class DecoderLayer(qwen3_next.DecoderLayer):
    linear_mixer = GatedDeltaNet


class Model(qwen3_next.Model):
    decoder_layer = DecoderLayer

    def parameter_name(self, checkpoint_name: str) -> str | None:
        return multimodal_text_name(checkpoint_name, _VISION_PREFIXES)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The language model's tensors under this tree's names, then Qwen3-Next's sanitize
        (experts stacked, conv and norm layouts, the MTP head)."""
        renamed, vision = self.renamed_weights(weights)
        if vision:
            log.warning("images are not supported: the checkpoint's vision tower (%d tensors) "
                        "is not loaded, only its language model", vision)
        return super().sanitize(renamed)

    def _regroup_projections(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return weights  # already grouped by kind (``in_proj_qkv``) or separate
