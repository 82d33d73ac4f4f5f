"""Tokenizer folder loading, chat templates (checked against transformers), streaming
detokenization and stop strings, on real tokenizers built locally: a byte-level BPE, two
SentencePiece-style BPEs with byte fallback, and SmolLM2's real vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from backend.errors import InvalidRequestError, ModelLoadError
from backend.tokenizer import (
    FALLBACK_CHAT_TEMPLATE,
    StopMatcher,
    StreamingDetokenizer,
    Tokenizer,
)
from tests.fixtures.byte_tokenizer import (
    CORPUS,
    build_byte_level_tokenizer,
    write_byte_level_tokenizer,
)

# The Llama 2 chat template: system message folded into the first user turn, alternation enforced
# with raise_exception, bos/eos variables.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

# Zephyr's template: written over many lines, so it renders right only with trim_blocks.
ZEPHYR_TEMPLATE = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""

# Uses the helpers Hugging Face templates rely on: namespace, tojson, strftime_now, generation.
HELPERS_TEMPLATE = """{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}{%- set ns.system = message.content -%}{%- endif -%}
{%- endfor -%}
<s>meta {{ {'system': ns.system, 'n': messages | length, 'x': 'é'} | tojson }}\
 {{ strftime_now('%Y') }}
{% for message in messages if message.role != 'system' %}
    {%- if message.role == 'assistant' -%}
        {% generation %}A: {{ message.content }}</s>{% endgeneration %}
    {%- else -%}
        U: {{ message.content }}
    {%- endif %}

{% endfor -%}
{%- if add_generation_prompt %}A:{% endif -%}"""

TEXTS = [
    "Hello world! The quick brown fox.",
    "Café crème, naïve façade — résumé.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 👨‍👩‍👧 ✨",
    "e\u0301 combining, ∑ math ≠ ∞, and a real replacement char \ufffd here",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 four-byte letters",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "  Blue. "},
        {"role": "user", "content": "Another, en français? 😀"},
    ],
    [
        {"role": "user", "content": "日本語で?"},
        {"role": "assistant", "content": "はい。"},
        {"role": "user", "content": "ok"},
    ],
]


# -- tokenizer builders ----------------------------------------------------------------------------


def build_sentencepiece_style(style: str) -> HFTokenizer:
    """A Llama/Mistral-like BPE: ▁ for spaces, <0xNN> byte fallback for characters outside a small
    alphabet (so CJK and emoji decode through several byte tokens). ``style`` "metaspace" uses
    the Metaspace pre-tokenizer and decoder, "llama" the normalizer + Replace/Strip decoder that
    Llama 2's tokenizer.json has."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if style == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    else:
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    trainer = trainers.BpeTrainer(
        vocab_size=200,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=40,
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS) * 3, trainer=trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):  # the trainer does not add byte-fallback tokens; real models have all
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    out = HFTokenizer.from_str(json.dumps(data))
    if style == "metaspace":
        out.decoder = decoders.Sequence(
            [decoders.ByteFallback(),
             decoders.Metaspace(replacement="▁", prepend_scheme="always")]
        )
    else:
        out.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
             decoders.Strip(" ", 1, 0)]
        )
    return out


