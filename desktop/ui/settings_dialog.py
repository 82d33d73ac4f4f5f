"""The chat settings dialog: system prompt, sampling, speculative decoding and the context
overflow policy for one chat, or the app defaults.

Speculative decoding offers only what the loaded model can do: "Draft model" needs a paired
draft, "Multi-token prediction" a checkpoint that ships the head; the others are shown greyed
with the reason beside them."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from desktop.chat_settings import CONTEXT_CHOICES, LIMITS, SPECULATION_CHOICES, ChatSettings

#: Why a drafter is not offered, by choice (the loaded model's name fills in).
UNAVAILABLE = {
    "model": "{model} has no paired draft model: pair one in the model manager (Import with a Draft)",
    "mtp": "{model} ships no multi-token-prediction head",
}


def _double(name: str, step: float, decimals: int = 2) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    low, high = LIMITS[name]
    box.setRange(low, high)
    box.setSingleStep(step)
    box.setDecimals(decimals)
    return box


def _int(name: str) -> QSpinBox:
    box = QSpinBox()
    low, high = LIMITS[name]
    box.setRange(int(low), int(high))
    return box


class ChatSettingsDialog(QDialog):
    """Edits a ``ChatSettings``. ``applied(settings)`` on OK; ``defaults_saved(settings)`` when
    the user makes these values the app-wide defaults."""

    applied = Signal(object)
    defaults_saved = Signal(object)

    def __init__(self, settings: ChatSettings, defaults: ChatSettings, *, title: str,
                 drafting: tuple[str, ...] | None = None, model_name: str = "The loaded model",
                 parent: QWidget | None = None) -> None:
        """``drafting``: the speculation choices the loaded model can do (None: all)."""
        super().__init__(parent)
        self.setWindowTitle(title)
        self.setObjectName("chatSettingsDialog")
        self._defaults = defaults
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("System prompt"))
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setAccessibleName("System prompt")
        self.system_prompt.setPlaceholderText("Optional instructions the model sees before the conversation")
        self.system_prompt.setFixedHeight(96)
        layout.addWidget(self.system_prompt)

        form = QFormLayout()
        self.temperature = _double("temperature", 0.05)
        self.temperature.setAccessibleName("Temperature")
        self.temperature.setToolTip("0 = always the most likely token (deterministic)")
        self.top_p = _double("top_p", 0.01)
        self.top_p.setAccessibleName("Top p")
        self.top_k = _int("top_k")
        self.top_k.setAccessibleName("Top k")
        self.top_k.setSpecialValueText("off")
        self.min_p = _double("min_p", 0.01)
        self.min_p.setAccessibleName("Min p")
        self.repetition_penalty = _double("repetition_penalty", 0.05)
        self.repetition_penalty.setAccessibleName("Repetition penalty")
        self.max_tokens = _int("max_tokens")
        self.max_tokens.setAccessibleName("Max tokens")
        seed_row = QHBoxLayout()
        self.fixed_seed = QCheckBox("Fixed")
        self.fixed_seed.setAccessibleName("Use a fixed seed")
        self.seed = QSpinBox()
        self.seed.setRange(0, 2**31 - 1)
        self.seed.setAccessibleName("Seed")
        self.fixed_seed.toggled.connect(self.seed.setEnabled)
        seed_row.addWidget(self.fixed_seed)
        seed_row.addWidget(self.seed, 1)
        self.speculation = QComboBox()
        self.speculation.setAccessibleName("Speculative decoding")
        self.speculation.setToolTip("Drafting guesses tokens the model then checks: replies come "
                                    "faster and are exactly what the model would have written")
        reasons = []
        for choice, label in SPECULATION_CHOICES.items():
            self.speculation.addItem(label, choice)
            if drafting is not None and choice not in drafting:
                why = UNAVAILABLE.get(choice, "not available").format(model=model_name)
                item = self.speculation.model().item(self.speculation.count() - 1)
                item.setEnabled(False)
                item.setToolTip(why)
                reasons.append(why)
        self.drafting = drafting
        self.speculation_note = QLabel("; ".join(reasons) + "." if reasons else "")
        self.speculation_note.setWordWrap(True)
        self.speculation_note.setAccessibleName("Why some drafting choices are off")
        self.speculation_note.setVisible(bool(reasons))
        self.context_overflow = QComboBox()
        self.context_overflow.setAccessibleName("When the chat outgrows the context")
        self.context_overflow.setToolTip(
            "What the model sees once the chat is longer than its context. Dropping old turns in "
            "large steps keeps what it sees the same for many turns, so replies stay fast.")
        for choice, label in CONTEXT_CHOICES.items():
            self.context_overflow.addItem(label, choice)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top p", self.top_p)
        form.addRow("Top k", self.top_k)
        form.addRow("Min p", self.min_p)
        form.addRow("Repetition penalty", self.repetition_penalty)
        form.addRow("Max tokens", self.max_tokens)
        form.addRow("Seed", seed_row)
        form.addRow("Speculative decoding", self.speculation)
        form.addRow("", self.speculation_note)
        form.addRow("When the chat is too long", self.context_overflow)
        layout.addLayout(form)

        row = QHBoxLayout()
        self.reset_button = QPushButton("Use app defaults")
        self.reset_button.setAccessibleName("Reset to app defaults")
        self.save_defaults_button = QPushButton("Save as app defaults")
        self.save_defaults_button.setAccessibleName("Save as app defaults")
        row.addWidget(self.reset_button)
        row.addWidget(self.save_defaults_button)
        row.addStretch(1)
        layout.addLayout(row)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        layout.addWidget(self.buttons)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        self.reset_button.clicked.connect(lambda: self.set_settings(self._defaults))
        self.save_defaults_button.clicked.connect(self._save_defaults)
        self.set_settings(settings)

    def set_settings(self, settings: ChatSettings) -> None:
        self.system_prompt.setPlainText(settings.system_prompt)
        self.temperature.setValue(settings.temperature)
        self.top_p.setValue(settings.top_p)
        self.top_k.setValue(settings.top_k)
        self.min_p.setValue(settings.min_p)
        self.repetition_penalty.setValue(settings.repetition_penalty)
        self.max_tokens.setValue(settings.max_tokens)
        self.fixed_seed.setChecked(settings.seed is not None)
        self.seed.setEnabled(settings.seed is not None)
        self.seed.setValue(settings.seed or 0)
        choice = settings.speculation
        if self.drafting is not None and choice not in self.drafting:
            choice = "auto"  # what replies use meanwhile (the same reply, see ChatController)
        self.speculation.setCurrentIndex(max(0, self.speculation.findData(choice)))
        self.context_overflow.setCurrentIndex(max(0, self.context_overflow.findData(settings.context_overflow)))

    def settings(self) -> ChatSettings:
        return ChatSettings(
            system_prompt=self.system_prompt.toPlainText(),
            temperature=round(self.temperature.value(), 4),
            top_p=round(self.top_p.value(), 4),
            top_k=self.top_k.value(),
            min_p=round(self.min_p.value(), 4),
            repetition_penalty=round(self.repetition_penalty.value(), 4),
            max_tokens=self.max_tokens.value(),
            seed=self.seed.value() if self.fixed_seed.isChecked() else None,
            speculation=self.speculation.currentData(),
            context_overflow=self.context_overflow.currentData(),
        ).validated()

    def accept(self) -> None:
        self.applied.emit(self.settings())
        super().accept()

    def _save_defaults(self) -> None:
        self._defaults = self.settings()
        self.defaults_saved.emit(self._defaults)
