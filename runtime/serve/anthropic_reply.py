"""Anthropic Messages API replies: the `message` object and its server-sent event sequence.

Non-streaming: {"id": "msg_...", "type": "message", "role": "assistant", "model", "content":
[blocks], "stop_reason", "stop_sequence", "usage"}, with blocks {"type": "thinking", "thinking",
"signature": ""}, {"type": "text", "text"} and {"type": "tool_use", "id", "name", "input"}.

Streaming, as the official clients accumulate it:
    event: message_start        {"message": the object above with empty content, no stop_reason}
    event: ping
    event: content_block_start  {"index", "content_block": an empty thinking/text/tool_use block}
    event: content_block_delta  {"index", "delta": thinking_delta | text_delta | input_json_delta}
    event: content_block_stop   {"index"}
    ... (one start/deltas/stop run per block, in order)
    event: message_delta        {"delta": {"stop_reason", "stop_sequence"}, "usage"}
    event: message_stop
A ping is also sent while the prompt is being processed and nothing else is due.

stop_reason: "max_tokens" (length), "stop_sequence" (one of the request's stop_sequences, named
in stop_sequence), "tool_use" (the reply made a tool call and ended), else "end_turn". usage:
input_tokens (the prompt less what the prompt cache held), cache_read_input_tokens (what it
held), output_tokens. Thinking blocks carry an empty signature: nothing here signs them.

Invariants: the blocks of a streamed reply equal the non-streamed reply's for the same text;
every started block is stopped before the next starts and before message_delta; block indices
count from 0 without gaps.
"""

from __future__ import annotations

import json
import uuid

from runtime.serve.reply_split import ReplySplitter, Segment

__all__ = ["MessageReply", "sse_event", "usage_of", "stop_reason"]


def sse_event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, separators=(',', ':'))}\n\n"


def usage_of(prompt_tokens: int, output_tokens: int, cached_tokens: int | None) -> dict:
    cached = cached_tokens or 0
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop_reason(finish_reason: str, stop_sequence: str | None, n_tool_calls: int) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if n_tool_calls else "end_turn"


class MessageReply:
    """One reply to /v1/messages: `start`, then `feed` per text event, then `finish` (streaming); or
    `message` for the whole reply."""

    def __init__(self, model: str, splitter: ReplySplitter, prompt_tokens: int):
        self.model, self.splitter, self.prompt_tokens = model, splitter, prompt_tokens
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self._open: str | None = None  # the kind of the block being streamed
        self._index = -1  # its index

    def _skeleton(self, content: list, usage: dict, reason: str | None = None, sequence: str | None = None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage}

    # -- whole reply --------------------------------------------------------------------------------
    def message(self, text: str, done) -> dict:
        """The reply to a non-streaming request; `done` is the queue's "done" JobEvent."""
        segments = self.splitter.feed(text) + self.splitter.finish()
        blocks: list[dict] = []
        for s in segments:
            if s.kind == "tool_call":
                blocks.append({"type": "tool_use", "id": s.call.id, "name": s.call.name, "input": s.call.arguments})
            elif blocks and blocks[-1]["type"] == _BLOCK[s.kind]:
                blocks[-1][_FIELD[s.kind]] += s.text
            else:
                blocks.append(_empty(s.kind) | {_FIELD[s.kind]: s.text})
        reason = stop_reason(done.finish_reason, done.stop_sequence, self.splitter.n_tool_calls)
        return self._skeleton(blocks, usage_of(done.prompt_tokens, done.completion_tokens, done.cached_tokens),
                              reason, done.stop_sequence)

    # -- streaming ----------------------------------------------------------------------------------
    def start(self) -> list[str]:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        return [sse_event("message_start", {"message": self._skeleton([], usage)}), sse_event("ping", {})]

    def feed(self, text: str) -> list[str]:
        return self._events(self.splitter.feed(text))

    def finish(self, done) -> list[str]:
        out = self._events(self.splitter.finish()) + self._close()
        reason = stop_reason(done.finish_reason, done.stop_sequence, self.splitter.n_tool_calls)
        usage = usage_of(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
        out.append(sse_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": done.stop_sequence},
                                               "usage": usage}))
        out.append(sse_event("message_stop", {}))
        return out

    def _events(self, segments: list[Segment]) -> list[str]:
        out: list[str] = []
        for s in segments:
            if s.kind == "tool_call":
                out += self._close()
                self._index += 1
                block = {"type": "tool_use", "id": s.call.id, "name": s.call.name, "input": {}}
                out.append(sse_event("content_block_start", {"index": self._index, "content_block": block}))
                delta = {"type": "input_json_delta", "partial_json": json.dumps(s.call.arguments, ensure_ascii=False)}
                out.append(sse_event("content_block_delta", {"index": self._index, "delta": delta}))
                out.append(sse_event("content_block_stop", {"index": self._index}))
                continue
            if self._open != s.kind:
                out += self._close()
                self._index += 1
                self._open = s.kind
                out.append(sse_event("content_block_start", {"index": self._index, "content_block": _empty(s.kind)}))
            delta = {"type": f"{_FIELD[s.kind]}_delta", _FIELD[s.kind]: s.text}
            out.append(sse_event("content_block_delta", {"index": self._index, "delta": delta}))
        return out

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [sse_event("content_block_stop", {"index": self._index})]


_BLOCK = {"reasoning": "thinking", "text": "text"}  # segment kind -> block type
_FIELD = {"reasoning": "thinking", "text": "text"}  # segment kind -> the block's text field (and delta type)


def _empty(kind: str) -> dict:
    return {"type": "thinking", "thinking": "", "signature": ""} if kind == "reasoning" else {"type": "text", "text": ""}
