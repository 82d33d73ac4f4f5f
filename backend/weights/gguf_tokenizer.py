"""GGUF tokenizer metadata -> Hugging Face ``tokenizer.json`` / ``tokenizer_config.json``.

A GGUF file carries its vocabulary as ``tokenizer.ggml.*`` keys (tokens, token types, merges or
SentencePiece scores, the pre-tokenizer's name, special token ids, the chat template).
``build_tokenizer`` rebuilds the tokenizer those keys describe, so that text tokenizes exactly as
the model was trained: byte-level BPE (``gpt2``) with the pre-tokenizers llama.cpp knows, and
SentencePiece BPE (``llama``) with byte fallback. Anything else is a ``ModelLoadError`` rather
than a guess. No MLX: plain Python over the metadata dict.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.errors import ModelLoadError


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": use_regex,
    }


def _split_then_bytes(pattern: str) -> dict[str, Any]:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": pattern},
                "behavior": "Isolated",
                "invert": False,
            },
            _byte_level(use_regex=False),
        ],
    }


# ``tokenizer.ggml.pre`` -> (pre_tokenizer, ignore_merges). These follow llama.cpp's own table
# (llama-vocab.cpp), which in turn reproduces each model's original tokenizer.json.
_PRE_TOKENIZERS: dict[str, tuple[dict[str, Any], bool]] = {
    "default": (_byte_level(use_regex=True), False),
    "gpt-2": (_byte_level(use_regex=True), False),
    # StarCoder-family vocabularies (SmolLM too) put every digit in its own piece first.
    **{
        name: (
            {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Digits", "individual_digits": True},
                    _byte_level(use_regex=True),
                ],
            },
            False,
        )
        for name in ("smollm", "starcoder", "refact")
    },
    # Llama 3 also looks whole words up in the vocabulary before merging (ignore_merges).
    **{
        name: (_split_then_bytes(_LLAMA3_SPLIT), True)
        for name in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")
    },
    **{name: (_split_then_bytes(_QWEN2_SPLIT), False) for name in ("qwen2", "deepseek-r1-qwen")},
}

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


# Control tokens that end a turn in the chat formats llama.cpp recognises by their text (it
# stops generation at them whatever the file's eos id says): Gemma's, ChatML's, Llama 3's, Phi's.
_END_OF_TURN_TEXTS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>")

# The turn format of architectures whose GGUF files often carry no chat template (Gemma 3's
# smallest releases): user and model turns between <start_of_turn> and <end_of_turn>; Gemma has
# no system role, so a system message opens the first user turn.
_DEFAULT_TEMPLATES = {
    "gemma3": (
        "{{ bos_token }}"
        "{% set system = messages[0]['content'] + '\n\n' "
        "if messages and messages[0]['role'] == 'system' else '' %}"
        "{% for message in messages if message['role'] != 'system' %}"
        "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}"
        "{{ (system if loop.first else '') + message['content'] | trim }}"
        "{{ '<end_of_turn>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
}


@dataclass(frozen=True)
class TokenizerFiles:
    """What ``build_tokenizer`` produces: the contents of tokenizer.json and tokenizer_config.json,
    plus the end-of-turn ids for generation_config.json."""

    tokenizer: dict[str, Any]
    tokenizer_config: dict[str, Any]
    eos_token_ids: list[int]


def _added_token(token_id: int, content: str, special: bool) -> dict[str, Any]:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def _post_processor(
    tokens: list[str], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool
) -> dict[str, Any] | None:
    """TemplateProcessing that adds BOS/EOS when the file asks for it, else ``None``."""
    prefix = [tokens[bos]] if add_bos and bos is not None else []
    suffix = [tokens[eos]] if add_eos and eos is not None else []
    if not prefix and not suffix:
        return None
    ids = {tokens[i]: i for i in (bos, eos) if i is not None}

    def special(names: list[str]) -> list[dict[str, Any]]:
        return [{"SpecialToken": {"id": name, "type_id": 0}} for name in names]

    def sequence(name: str) -> list[dict[str, Any]]:
        return [{"Sequence": {"id": name, "type_id": 0}}]

    return {
        "type": "TemplateProcessing",
        "single": special(prefix) + sequence("A") + special(suffix),
        "pair": special(prefix)
        + sequence("A")
        + special(suffix)
        + special(prefix)
        + sequence("B")
        + special(suffix),
        "special_tokens": {
            name: {"id": name, "ids": [ids[name]], "tokens": [name]} for name in prefix + suffix
        },
    }


def _byte_level_bpe(
    metadata: Mapping[str, Any], path: Path
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``tokenizer.ggml.model == "gpt2"``: the BPE model, pre-tokenizer and decoder."""
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelLoadError(f"{path}: byte-level BPE vocabulary without merges")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{path}: unsupported pre-tokenizer {pre!r} "
            f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    pre_tokenizer, ignore_merges = _PRE_TOKENIZERS[pre]
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    added = []
    for token_id, (token, token_type) in enumerate(zip(tokens, types)):
        if token_type in (_CONTROL, _USER_DEFINED):
            # Matched whole in raw text before BPE, so its key is the raw spelling.
            added.append(_added_token(token_id, token, special=token_type == _CONTROL))
        elif not set(token) <= alphabet:
            # A normal token written as plain text: spell it in the byte alphabet BPE works in.
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, token_id)  # duplicates: the first id wins, later ones unreachable
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": ignore_merges,
        "vocab": vocab,
        "merges": [merge.split(" ", 1) for merge in merges],
    }
    body = {
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": model,
    }
    return body, added


