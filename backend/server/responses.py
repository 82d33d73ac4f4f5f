"""OpenAI response bodies and stream chunks, built from the engine's events.

``ChatFormat`` and ``CompletionFormat`` have the same members, so one streaming loop and one
non-streaming collector (``backend/server/app.py``) serve both endpoints: ``first_chunk()``
(chat announces the role), ``chunk(text, logprobs)`` for new text, ``final_chunk(finish)``,
``usage_chunk(done)`` and ``response(text, logprobs, done)``. ``logprobs`` is a list of
``TokenLogprob`` (empty when the request did not ask for them).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from backend.api import DoneEvent


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float


def usage(done: DoneEvent) -> dict:
    """OpenAI's usage object; ``arbor`` adds where cached tokens came from and the speeds."""
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.generated_tokens,
        "total_tokens": done.prompt_tokens + done.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
        "arbor": {
            "cached_by_tier": dict(done.cached_by_tier),
            "restore_s": round(done.restore_s, 6),
            "ttft_s": round(done.ttft_s, 6),
            "prefill_tps": round(done.prefill_tps, 3),
            "decode_tps": round(done.decode_tps, 3),
        },
    }


def sse(payload: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Format:
    object_name: str
    chunk_object_name: str
    id_prefix: str

    def __init__(self, model: str, include_usage: bool = False, logprobs: bool = False) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.logprobs = logprobs

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _chunk(self, choice: dict) -> dict:
        extra = {"usage": None} if self.include_usage else {}
        return self._envelope(self.chunk_object_name, [choice], **extra)

    def usage_chunk(self, done: DoneEvent) -> dict:
        return self._envelope(self.chunk_object_name, [], usage=usage(done))


class ChatFormat(_Format):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict | None:
        if not self.logprobs:
            return None
        return {"content": [{"token": t.token, "logprob": t.logprob,
                             "bytes": list(t.token.encode()), "top_logprobs": []}
                            for t in logprobs]}

    def first_chunk(self) -> dict | None:
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def chunk(self, text: str, logprobs: list[TokenLogprob]) -> dict:
        return self._chunk({"index": 0, "delta": {"content": text},
                            "logprobs": self._logprobs(logprobs), "finish_reason": None})

    def final_chunk(self, finish: str) -> dict:
        return self._chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish})

    def response(self, text: str, logprobs: list[TokenLogprob], done: DoneEvent) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": self._logprobs(logprobs), "finish_reason": done.finish_reason}
        return self._envelope(self.object_name, [choice], usage=usage(done))


class CompletionFormat(_Format):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._streamed = 0  # characters of token text already sent (text_offset of chunks)

    def _logprobs(self, logprobs: list[TokenLogprob], offset: int) -> dict | None:
        if not self.logprobs:
            return None
        offsets = []
        for t in logprobs:
            offsets.append(offset)
            offset += len(t.token)
        return {"tokens": [t.token for t in logprobs],
                "token_logprobs": [t.logprob for t in logprobs],
                "top_logprobs": None, "text_offset": offsets}

    def first_chunk(self) -> dict | None:
        return None

    def chunk(self, text: str, logprobs: list[TokenLogprob]) -> dict:
        choice = {"index": 0, "text": text, "logprobs": self._logprobs(logprobs, self._streamed),
                  "finish_reason": None}
        self._streamed += sum(len(t.token) for t in logprobs)
        return self._chunk(choice)

    def final_chunk(self, finish: str) -> dict:
        return self._chunk({"index": 0, "text": "", "logprobs": None, "finish_reason": finish})

    def response(self, text: str, logprobs: list[TokenLogprob], done: DoneEvent) -> dict:
        choice = {"index": 0, "text": text, "logprobs": self._logprobs(logprobs, 0),
                  "finish_reason": done.finish_reason}
        return self._envelope(self.object_name, [choice], usage=usage(done))
