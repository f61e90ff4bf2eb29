"""A multi-turn conversation on one Backend: what `specmoe chat` drives.

Each turn appends the user message, encodes the whole history with the chat template and
streams the reply; the backend's prompt cache holds the previous turns' KV, so only the new
tokens are prefilled.

Invariants: the history only ever holds complete turns (a reply interrupted by Ctrl-C is kept
as far as it was shown, so the transcript matches the screen); `reset` forgets the history but
keeps the system prompt; turn statistics are those of the last reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from runtime.serve.validation import CompletionRequest

__all__ = ["ChatSession"]


@dataclass
class ChatSession:
    backend: object  # runtime.serve.Backend
    sampling: dict  # max_tokens, temperature, top_p, top_k, min_p, seed
    system_prompt: str | None = None
    history: list[dict] = field(default_factory=list)
    last: object = None  # the last reply's final response (its .stats)
    turns: int = 0

    def messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + self.history

    def reset(self) -> None:
        self.history.clear()
        self.turns = 0
        self.backend.reset_prompt_cache()

    def say(self, text: str) -> Iterator[str]:
        """Stream the reply to `text` as text segments; the history gets both turns."""
        self.history.append({"role": "user", "content": text})
        request = CompletionRequest(kind="chat", model=None, messages=self.messages(), **self.sampling)
        ids = self.backend.encode(request)
        reply = []
        try:
            for response in self.backend.stream(ids, request):
                self.last = response
                if response.text:
                    reply.append(response.text)
                    yield response.text
        finally:
            self.history.append({"role": "assistant", "content": "".join(reply)})
            self.turns += 1