def write_sentencepiece_folder(folder: Path, style: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    build_sentencepiece_style(style).save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False},
        "unk_token": "<unk>",
        "add_bos_token": True,
        "chat_template": LLAMA2_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def byte_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("byte_level")
    write_byte_level_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def sp_folders(tmp_path_factory) -> dict[str, Path]:
    folders = {}
    for style in ("metaspace", "llama"):
        folders[style] = tmp_path_factory.mktemp(f"sp_{style}")
        write_sentencepiece_folder(folders[style], style)
    return folders


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory, default_model_gguf):
    """(transformers tokenizer, folder) for SmolLM2's real vocabulary, converted from the
    default model's GGUF by transformers."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_model_gguf.parent),
                                       gguf_file=default_model_gguf.name)
    folder = tmp_path_factory.mktemp("smollm2")
    hf.save_pretrained(str(folder))
    return hf, folder


@pytest.fixture(scope="session")
def tokenizers_by_name(byte_folder, sp_folders, smollm2) -> dict[str, Tokenizer]:
    return {
        "byte_level": Tokenizer.from_folder(byte_folder),
        "sp_metaspace": Tokenizer.from_folder(sp_folders["metaspace"]),
        "sp_llama": Tokenizer.from_folder(sp_folders["llama"]),
        "smollm2": Tokenizer.from_folder(smollm2[1]),
    }


TOKENIZER_NAMES = ["byte_level", "sp_metaspace", "sp_llama", "smollm2"]

# session fixtures are immutable tokenizers, so sharing them across examples is safe
PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = tok.detokenizer()
    chunks = [detok.add(i) for i in ids]
    chunks.append(detok.finalize())
    assert detok.text == "".join(chunks)
    return chunks


# -- the fixture builder ---------------------------------------------------------------------------


def test_byte_level_fixture_is_deterministic_and_small(tmp_path):
    sizes = [write_byte_level_tokenizer(tmp_path / name) for name in ("a", "b")]
    assert sizes[0] == sizes[1] <= 512
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()
    tok = Tokenizer.from_folder(tmp_path / "a")
    assert tok.vocab_size == sizes[0]
    assert tok.eos_token_ids == {tok.encode("<|im_end|>")[0]}
    assert len(tok.encode("😀")) > 1  # emoji really span several tokens
    assert build_byte_level_tokenizer().get_vocab_size() == sizes[0]


# -- streaming detokenization ----------------------------------------------------------------------


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@pytest.mark.parametrize("text", TEXTS)
def test_stream_concatenates_to_decode_without_partial_characters(tokenizers_by_name, name, text):
    tok = tokenizers_by_name[name]
    ids = tok.encode(text)
    chunks = stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in chunk for chunk in chunks)
    if name in ("byte_level", "smollm2"):  # byte-level BPE round-trips exactly
        assert tok.decode(ids) == text


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_multi_token_characters_are_held_back_until_complete(tokenizers_by_name, name):
    tok = tokenizers_by_name[name]
    # U+1D11E is in no training text, so no trainer puts it in its alphabet (a character that
    # is, like the corpus's emoji, may or may not be kept as one token: the BPE trainer's
    # limited alphabet breaks frequency ties in no fixed order).
    ids = tok.encode("a \U0001d11e")
    chunks = stream(tok, ids)
    assert "" in chunks[:-1]  # some id completed nothing printable
    assert any(chunk.endswith("\U0001d11e") for chunk in chunks)


def test_special_tokens_stream_like_decode(tokenizers_by_name):
    tok = tokenizers_by_name["smollm2"]
    ids = tok.encode("<|im_start|>assistant\nHi 😀<|im_end|>")
    expected = "<|im_start|>assistant\nHi 😀<|im_end|>"
    assert "".join(stream(tok, ids)) == tok.decode(ids) == expected
    detok = tok.detokenizer(skip_special_tokens=True)
    text = "".join([detok.add(i) for i in ids] + [detok.finalize()])
    assert text == tok.decode(ids, skip_special_tokens=True) == "assistant\nHi 😀"


def test_incomplete_character_is_flushed_by_finalize(tokenizers_by_name):
    tok = tokenizers_by_name["byte_level"]
    ids = tok.encode("ok 😀")[:-1]  # cut inside the emoji's bytes
    detok = tok.detokenizer()
    emitted = "".join(detok.add(i) for i in ids)
    assert "\ufffd" not in emitted
    assert emitted + detok.finalize() == tok.decode(ids)
    assert detok.finalize() == ""


class CountingBackend:
    """Wraps a tokenizers.Tokenizer to record how many ids each decode call sees."""

    def __init__(self, backend: HFTokenizer) -> None:
        self.backend = backend
        self.window_sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.window_sizes.append(len(ids))
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_each_add_decodes_a_bounded_window(tokenizers_by_name, name):
    tok = tokenizers_by_name[name]
    counting = CountingBackend(tok._backend)
    detok = StreamingDetokenizer(counting)
    ids = tok.encode(" ".join(TEXTS) * 20)
    text = "".join([detok.add(i) for i in ids] + [detok.finalize()])
    assert text == tok.decode(ids)
    assert len(ids) > 1000 and max(counting.window_sizes) <= 12


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@PROPERTY_SETTINGS
@given(text=st.text(max_size=40))
def test_stream_property_random_text(tokenizers_by_name, name, text):
    tok = tokenizers_by_name[name]
    ids = tok.encode(text)
    chunks = stream(tok, ids)
    decoded = tok.decode(ids)
    assert "".join(chunks) == decoded
    if "\ufffd" not in decoded:
        assert not any("\ufffd" in chunk for chunk in chunks)


def valid_byte_fallback_ids(tok: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Id sequences for a SentencePiece-style tokenizer whose <0xNN> runs are valid UTF-8:
    vocabulary pieces mixed with characters spelled out as byte-fallback tokens."""
    byte_ids = [tok._backend.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    pieces = sorted(set(range(tok.vocab_size)) - set(byte_ids))
    spelled = st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd").map(
        lambda c: [byte_ids[b] for b in c.encode()]
    )
    chunks = st.one_of(st.sampled_from(pieces).map(lambda i: [i]), spelled)
    return st.lists(chunks, max_size=20).map(lambda parts: [i for part in parts for i in part])


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_stream_property_random_ids(tokenizers_by_name, name, data):
    """Arbitrary id sequences still concatenate to decode(ids). For the SentencePiece-style
    tokenizers the <0xNN> runs are drawn as valid UTF-8: their byte-fallback decoder turns a
    whole run into U+FFFD once any byte of it is invalid, which no streaming decoder can foresee
    (that case is pinned by the next test)."""
    tok = tokenizers_by_name[name]
    if name.startswith("sp_"):
        ids = data.draw(valid_byte_fallback_ids(tok))
        assert "\ufffd" not in tok.decode(ids)
    else:
        ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
    assert "".join(stream(tok, ids)) == tok.decode(ids)


