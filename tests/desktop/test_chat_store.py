"""The conversation store: tree, settings, search, migrations, crash recovery, export/import."""

from __future__ import annotations

import itertools
import json
import sqlite3

import pytest

from desktop import transfer
from desktop.chat_settings import ChatSettings
from desktop.store import (
    HIT_END,
    HIT_START,
    MIGRATIONS,
    PLACEHOLDER_TITLE,
    SCHEMA_VERSION,
    ChatStore,
    StoreError,
    fts_query,
)
from tests.desktop.corrupt_rows import raw_rows


@pytest.fixture
def store(tmp_path):
    ticks = itertools.count(1_000_000)
    s = ChatStore(tmp_path / "chats.sqlite3", clock=lambda: float(next(ticks)))
    yield s
    s.close()


def test_new_database_is_at_the_latest_schema_in_wal_mode(store):
    assert store.schema_version == SCHEMA_VERSION
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_message_tree_edits_and_regenerations_are_siblings(store):
    chat = store.create_conversation()
    u1 = store.add_message(chat.id, None, "user", "first question")
    a1 = store.add_message(chat.id, u1.id, "assistant", "first answer")
    a1b = store.add_message(chat.id, u1.id, "assistant", "regenerated answer")
    path = store.path(chat.id)
    assert [p.message.id for p in path] == [u1.id, a1b.id]
    assert path[1].sibling_ids == (a1.id, a1b.id) and path[1].sibling_index == 1
    # An edit of the first user message is a new root sibling; the old branch is kept.
    u1b = store.add_message(chat.id, None, "user", "edited question")
    assert [p.message.id for p in store.path(chat.id)] == [u1b.id]
    assert store.path(chat.id)[0].sibling_ids == (u1.id, u1b.id)
    # Selecting the old user message follows its newest child down to a leaf.
    assert store.select_message(u1.id) == a1b.id
    assert [p.message.content for p in store.path(chat.id)] == ["first question", "regenerated answer"]
    assert store.select_message(a1.id) == a1.id
    assert store.message(a1.id).content == "first answer"


def test_parent_must_belong_to_the_same_conversation(store):
    a, b = store.create_conversation(), store.create_conversation()
    m = store.add_message(a.id, None, "user", "x")
    with pytest.raises(ValueError, match="belongs to conversation"):
        store.add_message(b.id, m.id, "assistant", "y")


def test_sidebar_order_pinned_first_then_most_recent_and_paging(store):
    chats = [store.create_conversation(f"chat {i}") for i in range(5)]
    store.add_message(chats[1].id, None, "user", "bump")  # becomes the most recent
    store.set_pinned(chats[3].id, True)
    titles = [c.title for c in store.list_conversations()]
    assert titles == ["chat 3", "chat 1", "chat 4", "chat 2", "chat 0"]
    assert [c.title for c in store.list_conversations(offset=2, limit=2)] == ["chat 4", "chat 2"]
    assert store.count_conversations() == 5


def test_delete_is_undoable_until_purged(store):
    chat = store.create_conversation("doomed")
    store.add_message(chat.id, None, "user", "uniqueword here")
    store.delete(chat.id)
    assert store.count_conversations() == 0 and store.search("uniqueword") == []
    with pytest.raises(KeyError):
        store.conversation(chat.id)
    store.restore(chat.id)
    assert store.conversation(chat.id).title == "doomed"
    assert len(store.search("uniqueword")) == 1
    store.delete(chat.id)
    assert store.purge_deleted() == 1
    store.restore(chat.id)
    assert store.count_conversations() == 0
    assert store._db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
    assert store._db.execute("SELECT COUNT(*) FROM message_search").fetchone()[0] == 0


def test_auto_titles_never_replace_user_titles(store):
    chat = store.create_conversation()
    assert chat.title == PLACEHOLDER_TITLE and chat.title_source == "placeholder"
    store.rename(chat.id, "Auto  title\n", source="auto")
    assert store.conversation(chat.id).title == "Auto title"
    store.rename(chat.id, "Mine")
    store.rename(chat.id, "Auto again", source="auto")
    assert store.conversation(chat.id).title == "Mine"


def test_settings_are_overrides_of_app_defaults(store):
    chat = store.create_conversation()
    assert store.settings(chat.id) == ChatSettings()
    store.set_settings(chat.id, ChatSettings(system_prompt="Be terse.", temperature=0.2))
    assert store.conversation(chat.id).settings_overrides == {"system_prompt": "Be terse.", "temperature": 0.2}
    store.set_default_settings(ChatSettings(top_k=40, temperature=1.0))
    effective = store.settings(chat.id)
    assert (effective.top_k, effective.temperature, effective.system_prompt) == (40, 0.2, "Be terse.")
    store.set_settings(chat.id, ChatSettings(temperature=9.0))  # clamped into range
    assert store.settings(chat.id).temperature == 2.0


