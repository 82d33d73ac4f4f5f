"""Widget-level behaviour: Markdown blocks and code copy, reasoning, stats line, titles."""

from __future__ import annotations

from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QGuiApplication

from desktop.reasoning import is_reasoning_open, split_reasoning
from desktop.store import Message, PathItem
from desktop.titles import clean_title, heuristic_title
from desktop.ui.markdown_render import MarkdownRenderer
from desktop.ui.markdown_view import MarkdownView, split_blocks
from desktop.ui.elided_label import ElidedLabel
from desktop.ui.message_widget import MessageWidget, format_stats
from desktop.ui.stats_line import stats_tooltip

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
    assert widget.stats_label.text() == ("0.25 s to first token · 31.0 tok/s · 9 tokens · 12 of 20 prompt "
                                         "tokens reused: 12 from the cache · drafts: 6 of 8 accepted")
    qtbot.mouseClick(widget.copy_button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == "The **answer**."


def test_stats_line_without_speculation_or_cache():
    assert format_stats(None) == ""
    line = format_stats({"generated_tokens": 3, "ttft_s": 1.0, "decode_tps": 0.0, "prompt_tokens": 5,
                         "cached_tokens": 0, "drafted_tokens": 0, "finish_reason": "length"})
    assert line == "1.00 s to first token · 3 tokens · 5 prompt tokens"  # the limit is a label of its own


STATS = {"generated_tokens": 57, "ttft_s": 1.2, "queue_s": 0.95, "decode_tps": 38.5, "prompt_tokens": 206,
         "cached_tokens": 190, "cached_by_tier": {"live": 100, "device": 20, "host": 0, "disk": 70},
         "prefill_tps": 320.0, "restore_s": 0.03, "drafter": "lookup", "drafted_tokens": 33,
         "accepted_tokens": 23, "mean_accepted": 1.4, "acceptance_by_position": [0.9, 0.6],
         "finish_reason": "length", "dropped_messages": 12}


def test_stats_line_attributes_every_reused_token_and_says_the_wait_apart():
    assert format_stats(STATS) == (
        "1.20 s to first token (0.95 s waiting) · 38.5 tok/s · 57 tokens · 190 of 206 prompt tokens "
        "reused: 120 in memory, 70 from disk · 12 older messages left out · drafts: 23 of 33 accepted")
    tip = stats_tooltip(STATS)
    assert "0.95 s waiting" in tip and "100 still loaded, 20 from device memory, 70 from disk" in tip
    assert "16 read at 320 tok/s" in tip and "by prompt lookup" in tip and "by position 90/60%" in tip
    assert "stopped at the reply's token limit" in tip
    # Older stored stats without tiers: the reused tokens are still accounted for.
    assert "12 of 20 prompt tokens reused: 12 from the cache" in format_stats(
        {"prompt_tokens": 20, "cached_tokens": 12})
    assert "reused: 5 from host memory, 7 from the cache" in format_stats(
        {"prompt_tokens": 20, "cached_tokens": 12, "cached_by_tier": {"host": 5}})


def test_a_reply_at_its_token_limit_says_so_and_offers_continue(qtbot):
    message = Message(2, 1, 1, "assistant", "Once upon a time", "complete", 0.0, stats=STATS)
    widget = MessageWidget(PathItem(message, (2,)), MarkdownRenderer())
    qtbot.addWidget(widget)
    widget.show()
    assert widget.limit_label.isVisible() and not widget.continue_button.isVisible()  # not the last
    widget.set_last(True)
    assert widget.continue_button.isVisible()
    assert "(0.95 s waiting)" in widget.stats_label.text() and "70 from disk" in widget.stats_label.toolTip()
    with qtbot.waitSignal(widget.continue_clicked) as clicked:
        qtbot.mouseClick(widget.continue_button, Qt.MouseButton.LeftButton)
    assert clicked.args == [2]
    done = Message(2, 1, 1, "assistant", "The end.", "complete", 0.0, stats={**STATS, "finish_reason": "stop"})
    widget.update_item(PathItem(done, (2,)), streaming=False)
    assert not widget.limit_label.isVisible() and not widget.continue_button.isVisible()
    stopped = Message(2, 1, 1, "assistant", "Half a", "cancelled", 0.0)
    widget.update_item(PathItem(stopped, (2,)), streaming=False)
    assert widget.note.text() == "stopped" and widget.continue_button.isVisible()


def test_an_elided_label_never_asks_for_its_whole_width_and_shows_it_in_the_tooltip(qtbot):
    label = ElidedLabel("a very long model name that would widen the whole chat column " * 3)
    qtbot.addWidget(label)
    label.resize(120, 20)
    label.show()
    assert label.minimumSizeHint().width() < 120 < label.sizeHint().width()
    assert label.elided and label.toolTip() == label.text()
    label.setText("short")
    assert not label.elided and label.toolTip() == ""


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