def _sentencepiece_merges(
    tokens: list[str], scores: list[float], vocab: Mapping[str, int]
) -> list[list[str]]:
    """Merges implied by a SentencePiece BPE vocabulary: every split of a piece into two pieces,
    best-scoring piece first (ties: longer left, then longer right, then vocabulary order) --
    the order Hugging Face's converters use, so the same text gives the same ids."""
    candidates = []
    for token, score in zip(tokens, scores):
        local = [
            (token[:k], token[k:], score)
            for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        candidates.extend(local)
    candidates.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))
    return [[left, right] for left, right, _ in candidates]


def _sentencepiece_bpe(
    metadata: Mapping[str, Any], path: Path, merges: list[list[str]] | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``tokenizer.ggml.model == "llama"``: SentencePiece BPE, byte fallback, ``▁`` for spaces;
    the merges implied by the scores unless ``merges`` gives them."""
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None and merges is None:
        raise ModelLoadError(f"{path}: SentencePiece vocabulary without scores")
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    added = [
        _added_token(token_id, token, special=token_type != _USER_DEFINED)
        for token_id, (token, token_type) in enumerate(zip(tokens, types))
        if token_type in (_UNKNOWN, _CONTROL, _USER_DEFINED)
    ]
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": True,
        "byte_fallback": True,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": merges if merges is not None else _sentencepiece_merges(
            tokens, list(scores), vocab),
    }
    body = {
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Metaspace",
            "replacement": "\u2581",
            "prepend_scheme": "first" if add_space_prefix else "never",
            "split": False,
        },
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": model,
    }
    return body, added


def _gemma4_bpe(
    metadata: Mapping[str, Any], path: Path
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``tokenizer.ggml.model == "gemma4"`` (llama.cpp's converter, from Gemma 4's
    tokenizer.json): SentencePiece-style BPE (``▁`` for spaces, byte fallback, no space prefix)
    whose merges the file lists, in their order."""
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
        raise ModelLoadError(f"{path}: Gemma 4 vocabulary without its merges")
    return _sentencepiece_bpe({**metadata, "tokenizer.ggml.add_space_prefix": False}, path,
                              merges=[merge.split(" ", 1) for merge in merges])


_TOKENIZER_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe,
                       "gemma4": _gemma4_bpe}


#: ``tokenizer.*`` keys the conversion reads, and what each must hold when present.
_VOCABULARY_KEYS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "tokenizer.ggml.model": ("a string", lambda v: isinstance(v, str)),
    "tokenizer.ggml.pre": ("a string", lambda v: isinstance(v, str)),
    "tokenizer.ggml.tokens": ("a list of strings", lambda v: _list_of(v, str)),
    "tokenizer.ggml.token_type": ("a list of integers", lambda v: _list_of(v, int)),
    "tokenizer.ggml.merges": ("a list of strings", lambda v: _list_of(v, str)),
    "tokenizer.ggml.scores": ("a list of numbers", lambda v: _list_of(v, (int, float))),
    "tokenizer.chat_template": ("a string", lambda v: isinstance(v, str)),
    **{
        f"tokenizer.ggml.{name}_token_id": ("a token id", lambda v: _list_of([v], int))
        for name in ("bos", "eos", "unknown", "padding", "eot", "eom")
    },
    **{
        f"tokenizer.ggml.{name}": ("true or false", lambda v: isinstance(v, bool))
        for name in ("add_bos_token", "add_eos_token", "add_space_prefix")
    },
}