def test_search_titles_and_messages_with_prefix_and_diacritics(store):
    a = store.create_conversation("Paris trip")
    store.add_message(a.id, None, "user", "Where is the Café de Flore?")
    b = store.create_conversation("Rust")
    m = store.add_message(b.id, None, "user", "explain the borrow checker")
    hits = store.search("borr")
    assert [(h.conversation_id, h.message_id) for h in hits] == [(b.id, m.id)]
    assert f"{HIT_START}borrow{HIT_END}" in hits[0].snippet
    assert [h.message_id for h in store.search("cafe")] != []
    assert [(h.conversation_id, h.message_id) for h in store.search("paris")] == [(a.id, None)]
    assert store.search('"; DROP TABLE messages; --') == []
    assert store.search("   ") == []
    store.rename(b.id, "Ownership in Rust")
    assert [h.conversation_id for h in store.search("ownership")] == [b.id]


def test_fts_query_quotes_words_and_prefixes_the_last():
    assert fts_query('say "hi" now') == '"say" """hi""" "now"*'
    assert fts_query("?? !!") is None


def test_streaming_reply_is_checkpointed_and_indexed_when_done(store):
    chat = store.create_conversation()
    u = store.add_message(chat.id, None, "user", "hello")
    r = store.add_message(chat.id, u.id, "assistant", "", status="streaming")
    store.checkpoint(r.id, "partial zebra")
    assert store.message(r.id).content == "partial zebra"
    assert store.search("zebra") == []  # not indexed while streaming
    store.finish_message(r.id, "partial zebra done", "complete", stats={"generated_tokens": 3})
    assert [h.message_id for h in store.search("zebra")] == [r.id]
    assert store.message(r.id).stats == {"generated_tokens": 3}


def test_reopening_marks_replies_left_streaming_as_interrupted(tmp_path):
    path = tmp_path / "c.sqlite3"
    s = ChatStore(path)
    chat = s.create_conversation()
    u = s.add_message(chat.id, None, "user", "q")
    r = s.add_message(chat.id, u.id, "assistant", "", status="streaming")
    s.checkpoint(r.id, "half an answer")
    s._db.close()  # no clean shutdown
    again = ChatStore(path)
    assert again.interrupted_on_open == 1
    assert again.message(r.id).status == "interrupted"
    assert again.message(r.id).content == "half an answer"
    assert [h.message_id for h in again.search("answer")] == [r.id]
    again.close()


