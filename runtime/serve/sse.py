"""OpenAI response objects and their server-sent-event framing, in mlx_lm.server's shapes.

Chat: `chat.completion` (non-streaming) or a run of `chat.completion.chunk` events whose first
delta carries the role, then content deltas, then one chunk with `finish_reason`, then (if
`stream_options.include_usage`) a chunk with empty `choices` and `usage`, then `data: [DONE]`.
Completions: `text_completion` objects, streamed the same way.

Invariants: every event is `data: <one line of JSON>\\n\\n`; ids, `created` and `model` are the
same on every chunk of one response; usage counts tokens, not characters.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

__all__ = ["ResponseFormat", "sse", "SSE_DONE", "usage"]

SSE_DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


@dataclass
class ResponseFormat:
    """Builds the objects of one response; `kind` is "chat" or "text"."""

    kind: str
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    fingerprint: str = "specmoe"

    def __post_init__(self):
        self.id = self.id or (f"chatcmpl-{uuid.uuid4()}" if self.kind == "chat" else f"cmpl-{uuid.uuid4()}")

    def _base(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, first: bool = False) -> dict:
        """One streamed event: a content delta (or the role, first) and/or the finish reason."""
        if self.kind == "chat":
            delta = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            elif first:
                delta["content"] = ""
            return self._base("chat.completion.chunk",
                              [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])
        return self._base("text_completion",
                          [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}])

    def usage_chunk(self, u: dict) -> dict:
        obj = self._base("chat.completion.chunk" if self.kind == "chat" else "text_completion", [])
        obj["usage"] = u
        return obj

    def complete(self, text: str, finish_reason: str, u: dict) -> dict:
        """The whole non-streaming response."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            obj = self._base("chat.completion", [choice])
        else:
            obj = self._base("text_completion",
                             [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}])
        obj["usage"] = u
        return obj
