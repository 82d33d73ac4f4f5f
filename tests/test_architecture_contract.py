"""Every registered architecture family satisfies the contract in ``backend/models/base.py``.

The contract is a set of runtime-checkable Protocols (``Architecture``, ``ModelConfig``,
``LanguageModel``); ``contract_violations`` names every member a family lacks, and the
negative cases below show that it does name them. Models are built from the ``TINY_CONFIGS``
rows (random initial weights, no checkpoint), so this runs in seconds.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from backend.caches.base import Cache
from backend.models import ARCHITECTURES, llama
from backend.models.base import Architecture, LanguageModel, ModelConfig
from backend.models.decoder import Backbone, DecoderModel
from tests.fixtures.tiny_models import _BASE, TINY_CONFIGS


def protocol_members(protocol: type) -> set[str]:
    """The attributes and methods a Protocol declares."""
    methods = {name for name, value in vars(protocol).items()
               if isinstance(value, (types.FunctionType, classmethod))
               and (not name.startswith("_") or name == "__call__")}
    return methods | set(protocol.__annotations__)


def missing(obj: Any, protocol: type) -> list[str]:
    return sorted(m for m in protocol_members(protocol) if not hasattr(obj, m))


def tiny_config(model_type: str) -> dict:
    case = next(c for c, row in sorted(TINY_CONFIGS.items()) if row["model_type"] == model_type)
    return {**_BASE, **TINY_CONFIGS[case]}


def contract_violations(module: Any, config: dict) -> list[str]:
    """What ``module`` lacks of the architecture contract, as readable lines (empty: none)."""
    problems = [f"module lacks {m}" for m in missing(module, Architecture)]
    if problems:
        return problems
    assert isinstance(module, Architecture)
    if not dataclasses.is_dataclass(module.ModelArgs):
        problems.append("ModelArgs is not a dataclass")
    problems += [f"ModelArgs lacks {m}" for m in missing(module.ModelArgs, ModelConfig)
                 if m not in {f.name for f in dataclasses.fields(module.ModelArgs)}]
    if problems:
        return problems
    args = module.ModelArgs.from_config(config)
    problems += [f"ModelArgs instance lacks {m}" for m in missing(args, ModelConfig)]
    model = module.Model(args)
    if not isinstance(model, nn.Module):
        problems.append("Model is not an nn.Module")
    problems += [f"Model lacks {m}" for m in missing(model, LanguageModel)]
    if problems:
        return problems
    assert isinstance(model, LanguageModel) and isinstance(args, ModelConfig)
    caches = model.make_caches()
    # Layers that read an earlier layer's keys (Gemma 4's KV-shared layers) hold no cache.
    holding = args.num_hidden_layers - getattr(args, "num_kv_shared_layers", 0)
    if len(caches) != holding or not all(isinstance(c, Cache) for c in caches):
        problems.append("make_caches does not give one Cache per layer that holds state")
    tokens = mx.array([[1, 2, 3]])
    logits = model(tokens, caches)
    if logits.shape != (1, 3, args.vocab_size):
        problems.append(f"__call__ gives shape {logits.shape}, not (1, 3, vocab)")
    split = model.logits(model.hidden(tokens, model.make_caches()))
    if not mx.array_equal(logits, split):
        problems.append("__call__ is not logits(hidden(...))")
    if not isinstance(model.sanitize({}), dict):
        problems.append("sanitize does not return a dict")
    return problems


FAMILIES = sorted({module.__name__: module for module in ARCHITECTURES.values()}.items())


def test_every_model_type_has_a_tiny_config_for_the_parity_tests():
    rows = {row["model_type"] for row in TINY_CONFIGS.values()}
    assert set(ARCHITECTURES) <= rows, sorted(set(ARCHITECTURES) - rows)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_registered_family_satisfies_the_contract(model_type):
    module = ARCHITECTURES[model_type]
    assert model_type in module.MODEL_TYPES
    assert contract_violations(module, tiny_config(model_type)) == []


@pytest.mark.parametrize("name,module", FAMILIES, ids=[n for n, _ in FAMILIES])
def test_model_types_are_plain_strings_registered_once(name, module):
    assert isinstance(module.MODEL_TYPES, tuple) and module.MODEL_TYPES
    assert all(isinstance(t, str) and ARCHITECTURES[t] is module for t in module.MODEL_TYPES)


# -- the check itself fails when a member is missing -----------------------------------------


def family_like_llama(**replace: Any) -> types.ModuleType:
    """A copy of the llama family with members replaced (``None`` deletes one)."""
    module = types.ModuleType("fake_family")
    for name in ("MODEL_TYPES", "ModelArgs", "Model"):
        setattr(module, name, getattr(llama, name))
    for name, value in replace.items():
        if value is None:
            delattr(module, name)
        else:
            setattr(module, name, value)
    return module


class ModelWithoutCaches(DecoderModel):
    """A family that forgot ``make_caches`` (the shared decoder does not supply one)."""

    def __init__(self, args):
        layers = [llama.DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        super().__init__(args, Backbone(args, layers))


class ModelWithoutHidden(nn.Module):
    """A model that only offers ``__call__``: no hidden/logits split for chunked prefill."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.inner = llama.Model(args)

    def __call__(self, tokens, caches):
        return self.inner(tokens, caches)

    def make_caches(self):
        return self.inner.make_caches()

    def sanitize(self, weights):
        return weights


@dataclasses.dataclass
class ArgsWithoutContext:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False

    @classmethod
    def from_config(cls, config):
        return cls(**{f.name: config[f.name] for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("replace,needle", [
    ({"MODEL_TYPES": None}, "module lacks MODEL_TYPES"),
    ({"Model": None}, "module lacks Model"),
    ({"ModelArgs": ArgsWithoutContext}, "ModelArgs lacks max_position_embeddings"),
    ({"Model": ModelWithoutCaches}, "Model lacks make_caches"),
    ({"Model": ModelWithoutHidden}, "Model lacks hidden"),
], ids=["no-model-types", "no-model", "args-without-context", "no-make-caches", "no-hidden"])
def test_a_family_lacking_a_member_fails_the_check(replace, needle):
    problems = contract_violations(family_like_llama(**replace), tiny_config("llama"))
    assert any(needle in p for p in problems), problems
