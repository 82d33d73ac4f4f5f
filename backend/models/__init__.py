"""Architecture registry: config ``model_type`` -> the module implementing it.

Adding an architecture is one module with ``ModelArgs``/``Model`` and one entry per model_type
in ``ARCHITECTURES`` (see ``backend/models/base.py`` for what a module provides).
"""

from __future__ import annotations

from types import ModuleType

from backend.models import gemma3, llama, qwen3_moe, qwen3_next

ARCHITECTURES: dict[str, ModuleType] = {
    name: module
    for module in (llama, gemma3, qwen3_moe, qwen3_next)
    for name in module.MODEL_TYPES
}