@pytest.mark.parametrize("name", ["sp_metaspace", "sp_llama"])
def test_a_spelled_out_metaspace_after_a_shown_byte_token(tokenizers_by_name, name):
    """A character spelled in byte tokens, then the metaspace spelled in byte tokens: the
    decoder merges the whole byte run into one token, and Metaspace drops every U+2581 of a
    string's first token. A window starting inside the run (its first bytes already shown as
    "0") decoded " " as "": the stream lost the space (found by the random-ids property)."""
    tok = tokenizers_by_name[name]
    byte = [tok._backend.token_to_id(f"<0x{b:02X}>") for b in b"0" + "\u2581".encode()]
    for before in ([0], [], [tok.encode("a")[-1]]):  # <unk>, nothing, an ordinary piece
        ids = before + byte + byte[:1]
        assert "".join(stream(tok, ids)) == tok.decode(ids), (before, tok.decode(ids))


@pytest.mark.parametrize("name", ["sp_metaspace", "sp_llama"])
def test_invalid_byte_run_keeps_the_characters_already_shown(tokenizers_by_name, name):
    tok = tokenizers_by_name[name]
    byte_id = {b: tok._backend.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    ids = tok.encode("ok") + [byte_id[b] for b in "é".encode() + b"\xff"]
    assert tok.decode(ids).endswith("\ufffd" * 3)  # the decoder drops the whole run
    chunks = stream(tok, ids)
    assert "é" in chunks  # shown as soon as its two bytes arrived, before the bad byte
    assert "".join(chunks).startswith("oké") and "".join(chunks).endswith("\ufffd")


# -- stop strings ----------------------------------------------------------------------------------


def feed_all(matcher: StopMatcher, pieces) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def test_stop_split_across_several_tokens(tokenizers_by_name):
    tok = tokenizers_by_name["byte_level"]
    ids = tok.encode("Hello world<END> and more")
    detok, matcher = tok.detokenizer(), StopMatcher(["<END>"])
    pieces = [detok.add(i) for i in ids]
    assert "<END>" not in pieces  # the stop really spans tokens
    assert feed_all(matcher, pieces) == ("Hello world", True)


def test_stop_at_the_very_start():
    assert feed_all(StopMatcher(["STOP"]), ["ST", "OP", "after"]) == ("", True)
    assert StopMatcher(["x"]).feed("xyz") == ("", True)


def test_overlapping_prefixes():
    assert feed_all(StopMatcher(["abcx"]), "abcabcx") == ("abc", True)
    assert feed_all(StopMatcher(["abcx"]), ["abcabcx"]) == ("abc", True)
    assert feed_all(StopMatcher(["aab"]), "aaab") == ("a", True)


def test_held_text_is_released_when_it_stops_matching():
    matcher = StopMatcher(["abcx"])
    assert matcher.feed("xxab") == ("xx", False)
    assert matcher.feed("c") == ("", False)
    assert matcher.feed("d") == ("abcd", False)


def test_multiple_stops_first_completed_wins():
    assert feed_all(StopMatcher(["xyz", "bc"]), ["abcxyz"]) == ("a", True)
    # "c" completes before "abcd" would, however the text is chunked
    assert feed_all(StopMatcher(["abcd", "c"]), ["abcd"]) == ("ab", True)
    assert feed_all(StopMatcher(["abcd", "c"]), "abcd") == ("ab", True)
    # same end: the longer stop (earlier start) wins
    assert feed_all(StopMatcher(["cd", "bcd"]), ["abcd"]) == ("a", True)


def test_no_stop_flush_returns_held_text():
    matcher = StopMatcher(["</s>", "###"])
    assert matcher.feed("answer #") == ("answer ", False)
    assert matcher.feed("#") == ("", False)
    assert matcher.flush() == "##"
    assert matcher.flush() == ""
    assert feed_all(StopMatcher([]), ["a", "b"]) == ("ab", False)


def test_after_a_stop_everything_is_ignored():
    matcher = StopMatcher(["!"])
    assert matcher.feed("hi! there") == ("hi", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_empty_stop_string_is_rejected():
    with pytest.raises(InvalidRequestError, match="stop"):
        StopMatcher(["ok", ""])


def first_stop_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Reference: scan one character at a time; cut at the stop that completes first."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return text[: min(starts)], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_property_independent_of_chunking(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert feed_all(StopMatcher(stops), pieces) == first_stop_cut(text, stops)


# -- chat templates --------------------------------------------------------------------------------


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(smollm2, conversation, add_generation_prompt):
    hf, folder = smollm2
    tok = Tokenizer.from_folder(folder)
    assert tok.has_chat_template
    expected_text = hf.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    expected_ids = hf(expected_text, add_special_tokens=False)["input_ids"]
    assert tok.render_chat_template(conversation, add_generation_prompt) == expected_text
    assert tok.apply_chat_template(conversation, add_generation_prompt) == expected_ids
    # SmolLM2 adds its default system prompt only when the conversation has none
    assert ("named SmolLM" in expected_text) == (conversation[0]["role"] != "system")


def test_smollm2_special_ids(smollm2):
    hf, folder = smollm2
    tok = Tokenizer.from_folder(folder)
    assert tok.vocab_size == len(hf) == 49152
    assert tok.bos_token_id == hf.bos_token_id
    assert hf.eos_token_id in tok.eos_token_ids
    text = "Hello, wörld! 😀 <|im_end|>"
    assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(tok.encode(text)) == hf.decode(hf(text)["input_ids"])


@pytest.mark.parametrize("template", [LLAMA2_TEMPLATE, ZEPHYR_TEMPLATE, HELPERS_TEMPLATE])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_system_handling_templates_match_transformers(sp_folders, tmp_path, template, conversation):
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((sp_folders["llama"] / "tokenizer.json").read_bytes())
    config = json.loads((sp_folders["llama"] / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        bos_token="<s>", eos_token="</s>", unk_token="<unk>",
    )
    tok = Tokenizer.from_folder(folder)
    expected = hf.apply_chat_template(
        conversation, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert tok.render_chat_template(conversation) == expected
    expected_ids = hf(expected, add_special_tokens=False)["input_ids"]
    assert tok.apply_chat_template(conversation) == expected_ids


def test_llama2_template_folds_system_message_and_enforces_alternation(sp_folders):
    tok = Tokenizer.from_folder(sp_folders["llama"])
    text = tok.render_chat_template(CONVERSATIONS[1])
    assert text.startswith("<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nName a colour. [/INST]")
    assert tok.apply_chat_template(CONVERSATIONS[1])[0] == tok.bos_token_id
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        tok.apply_chat_template(bad)


def test_fallback_template_when_none(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    build_byte_level_tokenizer().save(str(folder / "tokenizer.json"))
    tok = Tokenizer.from_folder(folder)
    assert not tok.has_chat_template and tok.chat_template == FALLBACK_CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert tok.render_chat_template(messages, add_generation_prompt=False) == expected
    assert tok.render_chat_template(messages) == expected + "<|im_start|>assistant\n"
    assert tok.eos_token_ids == frozenset() and tok.bos_token_id is None


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ("hello", "messages must be a list"),
        ([("user", "hi")], "messages[0] must be a dict"),
        ([{"role": "user"}], "messages[0].content must be a string"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], "messages[1].role"),
        ([{"role": "user", "content": 3}], "got 3"),
    ],
)
def test_invalid_messages_raise(tokenizers_by_name, messages, fragment):
    with pytest.raises(InvalidRequestError) as info:
        tokenizers_by_name["byte_level"].apply_chat_template(messages)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_template_runs_in_a_sandbox(tmp_path):
    folder = tmp_path / "evil"
    write_byte_level_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match="chat template failed"):
        Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "x"}])


