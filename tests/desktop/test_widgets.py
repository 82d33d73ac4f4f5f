"""Widget-level behaviour: Markdown blocks and code copy, reasoning, stats line, titles."""

from __future__ import annotations

from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QGuiApplication

from desktop.reasoning import is_reasoning_open, split_reasoning
from desktop.store import Message, PathItem
from desktop.titles import clean_title, heuristic_title
from desktop.ui.markdown_render import MarkdownRenderer
from desktop.ui.markdown_view import MarkdownView, split_blocks
from desktop.ui.message_widget import MessageWidget, format_stats

REPLY = """Here is code:

```python
def add(a, b):

    return a + b
```

| Fruit | Colour |
|-------|--------|
| Apple | Red    |

1. first
2. second

Done <b>raw html</b>."""


def test_split_blocks_never_splits_inside_code_and_round_trips():
    blocks = split_blocks(REPLY)
    assert "".join(blocks) == REPLY
    assert any(b.startswith("```python") and "return a + b" in b for b in blocks)
    assert len(blocks) == 5
    assert split_blocks("- item\n\n  continued\n\nnext") == ["- item\n\n  continued\n\n", "next"]
    assert split_blocks("```\nopen fence\n\nstill code") == ["```\nopen fence\n\nstill code"]


def test_markdown_renders_tables_code_with_copy_links_and_escapes_html():
    rendered = MarkdownRenderer().render(REPLY)
    assert "<table" in rendered.html and "<th>Fruit</th>" in rendered.html
    assert 'href="arbor-copy:0"' in rendered.html
    assert rendered.code_blocks == ("def add(a, b):\n\n    return a + b",)
    assert "&lt;b&gt;raw html&lt;/b&gt;" in rendered.html


def test_code_copy_link_puts_the_code_on_the_clipboard(qtbot):
    view = MarkdownView(MarkdownRenderer())
    qtbot.addWidget(view)
    view.set_markdown(REPLY)
    browser = view._browsers[0]
    with qtbot.waitSignal(view.copy_requested) as copied:
        browser.anchorClicked.emit(QUrl("arbor-copy:0"))
    assert copied.args == ["def add(a, b):\n\n    return a + b"]
    assert QGuiApplication.clipboard().text() == copied.args[0]


def test_streaming_rerenders_only_the_changed_block(qtbot):
    view = MarkdownView(MarkdownRenderer())
    qtbot.addWidget(view)
    text = ""
    for piece in REPLY.split(" "):
        text += piece + " "
        view.set_markdown(text, streaming=True)
    streamed_renders = view.renders
    words = len(REPLY.split(" "))
    assert view.block_count == 5 and streamed_renders < words + 5
    view.set_markdown(text, streaming=False)  # the finished reply becomes one browser
    assert view.block_count == 1 and view.code_blocks == ("def add(a, b):\n\n    return a + b",)


def test_reasoning_is_split_and_collapsed(qtbot):
    assert split_reasoning("<think>weigh options</think>\n\nThe answer.") == ("weigh options", "The answer.")
    assert split_reasoning("<think>still thinking") == ("still thinking", "")
    assert split_reasoning("plain") == ("", "plain")
    assert is_reasoning_open("<think>x") and not is_reasoning_open("<think>x</think>y")
    item = PathItem(Message(2, 1, 1, "assistant", "<think>weigh options</think>The **answer**.", "complete", 0.0,
                            stats={"generated_tokens": 9, "ttft_s": 0.25, "decode_tps": 31.0, "prompt_tokens": 20,
                                   "cached_tokens": 12, "drafted_tokens": 8, "accepted_tokens": 6}), (2,))
    widget = MessageWidget(item, MarkdownRenderer())
    qtbot.addWidget(widget)
    widget.show()
    assert widget.reasoning_toggle.isVisible() and not widget.reasoning_view.isVisible()
    assert "answer" in widget.body.plain_text() and "weigh" not in widget.body.plain_text()
    qtbot.mouseClick(widget.reasoning_toggle, Qt.MouseButton.LeftButton)
    assert widget.reasoning_view.isVisible() and "weigh options" in widget.reasoning_view.plain_text()
    assert widget.stats_label.text() == ("0.25 s to first token · 31.0 tok/s · 9 tokens · prompt 20 (12 cached)"
                                         " · drafted 8, accepted 6 (75%)")
    qtbot.mouseClick(widget.copy_button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == "The **answer**."


def test_stats_line_without_speculation_or_cache():
    assert format_stats(None) == ""
    line = format_stats({"generated_tokens": 3, "ttft_s": 1.0, "decode_tps": 0.0, "prompt_tokens": 5,
                         "cached_tokens": 0, "drafted_tokens": 0, "finish_reason": "length"})
    assert line == "1.00 s to first token · 3 tokens · prompt 5 · hit max tokens"


def test_titles():
    assert heuristic_title("\n  How do I   reverse a list in Python?\nthanks") == "How do I reverse a list in Python?"
    long = heuristic_title("word " * 30)
    assert long.endswith("…") and len(long) <= 49
    assert clean_title('Title: "Reversing lists in Python".') == "Reversing lists in Python"
    assert clean_title("<think>hmm</think>Python lists") == "Python lists"
    assert clean_title("�\x06��") is None and clean_title("") is None and clean_title("!!!??") is None


def test_pyside_refcount_guard_is_active_whenever_the_bug_is_present():
    import sys

    from PySide6.QtCore import QObject, Signal

    from desktop import qt_compat

    class Emitter(QObject):
        ping = Signal()

    emitter = Emitter()
    for _ in range(200_000):  # would exhaust True's references on an affected, unguarded build
        emitter.ping.emit()
    assert qt_compat._installed or not qt_compat.bug_present()
    assert sys.getrefcount(True) > 0
