"""A draft model paired with its target in the model store: ``arbor models import PATH --draft
DRAFT [--quantize-draft 4|8]``, ``models list`` / ``rm`` / ``unpair``, and ``Engine.load`` of a
stored model drafting with its paired draft unless ``--no-draft`` / ``--draft-lookup`` say
otherwise. Real tiny models, the real store, the real CLI; each test has its own store."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from backend.api import DoneEvent, GenerateRequest
from backend.engine import Engine
from backend.memory.budgets import CacheConfig
from backend.weights.store import PAIRING_FILE, ModelStore
from tests.fixtures.tiny_models import write_tiny_model
from tests.test_cli import assert_one_line_error, run_cli


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ARBOR_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory) -> Path:
    """Another tiny Llama with the target's tokenizer (other random weights)."""
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "tiny-draft", "llama", seed=7)


def copy_with_other_vocabulary(model: Path, folder: Path) -> Path:
    """A copy of ``model`` whose tokenizer gives two tokens each other's ids (same size)."""
    shutil.copytree(model, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


@pytest.fixture(scope="module")
def other_vocabulary(tiny_model_dir, tmp_path_factory) -> Path:
    """The target's weights with a tokenizer whose ids differ."""
    return copy_with_other_vocabulary(tiny_model_dir("llama"),
                                      tmp_path_factory.mktemp("other") / "other-vocab")


def arbor(capsys, *argv: str) -> tuple[int, str, str]:
    """``arbor ARGV`` in this process: exit code, stdout, stderr (only the command's: what the
    tiny-model writers printed before is dropped)."""
    capsys.readouterr()
    return run_cli(capsys, *argv)


def store_state(home: Path) -> dict[str, bytes]:
    """Every file under the store, with its bytes (what "the store is unchanged" compares)."""
    root = home / "models"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()} if root.is_dir() else {}


def list_lines(capsys) -> dict[str, str]:
    code, out, _ = arbor(capsys, "models", "list")
    assert code == 0
    return {line.split()[0]: line for line in out.splitlines()}


def greedy(engine: Engine) -> DoneEvent:
    events = list(engine.generate(GenerateRequest(prompt_ids=[5, 6, 7, 8, 5, 6], max_tokens=16)))
    return events[-1]


def test_import_with_a_draft_stores_and_lists_the_pairing(capsys, tiny_model_dir, draft_folder):
    code, out, err = arbor(capsys, "models", "import", str(tiny_model_dir("llama")), "--name",
                             "tiny", "--draft", str(draft_folder))
    assert code == 0, err
    assert "imported tiny" in out and "draft: tiny-draft" in out
    store = ModelStore()
    assert store.names() == ["tiny", "tiny-draft"]  # the draft is a stored model of its own
    assert store.get("tiny").draft == "tiny-draft" and store.get("tiny-draft").draft is None
    lines = list_lines(capsys)
    assert lines["tiny"].endswith("draft tiny-draft")
    assert "drafters lookup,model " in lines["tiny"]
    assert lines["tiny-draft"].endswith("drafters lookup")  # no pair of its own
    # Pairing again by store name reuses both entries; the same import again changes nothing.
    code, _, err = arbor(capsys, "models", "import", str(tiny_model_dir("llama")), "--name",
                           "tiny", "--draft", "tiny-draft")
    assert code == 0, err
    assert store.names() == ["tiny", "tiny-draft"] and store.get("tiny").draft == "tiny-draft"


def test_quantize_draft_quantizes_only_the_draft(capsys, home, tiny_model_dir, draft_folder):
    code, _, err = arbor(capsys, "models", "import", str(tiny_model_dir("llama")), "--name",
                           "tiny", "--draft", str(draft_folder), "--quantize-draft", "4")
    assert code == 0, err
    store = ModelStore()
    assert store.get("tiny-draft").quantization.startswith("4-bit")
    assert store.get("tiny").quantization is None and store.get("tiny").draft == "tiny-draft"
    assert "4-bit" in list_lines(capsys)["tiny-draft"]
    # A stored draft cannot be quantized on the way: one line, nothing changes.
    before = store_state(home)
    code, _, err = arbor(capsys, "models", "import", str(tiny_model_dir("llama")), "--name",
                           "tiny", "--draft", "tiny-draft", "--quantize-draft", "8")
    assert_one_line_error(code, err, "tiny-draft", "already stored")
    code, _, err = arbor(capsys, "models", "import", str(tiny_model_dir("llama")),
                           "--quantize-draft", "8")
    assert_one_line_error(code, err, "needs a draft")
    assert store_state(home) == before


