"""The real window offscreen at the narrow, default and wide sizes: nothing in the chat column is
cut off. After a reply with a long stats line (drafting, cache), a failed reply with a long
reason and a branch, every message's actions lie inside the chat's viewport and no label is
wider than the column (geometry, not pixels)."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, QRect, Qt
from PySide6.QtWidgets import QAbstractButton, QLabel

from desktop.app import create_app
from desktop.chat_settings import ChatSettings
from desktop.store import ChatStore

SIZES = [(700, 500), (1180, 780), (1600, 1000)]
# Seeded sampling (the tiny random model's replies are then the same on every run), prompt
# lookup drafting (the default): its reply's stats line is the longest one.
SETTINGS = ChatSettings(temperature=1.0, top_p=1.0, min_p=0.0, max_tokens=40, seed=7)


@pytest.fixture
def window(qtbot, make_loader, tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    store.set_default_settings(SETTINGS)
    parts = create_app("tiny", loader=make_loader(), store=store, theme="light")
    parts.window.show()
    qtbot.waitExposed(parts.window)
    qtbot.waitUntil(lambda: parts.window.controller.model_info is not None, timeout=20000)
    yield parts.window
    parts.window.close()
    assert parts.shutdown(5.0)
    parts.theme.deleteLater()


def settle(qtbot, window) -> None:
    def idle() -> bool:
        path = window.store.path(window.current_id) if window.current_id is not None else []
        return not window.client.busy and all(p.message.status != "streaming" for p in path)

    qtbot.waitUntil(idle, timeout=30000)


def send(qtbot, window, text: str) -> None:
    window.composer.input.setPlainText(text)
    qtbot.mouseClick(window.composer.send_button, Qt.MouseButton.LeftButton)
    settle(qtbot, window)


def in_viewport(widget, viewport) -> QRect:
    return QRect(widget.mapTo(viewport, QPoint(0, 0)), widget.size())


def test_every_action_and_label_fits_the_chat_column_at_every_width(qtbot, window):
    send(qtbot, window, "Hello! Please write a few words about gardens.")
    qtbot.mouseClick(window.chat_view.message_widgets()[1].regenerate_button, Qt.MouseButton.LeftButton)
    settle(qtbot, window)  # a second version: the branch arrows show
    send(qtbot, window, "word " * 700)  # longer than the tiny model's context: a failed reply
    [*_, failed] = window.store.path(window.current_id)
    assert failed.message.status == "error" and len(failed.message.error) > 40
    reply = window.store.path(window.current_id)[1].message
    assert reply.stats["prompt_tokens"] > 0

    for width, height in SIZES:
        window.resize(width, height)
        qtbot.waitUntil(lambda: window.width() == width and window.height() == height)
        window.chat_view.scroll_to_bottom()
        viewport, content = window.chat_view.viewport(), window.chat_view.widget()
        # The column settles at the viewport's width (a scroll bar may come or go first); a
        # message that sets its own width keeps it wider and this fails.
        qtbot.waitUntil(lambda: content.width() == viewport.width(), timeout=5000)
        column = viewport.width()
        widgets = window.chat_view.message_widgets()
        assert len(widgets) == 4
        for message in widgets:
            buttons = [b for b in message.findChildren(QAbstractButton) if b.isVisibleTo(window)]
            assert buttons, message.item.message.role
            for button in buttons:
                rect = in_viewport(button, viewport)
                assert rect.left() >= 0 and rect.right() < column, (width, button.text(), rect, column)
            for label in message.findChildren(QLabel):
                if label.isVisibleTo(window):
                    rect = in_viewport(label, viewport)
                    assert rect.left() >= 0 and rect.right() < column, (width, label.text()[:40], rect, column)
        # The last message's actions are on screen, not only inside the column.
        last = widgets[-1]
        for button in [b for b in last.findChildren(QAbstractButton) if b.isVisibleTo(window)]:
            assert viewport.rect().contains(in_viewport(button, viewport)), (width, button.text())
        # Long lines are cut or wrapped, never lost: the full text is in a tooltip or shown whole.
        note = widgets[-1].note
        assert failed.message.error in note.toolTip() or failed.message.error in widgets[-1].detail_text()
