"""Small item models over plain lists: search results and installed models.

Both are thin adapters: the data is a list of frozen dataclasses replaced as a whole (a model
reset), because each replacement is a new answer (a new query, a re-listed store), not an edit.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QAbstractListModel, QAbstractTableModel, QModelIndex, QPersistentModelIndex, Qt

from desktop.store import HIT_END, HIT_START, SearchHit

if TYPE_CHECKING:  # importing the model store at run time would load MLX
    from backend.weights.store import StoredModel

HitRole = Qt.ItemDataRole.UserRole + 1
SnippetHtmlRole = Qt.ItemDataRole.UserRole + 2
ModelNameRole = Qt.ItemDataRole.UserRole + 1

Index = QModelIndex | QPersistentModelIndex


def snippet_html(snippet: str) -> str:
    """A search snippet as HTML with the matched words in bold."""
    escaped = html.escape(snippet.replace("\n", " "))
    return escaped.replace(HIT_START, "<b>").replace(HIT_END, "</b>")


def plain_snippet(snippet: str) -> str:
    return snippet.replace(HIT_START, "").replace(HIT_END, "").replace("\n", " ")


class SearchResultsModel(QAbstractListModel):
    """Hits of the sidebar's full-text search."""

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self._hits: list[SearchHit] = []
        self.query = ""

    def rowCount(self, parent: Index = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._hits)

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._hits):
            return None
        hit = self._hits[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return hit.title if hit.message_id is None else f"{hit.title}\n{plain_snippet(hit.snippet)}"
        if role in (Qt.ItemDataRole.ToolTipRole, Qt.ItemDataRole.AccessibleTextRole):
            where = "title" if hit.message_id is None else "message"
            return f"{hit.title} ({where}): {plain_snippet(hit.snippet)}"
        if role == HitRole:
            return hit
        if role == SnippetHtmlRole:
            return snippet_html(hit.snippet)
        return None

    def flags(self, index: Index) -> Qt.ItemFlag:
        if not index.isValid():
            return Qt.ItemFlag.NoItemFlags
        return Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable | Qt.ItemFlag.ItemNeverHasChildren

    def set_hits(self, query: str, hits: list[SearchHit]) -> None:
        self.beginResetModel()
        self.query = query
        self._hits = list(hits)
        self.endResetModel()

    def hit(self, row: int) -> SearchHit:
        return self._hits[row]


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"


def human_count(n: int | None) -> str:
    if n is None:
        return "?"
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


class ModelTableModel(QAbstractTableModel):
    """The model manager's table of installed models."""

    COLUMNS = ("Name", "Architecture", "Quantization", "Parameters", "Size", "Draft")

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self._models: list["StoredModel"] = []
        self._names: set[str] = set()
        self.loaded_name: str | None = None

    def rowCount(self, parent: Index = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._models)

    def columnCount(self, parent: Index = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole and 0 <= section < len(self.COLUMNS):
            return self.COLUMNS[section]
        return None

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._models):
            return None
        model = self._models[index.row()]
        if role == ModelNameRole:
            return model.name
        if role == Qt.ItemDataRole.DisplayRole:
            column = index.column()
            if column == 0:
                return model.name + ("  (loaded)" if model.name == self.loaded_name else "")
            if column == 1:
                return model.architecture
            if column == 2:
                return model.quantization or "none (float)"
            if column == 3:
                return human_count(model.parameters)
            if column == 4:
                return human_bytes(model.size_bytes)
            if column == 5:  # the paired draft model (speculative decoding), if any
                missing = model.draft is not None and model.draft not in self._names
                return (model.draft or "") + (" (missing)" if missing else "")
        if role == Qt.ItemDataRole.ToolTipRole:
            return str(model.path)
        if role == Qt.ItemDataRole.TextAlignmentRole and index.column() in (3, 4):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None

    def flags(self, index: Index) -> Qt.ItemFlag:
        if not index.isValid():
            return Qt.ItemFlag.NoItemFlags
        return Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable | Qt.ItemFlag.ItemNeverHasChildren

    def set_models(self, models: "list[StoredModel]") -> None:
        self.beginResetModel()
        self._models = list(models)
        self._names = {model.name for model in self._models}
        self.endResetModel()

    def set_loaded(self, name: str | None) -> None:
        self.loaded_name = name
        if self._models:
            self.dataChanged.emit(self.index(0, 0), self.index(len(self._models) - 1, 0))

    def model_at(self, row: int) -> "StoredModel":
        return self._models[row]

    def model_named(self, name: str) -> "StoredModel":
        return next(model for model in self._models if model.name == name)
