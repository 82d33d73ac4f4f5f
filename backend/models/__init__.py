"""Architecture registry: config ``model_type`` -> the module implementing it.

Adding an architecture is one module with ``ModelArgs``/``Model`` and one entry per model_type
in ``ARCHITECTURES`` (see ``backend/models/base.py`` for what a module provides).
"""

from __future__ import annotations

from types import ModuleType

from backend.models import llama

ARCHITECTURES: dict[str, ModuleType] = {name: llama for name in llama.MODEL_TYPES}