def _list_of(value: Any, kind: type | tuple[type, ...]) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, kind) and not isinstance(v, bool) for v in value
    )


def check_vocabulary(metadata: Mapping[str, Any], path: Path) -> None:
    """The GGUF holds a vocabulary, and every ``tokenizer.*`` value the conversion reads has its
    type (per-token lists one entry per token); ``ModelLoadError`` naming the key otherwise."""
    if "tokenizer.ggml.tokens" not in metadata:
        raise ModelLoadError(f"{path}: GGUF has no tokenizer vocabulary")
    for key, (what, valid) in _VOCABULARY_KEYS.items():
        if key in metadata and not valid(metadata[key]):
            value = repr(metadata[key])
            value = value if len(value) <= 40 else value[:40] + "..."
            raise ModelLoadError(f"{path}: GGUF metadata {key} must be {what}, got {value}")
    count = len(metadata["tokenizer.ggml.tokens"])
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in metadata and len(metadata[key]) != count:
            raise ModelLoadError(f"{path}: GGUF metadata {key} has {len(metadata[key])} "
                                 f"entries for {count} tokens")


def build_tokenizer(metadata: Mapping[str, Any], path: Path) -> TokenizerFiles:
    """tokenizer.json / tokenizer_config.json contents from a GGUF's ``tokenizer.*`` metadata.

    Raises ``ModelLoadError`` for a vocabulary type or pre-tokenizer Arbor cannot reproduce
    exactly (rather than guessing and tokenizing differently from the model's training).
    """
    from tokenizers import Tokenizer

    check_vocabulary(metadata, path)
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in _TOKENIZER_BUILDERS:
        raise ModelLoadError(
            f"{path}: unsupported tokenizer type {kind!r} "
            f"(supported: {', '.join(sorted(_TOKENIZER_BUILDERS))})"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    body, added = _TOKENIZER_BUILDERS[kind](metadata, path)

    def token_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    bos, eos, unk, pad = (
        token_id(k)
        for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
    )
    # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind in ("llama", "gemma4")))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": body["normalizer"],
        "pre_tokenizer": body["pre_tokenizer"],
        "post_processor": _post_processor(tokens, bos, eos, add_bos, add_eos),
        "decoder": body["decoder"],
        "model": body["model"],
    }
    # Check that the tokenizers library accepts it and that every added token kept its id.
    try:
        built = Tokenizer.from_str(json.dumps(tokenizer))
    except Exception as exc:
        raise ModelLoadError(
            f"{path}: could not build a tokenizer from the GGUF vocabulary ({exc})"
        ) from exc
    for entry in added:
        if built.token_to_id(entry["content"]) != entry["id"]:
            raise ModelLoadError(
                f"{path}: tokenizer token {entry['content']!r} would not keep id {entry['id']}"
            )

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    for name, index in (
        ("bos_token", bos),
        ("eos_token", eos),
        ("unk_token", unk),
        ("pad_token", pad),
    ):
        if index is not None:
            config[name] = tokens[index]
    context = next((v for k, v in metadata.items() if k.endswith(".context_length")), None)
    if context is not None:
        config["model_max_length"] = int(context)
    template = metadata.get("tokenizer.chat_template") or _DEFAULT_TEMPLATES.get(
        metadata.get("general.architecture"))
    if template:
        config["chat_template"] = template
    # End-of-turn ids: llama.cpp's EOS plus EOT/EOM where the file has them (Llama 3's
    # <|eot_id|>), plus the control tokens it recognises as turn ends by their text.
    types = metadata.get("tokenizer.ggml.token_type") or []
    turn_ends = [i for i, text in enumerate(tokens) if text in _END_OF_TURN_TEXTS
                 and i < len(types) and types[i] == _CONTROL]
    eos_ids = [
        i for i in (eos, token_id("eot_token_id"), token_id("eom_token_id"), *turn_ends)
        if i is not None
    ]
    return TokenizerFiles(tokenizer, config, list(dict.fromkeys(eos_ids)))
