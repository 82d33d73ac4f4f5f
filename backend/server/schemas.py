"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Types are strict (``"0.5"`` is not a number, ``1`` is not a boolean) and ranges are OpenAI's
where OpenAI has one. Fields OpenAI clients send that Arbor has no use for (``user``,
``metadata``, ``tools``, ...) are accepted and ignored; a known field asking for something
Arbor cannot do (``n`` > 1, top logprobs, ``echo``) is a 400 naming it. An explicit ``null``
means the default, as for an absent field. Extensions beyond OpenAI: ``top_k``, ``min_p``,
``repetition_penalty`` and ``ignore_eos``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)

from backend.api import GenerateRequest, SamplingParams
from backend.errors import InvalidRequestError

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: str | list[dict] | None) -> str | list[dict] | None:
        if isinstance(content, list):
            for part in content:
                if part.get("type") != "text":
                    raise ValueError(f"only text content parts are supported, got type "
                                     f"{part.get('type')!r}")
                if not isinstance(part.get("text"), str):
                    raise ValueError("a text part needs a string 'text'")
        return content

    @model_validator(mode="after")
    def _content_where_needed(self) -> "ChatMessage":
        # Only an assistant turn may come without content (as OpenAI's API has it).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def as_engine_message(self) -> dict:
        """``{"role", "content"}`` with a plain string: text parts joined by newlines,
        ``developer`` read as ``system`` (what chat templates know)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class StreamOptions(_Body):
    include_usage: bool | None = None


StopStrings = str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)]


class _Generation(_Body):
    """What chat and text completions share: the model, sampling, limits and streaming."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, lt=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = None
    stop: StopStrings | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None

    # Fields that can ask for what Arbor cannot do: the values it takes, and why not others.
    ONLY: ClassVar[dict[str, tuple[tuple, str]]] = {"n": ((None, 1), "only n=1 is supported")}

    @field_validator("*")
    @classmethod
    def _supported(cls, value: Any, info: ValidationInfo) -> Any:
        rule = cls.ONLY.get(info.field_name or "")
        if rule is not None and value not in rule[0]:
            raise ValueError(f"{rule[1]}, got {value!r}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop == "":
            raise ValueError("a stop string must not be empty")
        return stop

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self) -> SamplingParams:
        def pick(value, default):
            return default if value is None else value

        return SamplingParams(
            temperature=pick(self.temperature, DEFAULT_TEMPERATURE),
            top_p=pick(self.top_p, 1.0), top_k=pick(self.top_k, 0), min_p=pick(self.min_p, 0.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0), seed=self.seed)

    def _request(self, context_length: int, max_tokens: int | None, logprobs: bool,
                 **prompt) -> GenerateRequest:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if max_tokens is not None and max_tokens > context_length:
            raise InvalidRequestError(
                f"max_tokens is {max_tokens}, but this model's context is {context_length} "
                f"tokens (prompt and reply together)", param="max_tokens")
        # No limit given: as much as the context leaves (the engine stops at its end).
        return GenerateRequest(sampling=self.sampling(), stop=stop,
                               max_tokens=max_tokens if max_tokens is not None else context_length,
                               ignore_eos=bool(self.ignore_eos), logprobs=logprobs, **prompt)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    ONLY = {**_Generation.ONLY, "top_logprobs": (
        (None, 0), "top_logprobs is not supported (only the sampled token's logprob)")}

    def generate_request(self, context_length: int) -> GenerateRequest:
        limit = (self.max_completion_tokens if self.max_completion_tokens is not None
                 else self.max_tokens)
        return self._request(context_length, limit, bool(self.logprobs),
                             messages=[m.as_engine_message() for m in self.messages])


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Generation):
    """``prompt``: one string or one list of token ids (a one-element batch of either is
    accepted too); ``logprobs``: 0 for the sampled token's logprob (no alternatives)."""

    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=1)] | \
        Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    ONLY = {**_Generation.ONLY,
            "logprobs": ((None, 0), "only logprobs=0 is supported (the sampled token's logprob)"),
            "echo": ((None, False), "echo is not supported"),
            "suffix": ((None, ""), "suffix is not supported"),
            "best_of": ((None, 1), "only best_of=1 is supported")}

    def generate_request(self, context_length: int, encode) -> GenerateRequest:
        """``encode(text) -> ids``: a string prompt is fed as its tokens (no chat template)."""
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self._request(context_length, self.max_tokens, self.logprobs is not None,
                             prompt_ids=ids)
