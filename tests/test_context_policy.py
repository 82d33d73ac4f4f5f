"""Context overflow policies (``backend.context_policy``): what the model sees of a conversation
longer than its context, on counted fake prompts and through the real engine on the tiny model
(context 512 tokens, its byte-level tokenizer about one token per character)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.api import DoneEvent, GenerateRequest, SamplingParams
from backend.context_policy import MESSAGE_OVERHEAD, POLICIES, fit_conversation, reply_room
from backend.engine import Engine
from backend.errors import ContextLengthError, InvalidRequestError
from backend.weights.loading import load_model
from backend.tokenizer import Tokenizer

OVERHEAD = 5  # what the fake template adds per message


def render(messages) -> list[int]:
    """A fake prompt: one id per character plus ``OVERHEAD`` per message; the ids say which
    message they belong to (so tests can see what was kept)."""
    ids: list[int] = []
    for message in messages:
        ids += [int(message["content"].split(":")[0])] * (len(message["content"]) + OVERHEAD)
    return ids


def measure(message) -> int:
    return len(message["content"]) + OVERHEAD + 3  # a little above the truth, like the engine's


def message(role: str, number: int, size: int) -> dict:
    text = f"{number}:"
    return {"role": role, "content": text + "x" * max(0, size - len(text))}


def conversation(turns: int, user: int = 30, reply: int = 60, system: int = 40) -> list[dict]:
    """A system prompt and ``turns`` exchanges, the last one a user message awaiting its reply;
    message n has the number n."""
    messages = [message("system", 0, system)]
    for turn in range(turns):
        messages.append(message("user", len(messages), user))
        if turn < turns - 1:
            messages.append(message("assistant", len(messages), reply))
    return messages


def numbers(messages) -> list[int]:
    return [int(m["content"].split(":")[0]) for m in messages]


def fit(messages, policy, context=1000, max_tokens=100):
    return fit_conversation(messages, policy, context, max_tokens, render, measure)


def test_a_conversation_that_fits_is_sent_whole_under_every_policy():
    messages = conversation(3)
    for policy in POLICIES:
        result = fit(messages, policy)
        assert result.messages == messages and result.dropped == 0
        assert result.prompt_ids == render(messages) and result.total_tokens == len(result.prompt_ids)


@pytest.mark.parametrize("policy", ["drop_old_turns", "rolling_window", "truncate_middle"])
def test_trimming_keeps_the_system_prompt_whole_turns_and_the_newest_message(policy):
    messages = conversation(40)
    result = fit(messages, policy)
    kept = numbers(result.messages)
    assert kept[0] == 0 and result.messages[0]["role"] == "system"
    assert kept[-1] == len(messages) - 1  # the user's new message
    assert result.dropped == len(messages) - len(kept) > 0
    assert len(result.prompt_ids) <= 1000 - reply_room(1000, 100)
    assert result.total_tokens == len(render(messages))
    # Whole turns: every kept reply follows its own question.
    for before, after in zip(result.messages[1:], result.messages[2:]):
        if after["role"] == "assistant":
            assert before["role"] == "user" and numbers([after])[0] == numbers([before])[0] + 1
    if policy == "truncate_middle":
        assert kept[1:3] == [1, 2]  # the first exchange
    else:
        assert kept[1] == kept[2] - 1 and result.messages[1]["role"] == "user"


def test_a_fresh_cut_leaves_half_the_room_free_and_a_rolling_window_fills_it():
    messages = conversation(40)
    room = 1000 - reply_room(1000, 100)
    fresh = fit_conversation(messages, "drop_old_turns", 1000, 100, render, measure, fresh=True)
    assert room // 2 - 2 * (60 + 30 + 2 * OVERHEAD) < len(fresh.prompt_ids) <= room // 2
    rolling = fit(messages, "rolling_window")
    assert len(rolling.prompt_ids) > room - 2 * (60 + 30 + 2 * OVERHEAD)  # as full as it gets


def test_a_client_that_sends_from_its_last_cut_gets_half_the_room_when_it_runs_out():
    """The desktop sends a chat from where the model's view last began: the walk then moves the
    cut only when the newest turn overflows, and leaves half the room free (as fresh does)."""
    messages = conversation(40)
    room = 1000 - reply_room(1000, 100)
    def exact(message) -> int:
        return len(message["content"]) + OVERHEAD

    def estimate(part) -> int:  # as the policy counts: + the generation prompt's allowance
        return sum(exact(m) for m in part) + MESSAGE_OVERHEAD

    # The chat since its last cut (message 61), up to the first turn that no longer fits.
    end = next(i for i in range(63, len(messages), 2) if len(render(messages[:1] + messages[61:i + 1])) > room)
    sent = messages[:1] + messages[61:end + 1]
    assert sent[-1]["role"] == "user" and estimate(sent[:-2]) <= room  # the last request fit
    result = fit_conversation(sent, "drop_old_turns", 1000, 100, render, exact)
    fresh = fit_conversation(sent, "drop_old_turns", 1000, 100, render, exact, fresh=True)
    assert result.messages == fresh.messages and len(result.prompt_ids) <= room // 2


def test_stop_refuses_a_conversation_longer_than_the_context():
    with pytest.raises(ContextLengthError, match="prompt is .* tokens but the model's context is 1000"):
        fit(conversation(40), "stop")


def test_unknown_policy_and_a_last_message_too_long_are_one_line_errors():
    with pytest.raises(InvalidRequestError, match="context_overflow must be one of"):
        fit(conversation(2), "forget_everything")
    huge = conversation(3)
    huge[-1] = message("user", 5, 990)
    with pytest.raises(ContextLengthError, match="last message is too long"):
        fit(huge, "drop_old_turns")


def grow(policy: str, sizes: list[tuple[int, int]], context: int = 1000) -> list[int]:
    """The first kept turn's message number at each turn of a conversation growing turn by
    turn (user, reply sizes)."""
    messages = [message("system", 0, 40)]
    starts = []
    for user, reply in sizes:
        messages.append(message("user", len(messages), user))
        starts.append(numbers(fit(messages, policy, context).messages)[1])
        messages.append(message("assistant", len(messages), reply))
    return starts


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 120), st.integers(1, 200)), min_size=1, max_size=80))
def test_the_kept_start_only_moves_forward_and_only_when_the_room_runs_out(sizes):
    starts = grow("drop_old_turns", sizes)
    assert starts == sorted(starts)
    moves = sum(1 for a, b in zip(starts, starts[1:]) if a != b)
    # Each move frees at least half the room (minus the turn that overflowed it), so moves are
    # as rare as the growth allows: one per half a room of new tokens, give or take a turn.
    room = 1000 - reply_room(1000, 100)
    grown = sum(u + r + 2 * (OVERHEAD + 3) for u, r in sizes)
    largest_turn = max(u + r + 2 * (OVERHEAD + 3) for u, r in sizes)
    assert moves <= grown / max(1, room // 2 - largest_turn) + 1


def test_a_rolling_window_moves_at_every_turn_once_full_and_dropping_old_turns_rarely():
    sizes = [(30, 60)] * 60
    rolling, dropping = grow("rolling_window", sizes), grow("drop_old_turns", sizes)
    full = next(i for i, start in enumerate(rolling) if start != 1)
    assert all(a != b for a, b in zip(rolling[full:], rolling[full + 1:]))
    assert sum(a != b for a, b in zip(dropping, dropping[1:])) <= (60 - full) // 4


# -- through the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    folder = tiny_model_dir("llama")
    return Engine(load_model(folder), Tokenizer.from_folder(folder), folder.name)


def words_chat(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are terse."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn}: how are things going?"})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {turn}: fine, thank you."})
    return messages


def generate(engine, messages, policy, **kw) -> DoneEvent:
    request = GenerateRequest(messages=messages, max_tokens=6, context_overflow=policy,
                              sampling=SamplingParams(temperature=0.0), **kw)
    events = list(engine.generate(request))
    return events[-1]


@pytest.mark.parametrize("policy", ["drop_old_turns", "rolling_window", "truncate_middle"])
def test_the_engine_answers_a_conversation_longer_than_its_context(engine, policy):
    messages = words_chat(30)
    assert len(engine.tokenizer.apply_chat_template(messages)) > engine.context_length
    done = generate(engine, messages, policy)
    assert done.finish_reason in ("stop", "length") and done.dropped_messages > 0
    assert done.prompt_tokens + reply_room(engine.context_length, 6) <= engine.context_length
    fitted = engine.fit(GenerateRequest(messages=messages, max_tokens=6, context_overflow=policy))
    assert fitted.prompt_tokens == done.prompt_tokens and fitted.dropped == done.dropped_messages
    assert fitted.messages[0] == messages[0] and fitted.messages[-1] == messages[-1]


def test_the_engine_refuses_under_stop_and_names_the_sizes(engine):
    with pytest.raises(ContextLengthError, match=f"context is {engine.context_length}"):
        generate(engine, words_chat(30), "stop")
    done = generate(engine, words_chat(2), "stop")
    assert done.dropped_messages == 0


def test_dropping_old_turns_reuses_the_kept_prefix_on_the_next_turn(engine):
    messages = words_chat(30)
    first = generate(engine, messages, "drop_old_turns")
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "and then?"}]
    second = generate(engine, messages, "drop_old_turns")
    assert second.dropped_messages == first.dropped_messages  # the same start ...
    assert second.cached_tokens >= first.prompt_tokens - 2  # ... so the cache serves it


def test_a_continued_reply_writes_on_from_its_end(engine):
    messages = words_chat(2) + [{"role": "assistant", "content": "It goes"}]
    request = GenerateRequest(messages=messages, max_tokens=4, continue_reply=True,
                              sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    opened = engine.tokenizer.render_chat_template(messages[:-1], add_generation_prompt=True)
    assert engine.prompt_ids(request) == engine.tokenizer.encode(opened + "It goes")
    done = list(engine.generate(request))[-1]
    assert done.generated_tokens == 4 and done.prompt_tokens == len(engine.prompt_ids(request))
    with pytest.raises(InvalidRequestError, match="assistant message last"):
        engine.prompt_ids(GenerateRequest(messages=words_chat(2), continue_reply=True))
