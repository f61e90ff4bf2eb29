"""A reply's text split into reasoning, answer text and tool calls, with mlx-lm's own machinery.

The split is mlx_lm.server's: `mlx_lm.generate.make_text_state_machine` (the tokenizer's
thinking markers, e.g. Qwen3's <think>...</think>, and its tool-call markers, e.g. <tool_call>)
strips the markers and says which state each piece of text belongs to; the text of a closed tool
block goes to the tokenizer's tool parser (`TokenizerWrapper.tool_parser`, one of
`mlx_lm.tool_parsers`, chosen by mlx-lm from the chat template). A reply starts in the reasoning
state when the prompt opened a thinking block it did not close (templates that prefill <think>),
as mlx_lm.server decides it. Nothing here parses a tool-call format itself.

Invariants: every character of the reply outside the markers is returned exactly once, in order,
as reasoning or answer text or inside a tool call's text (with one exception, stated: the
whitespace between a closed thinking block or tool call and the answer text after it is dropped,
so an answer does not start with the blank lines the template puts there); text held back
because it may start a marker is released by `finish`; a tool call the parser rejects (e.g. cut
off by max_tokens) is returned as answer text, not lost; a reply without any markers comes back
as the same text, unchanged.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field

__all__ = ["Segment", "ToolCall", "ReplySplitter", "initial_state"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call."""

    name: str  # the function/tool name the model called
    arguments: dict  # its arguments, a JSON object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")  # for the result to refer to


@dataclass(frozen=True)
class Segment:
    kind: str  # "reasoning", "text" or "tool_call"
    text: str = ""  # reasoning or answer text
    call: ToolCall | None = None  # kind "tool_call"


def initial_state(tokenizer, ids: list[int]) -> str:
    """"reasoning" when the prompt ends inside an open thinking block, else "normal" (mlx_lm.server's rule)."""
    state = "normal"
    if getattr(tokenizer, "has_thinking", False):
        if tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids):
            state = "reasoning"
    return getattr(tokenizer, "response_initial_state", None) or state


class ReplySplitter:
    """Feed the reply's text as it streams; get Segments back. `tools=None`: tool calls are not parsed
    (a request without tools, or with tool_choice "none"): their text stays answer text."""

    def __init__(self, tokenizer, ids: list[int], tools: list[dict] | None = None):
        from mlx_lm.generate import TextStateMachine, make_text_state_machine

        self._sm = TextStateMachine
        self.parse_tools = bool(tools) and getattr(tokenizer, "has_tool_calling", False)
        if tools and not self.parse_tools:  # as mlx_lm.server: the template saw the tools; calls stay text
            log.warning("the request has tools, but mlx-lm knows no tool-call format for this model's tokenizer; "
                        "its replies are returned as text")
        self.tools = tools
        self._parser = tokenizer.tool_parser if self.parse_tools else None
        self._start, self._end = (tokenizer.tool_call_start, tokenizer.tool_call_end) if self.parse_tools else ("", "")
        machine = make_text_state_machine(_Markers(tokenizer, self.parse_tools))
        first = initial_state(tokenizer, ids)
        self._state = machine.make_state(first)
        self._prev = first
        self._tool_text = ""
        self._after_block = False  # the last text closed a thinking block or a tool call
        self.n_tool_calls = 0

    def feed(self, text: str) -> list[Segment]:
        self._state, pieces = self._sm.split(self._state, text)
        return self._segments(pieces)

    def finish(self) -> list[Segment]:
        """What is left at the end of the reply: held-back text, and an unclosed tool block (parsed if it
        parses: some formats end a call without an end marker)."""
        self._state, rest, current = self._sm.flush(self._state)
        out = self._segments([(current, rest)])
        if self._tool_text:
            out += self._close_tool(final=True)
        return out

    def _segments(self, pieces) -> list[Segment]:
        out: list[Segment] = []
        for state, text in pieces:
            if self._prev == "tool" and state != "tool":
                out += self._close_tool(final=False)
            if state == "reasoning":
                if text:
                    out.append(Segment("reasoning", text))
                self._after_block = True
            elif state == "tool":
                self._tool_text += text
            else:
                if self._after_block:
                    text = text.lstrip()
                if text:
                    out.append(Segment("text", text))
                    self._after_block = False
            self._prev = state if state is not None else self._prev
        return out

    def _close_tool(self, *, final: bool) -> list[Segment]:
        text, self._tool_text = self._tool_text, ""
        self._after_block = True
        try:
            parsed = self._parser(text, self.tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            out = [Segment("tool_call", call=_tool_call(c)) for c in calls]
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
            log.warning("a tool call did not parse (%s: %s)%s; returned as text", type(e).__name__, e,
                        ", probably cut off by max_tokens" if final else "")
            return [Segment("text", self._start + text + ("" if final else self._end))]
        self.n_tool_calls += len(out)
        return out


def _tool_call(parsed) -> ToolCall:
    """A parser's {"name", "arguments"} (arguments a dict, or a JSON string of one) as a ToolCall."""
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        raise ValueError(f"expected {{'name': str, 'arguments': {{...}}}}, got {parsed!r:.200}")
    args = parsed.get("arguments", {})
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError(f"tool arguments must be a JSON object, got {args!r:.200}")
    return ToolCall(parsed["name"], args, parsed.get("id") or f"call_{uuid.uuid4().hex[:24]}")


class _Markers:
    """The tokenizer as make_text_state_machine reads it, with tool calling switched off when the
    request has no tools (their markers then stay in the answer text)."""

    def __init__(self, tokenizer, tools: bool):
        self._tok, self.has_tool_calling = tokenizer, tools
        self.has_thinking = getattr(tokenizer, "has_thinking", False)

    def __getattr__(self, name):
        return getattr(self._tok, name)