# -- folder loading --------------------------------------------------------------------------------


def test_config_variants_are_understood(tmp_path):
    folder = tmp_path / "variants"
    write_byte_level_tokenizer(folder, extra_special=["<|im_start|>", "<|im_end|>", "<|eot|>"])
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(
        bos_token={"content": "<|im_start|>", "lstrip": False},
        eos_token={"content": "<|im_end|>"},
        add_bos_token=True,
        chat_template=[
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "DEFAULT {{ bos_token }}{{ eos_token }}"},
        ],
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    probe = Tokenizer.from_folder(folder)
    eot = probe.encode("<|eot|>")[0]
    endoftext = probe.encode("<|endoftext|>")[0]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, endoftext]}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 7}))

    tok = Tokenizer.from_folder(folder)
    im_start, im_end = tok.encode("<|im_start|><|im_end|>")
    assert tok.bos_token_id == im_start
    assert tok.eos_token_ids == {im_end, eot, endoftext, 7}
    assert tok.render_chat_template([]) == "DEFAULT <|im_start|><|im_end|>"
    assert tok.encode("hi", add_special_tokens=True)[0] == im_start
    assert im_start not in tok.encode("hi")

    (folder / "chat_template.jinja").write_text("FILE WINS")
    assert Tokenizer.from_folder(folder).render_chat_template([]) == "FILE WINS"


