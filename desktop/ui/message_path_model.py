"""The chat view's item model: the messages on the displayed path of one conversation.

A thin adapter over a list of ``PathItem`` (plain data from ``ChatStore.path``). ``set_path``
applies a new path as row operations - the rows up to where the paths diverge stay, the rest is
removed and inserted - so switching a branch or adding a reply does not rebuild earlier messages.
``set_text`` updates the text of a reply while it streams.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from PySide6.QtCore import QAbstractListModel, QModelIndex, QPersistentModelIndex, Qt

from desktop.store import Message, PathItem

MessageRole = Qt.ItemDataRole.UserRole + 1
MessageIdRole = Qt.ItemDataRole.UserRole + 2
SpeakerRole = Qt.ItemDataRole.UserRole + 3  # "user" | "assistant"
StatusRole = Qt.ItemDataRole.UserRole + 4
SiblingIndexRole = Qt.ItemDataRole.UserRole + 5
SiblingCountRole = Qt.ItemDataRole.UserRole + 6
StatsRole = Qt.ItemDataRole.UserRole + 7
PathItemRole = Qt.ItemDataRole.UserRole + 8

Index = QModelIndex | QPersistentModelIndex


class MessagePathModel(QAbstractListModel):
    """See the module docstring."""

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.conversation_id: int | None = None
        self._items: list[PathItem] = []

    def rowCount(self, parent: Index = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._items)

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._items):
            return None
        item = self._items[index.row()]
        message = item.message
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.EditRole):
            return message.content
        if role == Qt.ItemDataRole.AccessibleTextRole:
            who = "You" if message.role == "user" else "Assistant"
            return f"{who}: {message.content}"
        if role == MessageRole:
            return message
        if role == MessageIdRole:
            return message.id
        if role == SpeakerRole:
            return message.role
        if role == StatusRole:
            return message.status
        if role == SiblingIndexRole:
            return item.sibling_index
        if role == SiblingCountRole:
            return item.sibling_count
        if role == StatsRole:
            return message.stats
        if role == PathItemRole:
            return item
        return None

    def flags(self, index: Index) -> Qt.ItemFlag:
        if not index.isValid():
            return Qt.ItemFlag.NoItemFlags
        return Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable | Qt.ItemFlag.ItemNeverHasChildren

    # -- queries ---------------------------------------------------------------------------------

    def item(self, row: int) -> PathItem:
        return self._items[row]

    def items(self) -> list[PathItem]:
        return list(self._items)

    def row_of(self, message_id: int) -> int | None:
        return next((row for row, item in enumerate(self._items) if item.message.id == message_id), None)

    def last_message(self) -> Message | None:
        return self._items[-1].message if self._items else None

    # -- changes ---------------------------------------------------------------------------------

    def set_path(self, conversation_id: int | None, items: list[PathItem]) -> None:
        """Show ``items`` of ``conversation_id``; another conversation resets the model."""
        if conversation_id != self.conversation_id:
            self.beginResetModel()
            self.conversation_id = conversation_id
            self._items = list(items)
            self.endResetModel()
            return
        keep = 0
        while keep < min(len(self._items), len(items)) and self._items[keep].message.id == items[keep].message.id:
            keep += 1
        root = QModelIndex()
        if keep < len(self._items):
            self.beginRemoveRows(root, keep, len(self._items) - 1)
            del self._items[keep:]
            self.endRemoveRows()
        for row in range(keep):
            if self._items[row] != items[row]:
                self._items[row] = items[row]
                index = self.index(row)
                self.dataChanged.emit(index, index)
        if keep < len(items):
            self.beginInsertRows(root, keep, len(items) - 1)
            self._items.extend(items[keep:])
            self.endInsertRows()

    def set_text(self, message_id: int, text: str) -> bool:
        """Update a message's text (a streaming reply); False if it is not on the path."""
        row = self.row_of(message_id)
        if row is None:
            return False
        item = self._items[row]
        if item.message.content != text:
            self._items[row] = replace(item, message=replace(item.message, content=text))
            index = self.index(row)
            self.dataChanged.emit(index, index, [Qt.ItemDataRole.DisplayRole, MessageRole])
        return True