def test_migrating_a_v1_database_keeps_data_and_builds_the_search_index(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    MIGRATIONS[1](db)
    db.execute("PRAGMA user_version = 1")
    db.execute("INSERT INTO conversations (id, title, created_at, updated_at, current_leaf_id) VALUES (1, 'Old', 0, 0, 1)")
    db.execute("INSERT INTO messages (id, conversation_id, role, content, created_at) VALUES (1, 1, 'user', 'legacy text', 0)")
    db.close()
    store = ChatStore(path)
    assert store.schema_version == SCHEMA_VERSION
    assert [p.message.content for p in store.path(1)] == ["legacy text"]
    assert [h.message_id for h in store.search("legacy")] == [1]
    assert [h.conversation_id for h in store.search("old")] == [1]
    assert (tmp_path / "old.sqlite3.v1.bak").exists()
    store.close()


def test_a_database_from_a_newer_arbor_is_refused(tmp_path):
    path = tmp_path / "new.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match="newer Arbor"):
        ChatStore(path)


def test_json_export_import_round_trips_the_whole_tree(store, tmp_path):
    chat = store.create_conversation("Tree")
    store.set_settings(chat.id, ChatSettings(system_prompt="sys", seed=7))
    u = store.add_message(chat.id, None, "user", "q")
    store.add_message(chat.id, u.id, "assistant", "a1")
    a2 = store.add_message(chat.id, u.id, "assistant", "<think>hmm</think>a2")
    store.finish_message(a2.id, "<think>hmm</think>a2", "complete", stats={"ttft_s": 0.5})
    store.set_pinned(chat.id, True)
    path = tmp_path / "export.json"
    transfer.write_json(store, [chat.id], path)
    [copy] = transfer.read_json(store, path)
    assert copy != chat.id
    original, imported = store.export_tree(chat.id), store.export_tree(copy)
    strip = lambda tree: [(m["role"], m["content"], m["status"], m["stats"]) for m in tree["messages"]]  # noqa: E731
    assert strip(imported) == strip(original)
    assert imported["settings"] == original["settings"] and imported["pinned"]
    assert [p.message.content for p in store.path(copy)] == ["q", "<think>hmm</think>a2"]
    assert len(store.path(copy)[1].sibling_ids) == 2
    md = transfer.export_markdown(store, copy)
    assert md.startswith("# Tree\n") and "> **System:** sys" in md and "a2" in md and "hmm" not in md


@pytest.mark.parametrize(
    "document, reason",
    [
        ({"hello": 1}, "not an Arbor conversation export"),
        ({"format": "arbor.conversations", "version": 99, "conversations": []}, "unsupported export version"),
        ({"messages": [{"id": 1, "parent": 5, "role": "user", "content": "x"}]}, "does not come before it"),
        ({"messages": [{"id": 1, "role": "system", "content": "x"}]}, "not a user/assistant message"),
        ({"messages": [{"id": [1], "role": "user", "content": "x"}]}, r"message 0 has an id that is not a number"),
        ({"messages": [{"id": 1, "role": "user", "content": "x"}, {"id": 1, "role": "user", "content": "y"}]},
         "message 1 repeats the id 1"),
        ({"messages": [{"id": 1, "parent": {"id": 0}, "role": "user", "content": "x"}]}, "does not come before it"),
        ({"format": "arbor.conversations", "version": 1, "conversations": ["text"]}, "not a conversation"),
        ({"format": "arbor.conversations", "version": 1, "conversations": {"a": 1}}, "is not a list"),
    ],
)
def test_bad_imports_fail_with_a_reason_and_write_nothing(store, document, reason):
    with pytest.raises(StoreError, match=reason) as failure:
        transfer.import_json(store, json.loads(json.dumps(document)))
    assert "\n" not in str(failure.value)
    assert store.count_conversations() == 0


def exported_chat(title: str, parent_of_second=1) -> dict:
    return {"title": title, "messages": [
        {"id": 1, "parent": None, "role": "user", "content": f"{title} question"},
        {"id": 2, "parent": parent_of_second, "role": "assistant", "content": f"{title} answer"},
    ]}


def test_a_file_with_one_bad_conversation_imports_nothing(store, tmp_path):
    kept = store.create_conversation("Already here")
    store.add_message(kept.id, None, "user", "stored before the import")
    before = raw_rows(tmp_path / "chats.sqlite3")
    document = {"format": "arbor.conversations", "version": 1,
                "conversations": [exported_chat("Good"), exported_chat("Fine"), exported_chat("Broken", 7)]}
    with pytest.raises(StoreError) as failure:
        transfer.import_json(store, document)
    assert str(failure.value) == ("conversation 3 of 3 ('Broken'): message 1 answers message 7, "
                                  "which does not come before it")
    assert raw_rows(tmp_path / "chats.sqlite3") == before
    assert store.search("question") == []


def test_a_write_that_fails_halfway_rolls_the_whole_import_back(store, tmp_path):
    before = raw_rows(tmp_path / "chats.sqlite3")
    # The database refuses the second conversation (as a full disk would): the first, already
    # written inside the same transaction, must go too.
    store._db.execute("CREATE TEMP TRIGGER refuse BEFORE INSERT ON conversations WHEN new.title = 'Second'"
                      " BEGIN SELECT RAISE(ABORT, 'no space left'); END")
    document = {"format": "arbor.conversations", "version": 1,
                "conversations": [exported_chat("First"), exported_chat("Second")]}
    with pytest.raises(StoreError, match="cannot write the import .*no space left"):
        transfer.import_json(store, document)
    assert raw_rows(tmp_path / "chats.sqlite3") == before
    assert store.count_conversations() == 0


def test_imported_values_arbor_would_never_store_become_defaults(store):
    document = exported_chat("Odd")
    document.update(created_at=float("inf"), updated_at=-5, title_source="robot", current_leaf=[2])
    document["messages"][1].update(status="streaming", created_at=float("nan"),
                                   stats={"generated_tokens": "many", "ttft_s": 0.5, "note": "kept"})
    [copy] = transfer.import_json(store, json.loads(json.dumps(document)))
    conversation = store.conversation(copy)
    assert conversation.created_at == conversation.updated_at == 1_000_000.0  # the store's clock
    assert conversation.title_source == "user" and conversation.problems == ()
    reply = store.path(copy)[1].message
    assert reply.status == "complete" and reply.stats == {"ttft_s": 0.5, "note": "kept"} and reply.problems == ()


def test_lineage_is_the_chain_a_reply_answers(store):
    chat = store.create_conversation()
    u = store.add_message(chat.id, None, "user", "q")
    a = store.add_message(chat.id, u.id, "assistant", "a")
    u2 = store.add_message(chat.id, a.id, "user", "q2")
    store.add_message(chat.id, u.id, "assistant", "other branch")
    assert [m.id for m in store.lineage(u2.id)] == [u.id, a.id, u2.id]
    with pytest.raises(KeyError):
        store.lineage(999)
