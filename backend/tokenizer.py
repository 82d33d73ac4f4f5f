"""Text <-> token ids for one model folder: encoding, the chat template, streaming decode, stops.

Scope: load a Hugging Face tokenizer folder (``tokenizer.json`` via the ``tokenizers`` library,
``tokenizer_config.json``, optional ``chat_template.jinja``, ``generation_config.json``,
``config.json``); render conversations with the model's Jinja chat template in a sandbox; turn a
stream of generated ids into printable text (``StreamingDetokenizer``) and cut it at stop strings
(``StopMatcher``). Non-scope: GGUF-embedded vocabularies (the model loader converts those into a
``tokenizer.json`` first), special-token policy during generation (the engine decides what ends a
reply from ``eos_token_ids``).

Errors: a missing or unreadable tokenizer file or a template that does not compile raises
``ModelLoadError``; messages the template cannot render raise ``InvalidRequestError``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

from backend.errors import InvalidRequestError, ModelLoadError

#: Used when a folder has no chat template: ChatML, one block per message, no bos token, e.g.
#: ``<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n``. It is what Hugging Face used as
#: its default template, so an untemplated ChatML-trained model still gets its own format.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete or invalid UTF-8 sequence


def _is_byte_piece(piece: str) -> bool:
    """A SentencePiece byte-fallback token, ``<0xNN>``."""
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


class Tokenizer:
    """One model's tokenizer. Immutable after construction (``byte_tokens`` is computed on first
    use, the same set from any thread); safe to share between threads."""

    def __init__(
        self,
        backend: _Backend,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
        add_bos_token: bool = False,
    ) -> None:
        """Wrap a ``tokenizers.Tokenizer``. ``special_tokens`` maps names such as ``bos_token``
        and ``eos_token`` to token strings; they become template variables, and their ids join
        ``eos_token_ids`` (eos) or set ``bos_token_id`` (bos). Prefer ``from_folder``."""
        self._backend = backend
        self._special = {k: v for k, v in (special_tokens or {}).items() if v}
        self._add_bos_token = add_bos_token
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._id_of(self._special.get("bos_token"))
        eos = set(eos_token_ids)
        if (eos_from_config := self._id_of(self._special.get("eos_token"))) is not None:
            eos.add(eos_from_config)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.chat_template: str = chat_template or FALLBACK_CHAT_TEMPLATE
        self.has_chat_template: bool = chat_template is not None
        try:
            self._template = _jinja_env().from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise ModelLoadError(f"chat template does not compile: {_one_line(e)}") from e

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        """Load ``folder``'s tokenizer files (see the module docstring for which, and which wins).

        Raises ModelLoadError when ``tokenizer.json`` is missing or corrupt, or when one of the
        optional JSON files exists but cannot be parsed.
        """
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in {folder}")
        try:
            backend = _Backend.from_file(str(path))
        except Exception as e:  # the Rust library raises plain Exception on any parse error
            raise ModelLoadError(f"cannot read {path}: {_one_line(e)}") from e

        config = _read_json(folder / "tokenizer_config.json")
        special = {
            name: _token_content(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        template = _pick_template(config.get("chat_template"))
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():  # newer transformers save the template here; it wins
            template = jinja_file.read_text(encoding="utf-8")

        eos_ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            eos_ids |= _int_set(_read_json(folder / name).get("eos_token_id"))
        return cls(
            backend,
            chat_template=template,
            special_tokens={k: v for k, v in special.items() if v},
            eos_token_ids=eos_ids,
            add_bos_token=bool(config.get("add_bos_token", False)),
        )

    def vocabulary_mismatch(self, other: Tokenizer) -> str | None:
        """Why ``other`` does not share this tokenizer's vocabulary (id -> token), or None. A
        draft model must: its token ids are verified by the target as they are."""
        mine = self._backend.get_vocab(with_added_tokens=True)
        theirs = other._backend.get_vocab(with_added_tokens=True)
        if len(mine) != len(theirs):
            return f"its vocabulary has {len(theirs)} tokens, the model's has {len(mine)}"
        for token, token_id in mine.items():
            if theirs.get(token) != token_id:
                return f"token {token!r} is id {token_id} in the model but " + (
                    "missing" if token not in theirs else f"id {theirs[token]}") + " in it"
        return None

    # -- ids <-> text ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token strings in ``text`` map to their ids either way.
        ``add_special_tokens`` runs the tokenizer's post-processor and, when the config says
        ``add_bos_token``, makes sure the ids start with the bos token."""
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are written out unless ``skip_special_tokens``."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        """A fresh streaming decoder whose output concatenates to ``decode(ids)``."""
        return StreamingDetokenizer(self._backend, skip_special_tokens, self.byte_tokens)

    @cached_property
    def byte_tokens(self) -> frozenset[int]:
        """The SentencePiece byte-fallback ids (``<0xNN>``); empty for byte-level BPE."""
        return frozenset(i for piece, i in self._backend.get_vocab(with_added_tokens=True).items()
                         if _is_byte_piece(piece))

    # -- chat template -----------------------------------------------------------------------------

    def render_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for ``messages`` (each a dict with string ``role`` and ``content``;
        other keys pass through to the template). Raises InvalidRequestError for malformed
        messages or when the template refuses the conversation (``raise_exception``)."""
        _validate_messages(messages)
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],  # the template gets copies, not our dicts
                add_generation_prompt=add_generation_prompt,
                tools=None,  # Hugging Face passes these as None when unused; templates test them
                documents=None,
                **self._special,
            )
        except Exception as e:  # a template bug or refusal: the request cannot be rendered
            raise InvalidRequestError(f"chat template failed: {_one_line(e)}") from e

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of ``render_chat_template(...)``; no special tokens are added on top of what
        the template writes (templates write their own bos)."""
        return self.encode(self.render_chat_template(messages, add_generation_prompt))

    def turn_end_ids(self, messages: list[dict[str, Any]], reply: str,
                     prompt_ids: list[int] | None = None) -> list[int] | None:
        """The ids that follow ``apply_chat_template(messages)`` once ``reply`` is the
        assistant's answer and another user turn comes, up to that user's words: the reply,
        the template's end of turn and the next turn's header (ChatML:
        ``reply<|im_end|>\n<|im_start|>user\n``). None when the template does not render the
        longer conversation as an extension of this prompt. ``prompt_ids``: the prompt's ids
        when the caller has them already (saves encoding the conversation once more)."""
        try:
            prompt = self.render_chat_template(messages)
            nexts = [self.render_chat_template(
                list(messages) + [{"role": "assistant", "content": reply},
                                  {"role": "user", "content": words}],
                add_generation_prompt=False) for words in _NEXT_USER_WORDS]
        except InvalidRequestError:
            return None
        # Whole texts are encoded, not their tails: a tokenizer may split at the prompt's end
        # otherwise than at the start of a text.
        ids = self.encode(prompt) if prompt_ids is None else list(prompt_ids)
        a, b = (self.encode(text) for text in nexts)
        if a[:len(ids)] != ids or b[:len(ids)] != ids:
            return None
        # Where the two next turns part is where the user's words begin (a space or newline
        # the header ends with may merge into the first word, so it is left out).
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return a[len(ids):same]

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


class StreamingDetokenizer:
    """Turns generated ids, one at a time, into printable text.

    Contract: the chunks returned by ``add`` and ``finalize`` concatenate to exactly
    ``Tokenizer.decode(all_ids)``, and a chunk never ends in the middle of a UTF-8 character:
    while the decoded text ends with U+FFFD (an incomplete byte sequence, from byte-level BPE or
    SentencePiece ``<0xNN>`` byte fallback) it is held back until more ids arrive or
    ``finalize`` is called. One exception, for ids whose bytes are not valid UTF-8: a
    SentencePiece byte-fallback decoder turns a whole run of ``<0xNN>`` tokens into U+FFFD once
    any byte in it is invalid, including bytes of characters already emitted; the stream cannot
    take those back, so it shows them and replaces only the invalid bytes.

    How: only a short window of ids is decoded per call, starting at the ids emitted by the
    previous chunk. Those ids are kept as context because decoders treat the first token of a
    string specially (SentencePiece drops its leading space), so a token must not be decoded
    alone; the new text is what the window adds beyond its context's text. The context never
    starts at a byte-fallback token (``byte_tokens``) that an earlier one precedes: the decoder
    merges a run of them into one token, and Metaspace drops every U+2581 of a string's first
    token, so a window opening inside a run lost a spelled-out space.
    """

    def __init__(self, backend: _Backend, skip_special_tokens: bool = False,
                 byte_tokens: frozenset[int] = frozenset()) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        self._byte_tokens = byte_tokens
        self._window: list[int] = []  # context ids, then ids not yet emitted
        self._context = 0  # len of the context part of _window
        self._context_text = ""  # decode of the context ids alone
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, token_id: int) -> str:
        """Feed one id; return the text it completes (possibly empty)."""
        self._window.append(token_id)
        text = self._decode(self._window)
        if text.endswith(_REPLACEMENT):
            return ""  # maybe an incomplete character: wait for its remaining bytes
        return self._emit(text)

    def finalize(self) -> str:
        """Emit whatever is held back, even an incomplete character (as U+FFFD)."""
        if self._context == len(self._window):
            return ""
        return self._emit(self._decode(self._window))

    def _emit(self, text: str) -> str:
        chunk = text[len(self._context_text) :]
        # the ids just emitted become the context of the next window (from the start of a
        # byte run they continue: the window's own start is never inside one)
        start = self._context
        while start > 0 and self._window[start] in self._byte_tokens:
            start -= 1
        del self._window[:start]
        self._context = len(self._window)
        self._context_text = self._decode(self._window)
        if chunk:
            self._parts.append(chunk)
        return chunk

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)


class StopMatcher:
    """Cuts streamed text at the first occurrence of any stop string.

    ``feed`` returns the text that is safe to show now. It holds back the longest tail that is a
    prefix of some stop string (it might become a stop with the next chunk); once a stop string
    is complete it returns the text before it, reports ``stopped``, and ignores later input.
    When several stops occur, the one that completes first (the earliest end) wins.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        """Raises InvalidRequestError for an empty or non-string stop (it would match
        everywhere). An empty ``stops`` passes all text through unchanged."""
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {stop!r}")
        self._stops = tuple(dict.fromkeys(stops))  # dedupe, keep order
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return (text safe to emit now, whether a stop string has matched)."""
        if self.stopped:
            return "", True
        buffer = self._held + text
        # The stop that completes first wins (then the longer one), as if text came one
        # character at a time, so the result does not depend on how text was chunked.
        found = [(i + len(s), i) for s in self._stops if (i := buffer.find(s)) >= 0]
        if found:
            self._held = ""
            self.stopped = True
            return buffer[: min(found)[1]], True
        keep = self._partial_stop_length(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """Return and clear the held-back text (call at the end when no stop matched)."""
        held, self._held = self._held, ""
        return held

    def _partial_stop_length(self, buffer: str) -> int:
        """Length of the longest tail of ``buffer`` that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self._stops), default=1) - 1
        for length in range(min(longest, len(buffer)), 0, -1):
            tail = buffer[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0


# -- helpers ---------------------------------------------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: Hugging Face templates mark assistant text
    with it (for training masks); for rendering it is transparent."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The rendering environment Hugging Face uses: sandboxed, trim/lstrip blocks, loop
    controls, a ``tojson`` that does not HTML-escape, ``raise_exception`` and ``strftime_now``."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _plain_dict
    env.globals["namespace"] = _TemplateNamespace
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _plain_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """``dict(...)`` for templates, without exposing the ``dict`` type itself."""
    return dict(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` minus underscore names, which could shadow internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (mirrors Namespace)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _validate_messages(messages: object) -> None:
    if not isinstance(messages, list):
        raise InvalidRequestError(f"messages must be a list, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidRequestError(
                    f"messages[{i}].{key} must be a string, got {message.get(key)!r}"
                )


def _read_json(path: Path) -> dict[str, Any]:
    """The object in ``path``, {} when the file is absent; ModelLoadError when unreadable."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {_one_line(e)}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _token_content(value: object) -> str | None:
    """bos/eos entries are a string, or an AddedToken dict ``{"content": ...}``, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


#: Two next user messages that share no first token: where their renderings part is where a
#: user's words begin in a chat template.
_NEXT_USER_WORDS = ("Hello", "Why")


def _pick_template(value: object) -> str | None:
    """``chat_template`` is a string or a list of ``{name, template}``; prefer "default"."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default", next(iter(named.values()), None))
        return chosen if isinstance(chosen, str) else None
    return None


def _int_set(value: object) -> set[int]:
    """``eos_token_id`` is an int, a list of ints, or absent."""
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
