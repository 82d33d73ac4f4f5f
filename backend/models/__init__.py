"""Architecture registry: config ``model_type`` -> the module implementing it.

Adding an architecture is one module satisfying ``base.Architecture`` (``MODEL_TYPES``,
``ModelArgs``, ``Model``) and one entry here; ``tests/test_architecture_contract.py`` checks it
against the contract and ``tests/fixtures/tiny_models.py`` needs one row for its parity test.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from backend.errors import ConfigError, UnknownArchitectureError
from backend.models import gemma3, gemma4, glm4_moe_lite, llama, qwen3_5, qwen3_moe, qwen3_next
from backend.models.base import Architecture, ModelConfig

ARCHITECTURES: dict[str, Architecture] = {
    name: module
    for module in (llama, gemma3, gemma4, qwen3_moe, qwen3_next, qwen3_5, glm4_moe_lite)
    for name in module.MODEL_TYPES
}


def architecture_args(config: Mapping[str, Any], source: Path) -> tuple[Architecture, ModelConfig]:
    """The architecture for ``config["model_type"]`` and its checked arguments.

    Every config is validated here, whether a folder is being loaded or a model imported; errors
    name ``source`` (the config file or the GGUF it was read from): ``UnknownArchitectureError``
    for a model_type without an implementation, ``ConfigError`` for a bad value.
    """
    model_type = config.get("model_type")
    module = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if module is None:
        raise UnknownArchitectureError(
            f"{source}: unknown architecture model_type={model_type!r} "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    try:
        return module, module.ModelArgs.from_config(dict(config))
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
