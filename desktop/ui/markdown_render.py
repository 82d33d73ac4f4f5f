"""Markdown -> the HTML subset Qt's rich-text engine draws, with highlighted code blocks.

Replies are CommonMark plus GitHub tables and strikethrough (markdown-it-py); raw HTML in a reply
is shown as text, never interpreted. Each fenced code block becomes a shaded box with its language
and a "Copy" link (``arbor-copy:<n>``); ``Rendered.code_blocks[n]`` is the text that link copies.
Code is highlighted with Pygments using inline colours (Qt's rich text has no stylesheet classes).

Both libraries are optional at run time: without markdown-it-py the text is shown through Qt's
own Markdown reader, without Pygments code is shown uncoloured.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

COPY_SCHEME = "arbor-copy"


@dataclass(frozen=True)
class Palette:
    """Colours the HTML uses; one for light and one for dark themes."""

    code_background: str
    code_header: str
    table_border: str
    pygments_style: str
    link: str


LIGHT = Palette("#f3f4f6", "#6b7280", "#9ca3af", "friendly", "#2563eb")
DARK = Palette("#161b22", "#9aa3b2", "#5c6370", "monokai", "#7aa2f7")


@dataclass(frozen=True)
class Rendered:
    html: str
    code_blocks: tuple[str, ...]


class MarkdownRenderer:
    """Renders reply text; one instance per theme (it caches lexers and the formatter)."""

    def __init__(self, palette: Palette = LIGHT) -> None:
        self.palette = palette
        self._lexers: dict[str, Any] = {}
        try:
            from markdown_it import MarkdownIt
        except ImportError:  # pragma: no cover - exercised only without the optional dependency
            self._md = None
        else:
            self._md = MarkdownIt("commonmark", {"html": False, "breaks": False}).enable(["table", "strikethrough"])
            # markdown-it binds each rule to its renderer: the lambdas take it as their first
            # argument and forward to this object.
            fence = lambda _renderer, tokens, idx, options, env: self._render_fence(tokens, idx, env)  # noqa: E731
            self._md.add_render_rule("fence", fence)
            self._md.add_render_rule("code_block", fence)
            self._md.add_render_rule("table_open", lambda _renderer, *args: self._render_table_open())
        try:
            from pygments.formatters import HtmlFormatter
            from pygments.styles import get_style_by_name
        except ImportError:  # pragma: no cover
            self._formatter = None
        else:
            self._formatter = HtmlFormatter(nowrap=True, noclasses=True, style=get_style_by_name(palette.pygments_style))

    def warm_up(self) -> None:
        """Import the Markdown and highlighting machinery now (tens of milliseconds, once) so the
        first reply with code does not pay for it."""
        self.render("*warm*\n\n```python\nx = 1\n```\n\n| a |\n|---|\n| 1 |\n")

    def render(self, text: str) -> Rendered:
        """HTML for ``text`` (complete or still streaming: an open code fence runs to the end)."""
        if self._md is None:
            return Rendered(self._qt_markdown(text), ())
        env: dict[str, Any] = {"code": []}
        body = self._md.render(text, env)
        return Rendered(body, tuple(env["code"]))

    # -- rules -----------------------------------------------------------------------------------

    def _render_fence(self, tokens, idx: int, env: dict[str, Any]) -> str:
        token = tokens[idx]
        language = token.info.strip().split()[0] if token.info and token.info.strip() else ""
        code = token.content
        number = len(env["code"])
        env["code"].append(code.rstrip("\n"))
        p = self.palette
        label = html.escape(language) if language else "code"
        return (
            f'<table width="100%" cellspacing="0" cellpadding="6" bgcolor="{p.code_background}"'
            f' style="margin-top:6px; margin-bottom:6px;">'
            f'<tr><td><span style="color:{p.code_header}; font-size:small;">{label}</span>'
            f'&nbsp;&nbsp;<a href="{COPY_SCHEME}:{number}" style="font-size:small; color:{p.link};">Copy</a></td></tr>'
            f"<tr><td><pre>{self._highlight(code.rstrip(chr(10)), language)}</pre></td></tr></table>\n"
        )

    def _render_table_open(self) -> str:
        return (
            f'<table border="1" cellspacing="0" cellpadding="5" '
            f'style="border-collapse:collapse; border-style:solid; border-color:{self.palette.table_border};">\n'
        )

    # -- helpers ---------------------------------------------------------------------------------

    def _highlight(self, code: str, language: str) -> str:
        lexer = self._lexer(language)
        if lexer is None or self._formatter is None:
            return html.escape(code)
        from pygments import highlight

        return highlight(code, lexer, self._formatter).rstrip("\n")

    def _lexer(self, language: str):
        if not language or self._formatter is None:
            return None
        key = language.lower()
        if key not in self._lexers:
            from pygments.lexers import get_lexer_by_name
            from pygments.util import ClassNotFound

            try:
                self._lexers[key] = get_lexer_by_name(key, stripnl=False, ensurenl=False)
            except ClassNotFound:
                self._lexers[key] = None
        return self._lexers[key]

    @staticmethod
    def _qt_markdown(text: str) -> str:  # pragma: no cover - fallback without markdown-it-py
        from PySide6.QtGui import QTextDocument

        document = QTextDocument()
        document.setMarkdown(text, QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
        return document.toHtml()


def plain_code_blocks(text: str) -> list[str]:
    """The fenced code blocks of ``text`` (what the Copy links copy), for tests and export."""
    return list(MarkdownRenderer().render(text).code_blocks)
