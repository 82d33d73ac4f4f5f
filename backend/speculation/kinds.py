"""Which drafters a stored model can draft with, read from its folder without loading it.

One small function for every surface that lists them (``arbor models list``); a new drafter
kind adds its own test here:

* ``lookup``: prompt lookup, always (it needs nothing but the context);
* ``model``: a draft model is paired with it (``arbor models import --draft``);
* ``assistant``: the paired draft is a Gemma 4 assistant (``speculation/assistant.py``);
* ``mtp``: the checkpoint ships a multi-token-prediction head (``mtp.*`` tensors) in a family
  whose head Arbor runs (``speculation/mtp.py``).
"""

from __future__ import annotations

from pathlib import Path

from backend.errors import ModelLoadError
from backend.weights.files import check_safetensors, read_config, weight_files

#: Families whose checkpoints' ``mtp.*`` head Arbor drafts with.
MTP_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def ships_mtp_head(folder: Path) -> bool:
    """Whether the checkpoint in ``folder`` holds ``mtp.*`` tensors Arbor runs (headers only)."""
    try:
        if read_config(folder).get("model_type") not in MTP_FAMILIES:
            return False
        return any(name.startswith("mtp.") for file in weight_files(folder)
                   for name in check_safetensors(file))
    except ModelLoadError:  # an unreadable folder lists no head; loading it says why
        return False


def available_drafters(folder: Path, paired_draft: str | None,
                       draft_architecture: str | None = None) -> tuple[str, ...]:
    """The drafter kinds of a stored model, in the order "auto" prefers them last to first
    (lookup, then model or assistant, then mtp); ``draft_architecture``: the paired draft's."""
    kinds = ["lookup"]
    if paired_draft is not None:
        kinds.append("assistant" if draft_architecture == "gemma4_assistant" else "model")
    if ships_mtp_head(Path(folder)):
        kinds.append("mtp")
    return tuple(kinds)