@pytest.mark.parametrize("conversation", CONVERSATIONS[1:] + [CONVERSATIONS[0]])
def test_turn_end_ids_lead_into_the_next_turn_as_transformers_renders_it(smollm2, conversation):
    """The prompt's ids, then ``turn_end_ids``, are how transformers tokenizes the longer
    conversation up to the next user's words."""
    hf, folder = smollm2
    tok = Tokenizer.from_folder(folder)
    reply = "Sure: red, green."
    longer = conversation + [{"role": "assistant", "content": reply},
                             {"role": "user", "content": "Thanks!"}]
    text = hf.apply_chat_template(longer, tokenize=False, add_generation_prompt=True)
    expected = hf(text, add_special_tokens=False)["input_ids"]
    ahead = tok.apply_chat_template(conversation) + tok.turn_end_ids(conversation, reply)
    assert expected[:len(ahead)] == ahead
    assert hf.decode(expected[len(ahead):]) == "Thanks!<|im_end|>\n<|im_start|>assistant\n"


def test_turn_end_ids_of_other_templates(sp_folders, byte_folder):
    conversation = CONVERSATIONS[1]
    llama2 = Tokenizer.from_folder(sp_folders["llama"])
    longer = conversation + [{"role": "assistant", "content": "Green."},
                             {"role": "user", "content": "Why?"}]
    tail = llama2.turn_end_ids(conversation, "Green.")
    text = llama2.decode(tail)
    assert text.strip().startswith("Green.") and text.endswith("[INST]")  # " Why" keeps its space
    full = llama2.apply_chat_template(longer)
    assert full[:len(llama2.apply_chat_template(conversation)) + len(tail)] == \
        llama2.apply_chat_template(conversation) + tail
    # A template whose generation prompt is not how the assistant's turn is written later:
    # the prompt does not lead into the longer conversation, so there is no turn end to feed.
    odd = Tokenizer.from_folder(byte_folder)
    odd._template = odd._template.environment.from_string(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}answer now: {% endif %}")
    assert odd.turn_end_ids(conversation, "Green.") is None


@pytest.mark.parametrize(
    "setup, fragment",
    [
        (lambda f: None, "no tokenizer.json"),
        (lambda f: (f / "tokenizer.json").write_text('{"model": '), "cannot read"),
        (lambda f: (f / "tokenizer.json").write_bytes(b"\x00\xff" * 10), "cannot read"),
    ],
)
def test_missing_or_corrupt_tokenizer_json(tmp_path, setup, fragment):
    setup(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        Tokenizer.from_folder(tmp_path)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_corrupt_config_or_template_is_a_load_error(tmp_path):
    write_byte_level_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "chat_template.jinja").write_text("{% for x in %}")
    with pytest.raises(ModelLoadError, match="chat template does not compile"):
        Tokenizer.from_folder(tmp_path)