def test_a_draft_with_another_vocabulary_is_refused_and_the_store_unchanged(
        capsys, home, tiny_model_dir, draft_folder, other_vocabulary):
    # Nothing stored yet: neither the target nor the draft stays behind.
    code, _, err = arbor(capsys, "models", "import", str(tiny_model_dir("llama")), "--name",
                           "tiny", "--draft", str(other_vocabulary))
    assert_one_line_error(code, err, "'other-vocab' cannot draft for 'tiny'", "token")
    assert store_state(home) == {}
    # A paired model keeps its pairing; the stored draft of another vocabulary stays unpaired.
    assert arbor(capsys, "models", "import", str(tiny_model_dir("llama")), "--name", "tiny",
                   "--draft", str(draft_folder))[0] == 0
    assert arbor(capsys, "models", "import", str(other_vocabulary))[0] == 0
    before = store_state(home)
    code, _, err = arbor(capsys, "models", "import", str(tiny_model_dir("llama")), "--name",
                           "tiny", "--draft", "other-vocab")
    assert_one_line_error(code, err, "cannot draft for", "token")
    assert store_state(home) == before and ModelStore().get("tiny").draft == "tiny-draft"
    # Neither a model as its own draft nor a draft that is nowhere.
    code, _, err = arbor(capsys, "models", "import", str(tiny_model_dir("llama")), "--name",
                           "tiny", "--draft", "tiny")
    assert_one_line_error(code, err, "its own draft")
    code, _, err = arbor(capsys, "models", "import", str(tiny_model_dir("llama")), "--name",
                           "tiny", "--draft", "no-such-draft")
    assert_one_line_error(code, err, "'no-such-draft' is not a stored model")
    assert store_state(home) == before


def test_engine_load_drafts_with_the_paired_draft_unless_told_otherwise(
        capsys, tiny_model_dir, draft_folder):
    ModelStore().import_path(tiny_model_dir("llama"), name="tiny", draft=draft_folder)
    memory = CacheConfig.memory_only()
    # A fixed depth: the depth controller prices rounds by wall time and may not draft at all.
    paired = Engine.load("tiny", cache=memory, draft_depth=2)
    assert paired.drafter is not None and paired.drafter.name == "tiny-draft"
    done = greedy(paired)
    assert done.drafter == "model" and done.drafted_tokens > 0
    assert len(done.acceptance_by_position) > 0 and done.mean_accepted >= 0.0
    assert Engine.load("tiny", cache=memory, speculation="none").drafter is None
    lookup = Engine.load("tiny", cache=memory, speculation="lookup")
    assert lookup.drafter is None and greedy(lookup).drafter == "lookup"
    # The same through the CLI: the pairing by default, the flags override it.
    for flags, drafter in (((), "model"), (("--no-draft",), ""), (("--draft-lookup",), "lookup")):
        code, out, err = arbor(capsys, "generate", "--model", "tiny", "--prompt-ids",
                                 "5,6,7,8,5,6", "--max-tokens", "8", "--json", *flags)
        assert code == 0, err
        assert json.loads(out)["drafter"] == drafter, flags
    # A folder outside the store has no pairing; a paired draft removed by hand is ignored.
    assert Engine.load(str(tiny_model_dir("llama")), cache=memory).drafter is None
    shutil.rmtree(ModelStore().get("tiny-draft").path)
    assert Engine.load("tiny", cache=memory).drafter is None
    assert list_lines(capsys)["tiny"].endswith("draft tiny-draft (missing)")


def test_rm_refuses_a_paired_draft_until_it_is_unpaired(capsys, home, tiny_model_dir,
                                                        draft_folder):
    ModelStore().import_path(tiny_model_dir("llama"), name="tiny", draft=draft_folder)
    before = store_state(home)
    code, _, err = arbor(capsys, "models", "rm", "tiny-draft")
    assert_one_line_error(code, err, "cannot remove 'tiny-draft'", "paired draft of 'tiny'")
    assert store_state(home) == before
    code, out, _ = arbor(capsys, "models", "unpair", "tiny")
    assert code == 0 and "tiny" in out
    assert ModelStore().get("tiny").draft is None
    assert not (ModelStore().get("tiny").path / PAIRING_FILE).exists()
    code, _, err = arbor(capsys, "models", "rm", "tiny-draft")
    assert code == 0, err
    assert ModelStore().names() == ["tiny"]
    # Removing a paired model takes its pairing with it; its draft stays, free to remove.
    ModelStore().import_path(tiny_model_dir("llama"), name="tiny", draft=draft_folder)
    assert arbor(capsys, "models", "rm", "tiny")[0] == 0
    assert arbor(capsys, "models", "rm", "tiny-draft")[0] == 0
    assert ModelStore().names() == []


def test_asking_for_a_draft_model_without_one_says_how_to_pair_one(tiny_model_dir):
    from backend.errors import InvalidRequestError

    engine = Engine.load(str(tiny_model_dir("llama")), cache=CacheConfig.memory_only())
    request = GenerateRequest(prompt_ids=[3, 4, 5], max_tokens=2, draft="model")
    with pytest.raises(InvalidRequestError, match="no draft model is loaded: pair one"):
        list(engine.generate(request))
    assert engine.drafter is None and engine.speculation == "lookup"


def test_models_list_shows_each_models_drafters(capsys, home, tiny_model_dir):
    # Prompt lookup always; a checkpoint's own multi-token-prediction head where it ships one.
    for case, name in (("qwen3_next-mtp", "with-head"), ("qwen3_next", "without-head")):
        code, _, err = arbor(capsys, "models", "import", str(tiny_model_dir(case)), "--name",
                             name)
        assert code == 0, err
    lines = list_lines(capsys)
    assert lines["with-head"].endswith("drafters lookup,mtp")
    assert lines["without-head"].endswith("drafters lookup")
