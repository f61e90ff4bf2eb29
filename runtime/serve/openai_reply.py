"""The OpenAI chat reply with reasoning and tool calls, in mlx_lm.server's shape.

A chat reply's text goes through a ReplySplitter: answer text becomes `content`, thinking text
`reasoning` (and `reasoning_content`, the name other OpenAI-compatible servers and editors read),
parsed tool calls `tool_calls` ([{"id", "type": "function", "function": {"name", "arguments":
JSON string}}], streamed as deltas with an `index`). A reply that made a tool call and stopped
on its own finishes with "tool_calls", as mlx_lm.server's does. Text completions pass through.

Invariants: a reply without markers gives exactly the chunks and the message the plain text
route gave before (same content, same finish_reason); a streamed reply's content, reasoning and
tool calls concatenate to the non-streamed message's; `content` is null only when the reply is
tool calls without text.
"""

from __future__ import annotations

import json

from runtime.serve.reply_split import ReplySplitter, Segment
from runtime.serve.sse import ResponseFormat

__all__ = ["ChatReply"]


class ChatReply:
    def __init__(self, fmt: ResponseFormat, splitter: ReplySplitter | None):
        self.fmt, self.splitter = fmt, splitter  # splitter None: a text completion, passed through
        self.n_calls = 0

    @classmethod
    def for_request(cls, fmt: ResponseFormat, tokenizer, request, ids: list[int]) -> ChatReply:
        if request.kind != "chat" or tokenizer is None:
            return cls(fmt, None)
        return cls(fmt, ReplySplitter(tokenizer, ids, getattr(request, "tools", None)))

    def finish_reason(self, finish_reason: str) -> str:
        made_call = self.splitter is not None and self.splitter.n_tool_calls > 0
        return "tool_calls" if made_call and finish_reason == "stop" else finish_reason

    # -- streaming ----------------------------------------------------------------------------
    def chunks(self, text: str) -> list[dict]:
        if self.splitter is None:
            return [self.fmt.chunk(text)]
        return self._deltas(self.splitter.feed(text))

    def final_chunks(self, finish_reason: str) -> list[dict]:
        """The held-back text (if any), then the chunk with the finish reason."""
        out = [] if self.splitter is None else self._deltas(self.splitter.finish())
        return out + [self.fmt.chunk(None, self.finish_reason(finish_reason))]

    def _deltas(self, segments: list[Segment]) -> list[dict]:
        out = []
        for s in segments:
            chunk = self.fmt.chunk(s.text if s.kind == "text" else None)
            delta = chunk["choices"][0]["delta"]
            if s.kind == "reasoning":
                delta["reasoning"] = delta["reasoning_content"] = s.text
            elif s.kind == "tool_call":
                delta["tool_calls"] = [{"index": self.n_calls, **_call(s.call)}]
                self.n_calls += 1
            out.append(chunk)
        return out

    # -- whole reply ----------------------------------------------------------------------------
    def complete(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.splitter is None:
            return self.fmt.complete(text, finish_reason, usage)
        segments = self.splitter.feed(text) + self.splitter.finish()
        answer = "".join(s.text for s in segments if s.kind == "text")
        reasoning = "".join(s.text for s in segments if s.kind == "reasoning")
        calls = [_call(s.call) for s in segments if s.kind == "tool_call"]
        obj = self.fmt.complete(answer, self.finish_reason(finish_reason), usage)
        message = obj["choices"][0]["message"]
        if reasoning:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
            message["content"] = answer or None
        return obj


def _call(call) -> dict:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
