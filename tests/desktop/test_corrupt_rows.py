"""The conversation store on damaged rows: each class of malformed row (``corrupt_rows.CASES``)
leaves the conversation openable, shows the bad value as absent with one problem line on the
record that holds it, logs it, and changes nothing stored."""

from __future__ import annotations

import logging

import pytest

from desktop.chat_settings import ChatSettings
from desktop.store import ChatStore
from tests.desktop.corrupt_rows import CASES, TEST_DEFAULTS, make_database, raw_rows


def problems_of(store: ChatStore, chat, where: str) -> tuple[str, ...]:
    """The problem lines the store reports where the case says the bad value is."""
    if where == "app":
        return tuple(store.app_setting_problems.values())
    if where == "conversation":
        return store.conversation(chat.conversation).problems
    message_id = getattr(chat, where)
    shown = {item.message.id: item.message for item in store.path(chat.conversation)}
    if message_id not in shown:  # on another branch: shown once the user goes there
        store.select_message(message_id)
        shown = {item.message.id: item.message for item in store.path(chat.conversation)}
    return shown[message_id].problems


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_malformed_row_leaves_the_conversation_readable_and_unchanged(tmp_path, case, caplog):
    path = tmp_path / "chats.sqlite3"
    chat = make_database(path, case)
    before = raw_rows(path)
    store = ChatStore(path)
    with caplog.at_level(logging.WARNING, logger="desktop.store"):
        path_items = store.path(chat.conversation)
        problems = problems_of(store, chat, case.where)
        store.lineage(path_items[-1].message.id)
        store.export_tree(chat.conversation)
        store.list_conversations()
        store.settings(chat.conversation)
    assert [p for p in problems if case.problem in p], problems
    assert all("\n" not in p for p in problems)
    assert any(case.problem in record.getMessage() for record in caplog.records)
    # Every message of the conversation is still reachable in its tree, and only those.
    tree = store.children(chat.conversation)
    assert sorted(i for kids in tree.values() for i in kids) == chat.messages
    assert path_items and all(item.message.conversation_id == chat.conversation for item in path_items)
    store.close()
    assert raw_rows(path) == before  # shown as absent, never rewritten


def test_an_undamaged_database_reports_no_problems(tmp_path):
    path = tmp_path / "chats.sqlite3"
    chat = make_database(path)
    store = ChatStore(path)
    assert store.app_setting_problems == {}
    assert store.conversation(chat.conversation).problems == ()
    assert [item.message.problems for item in store.path(chat.conversation)] == [()] * 4
    assert store.default_settings() == TEST_DEFAULTS
    store.close()


def test_values_read_as_absent_are_the_column_defaults(tmp_path):
    """What each kind of bad value is shown as (the store's documented fallbacks)."""
    by_name = {c.name: c for c in CASES}
    opened: list[ChatStore] = []

    def reopened(name: str):
        path = tmp_path / f"{len(opened)}.sqlite3"
        chat = make_database(path, by_name[name])
        opened.append(ChatStore(path))
        return opened[-1], chat

    store, chat = reopened("stats field of the wrong kind")
    assert store.message(chat.a1).stats == {"ttft_s": 0.5}
    store, chat = reopened("stats not JSON")
    assert store.message(chat.a1).stats is None
    store, chat = reopened("unknown status")
    assert store.message(chat.a1).status == "complete"
    store, chat = reopened("unknown role")
    assert store.message(chat.a1).role == "assistant"
    store, chat = reopened("text not UTF-8")
    assert store.message(chat.a1).content == "ans\ufffdwer"
    store, chat = reopened("parent missing")
    assert store.message(chat.u2).parent_id is None
    assert [p.message.id for p in store.path(chat.conversation)] == [chat.u2, chat.a2]
    assert store.path(chat.conversation)[0].sibling_ids == (chat.u1, chat.u2)  # the rest is one step away
    store, chat = reopened("parents in a loop")
    assert [p.message.id for p in store.path(chat.conversation)] == chat.messages
    assert [m.id for m in store.lineage(chat.a2)] == chat.messages
    store, chat = reopened("chat settings not JSON")
    assert store.settings(chat.conversation) == TEST_DEFAULTS
    store, chat = reopened("unknown title source")
    store.rename(chat.conversation, "Automatic", source="auto")
    assert store.conversation(chat.conversation).title == "Trip"  # kept as the user's title
    store, chat = reopened("chat date out of range")
    assert {c.id: c.updated_at for c in store.list_conversations()}[chat.conversation] == 0.0
    store, chat = reopened("current message missing")
    assert store.conversation(chat.conversation).current_leaf_id == chat.a2
    store, chat = reopened("current message in another chat")
    assert [p.message.id for p in store.path(chat.conversation)] == chat.messages
    store, chat = reopened("app setting not JSON")
    assert store.app_setting("theme", "system") == "system"
    store, chat = reopened("chat defaults not an object")
    assert store.default_settings() == ChatSettings()
    store.set_default_settings(TEST_DEFAULTS)  # saving new defaults replaces the unreadable value
    assert store.app_setting_problems == {} and store.default_settings() == TEST_DEFAULTS
    for each in opened:
        each.close()


def test_the_store_checks_every_statistic_the_worker_writes():
    from backend.api import DoneEvent
    from desktop.store.rows import STATS_FIELDS
    from desktop.chat_controller import CONTROLLER_STATS
    from desktop.worker import stats_from_done

    done = DoneEvent(text="x", token_ids=[1], finish_reason="stop", prompt_tokens=3, cached_tokens=0, generated_tokens=1,
                     ttft_s=0.1, prefill_tps=10.0, decode_tps=5.0)
    assert set(stats_from_done(done)) | set(CONTROLLER_STATS) == set(STATS_FIELDS)
