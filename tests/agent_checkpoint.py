"""A tiny checkpoint whose tokenizer speaks like Qwen3 to agents: tools, <tool_call> and <think>.

The embedded target's weights (copied: the store refuses files that resolve outside the model
directory; ~6 MB) with its tokenizer edited: a Qwen3-style chat
template that renders tools, assistant tool calls, tool results (<tool_response>) and the
enable_thinking switch; and "<think>" / "</think>" as single tokens, in place of the tokenizer's
last two BPE merges (their ids are in the model's vocabulary, so the model can emit them). mlx-lm
then infers its `json_tools` parser from the template and the <think> markers from the vocabulary,
as it does for a real Qwen3 checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from runtime.checkpoints import embedded_pair

__all__ = ["agent_checkpoint", "TEMPLATE"]

TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    '\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content }}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""


def agent_checkpoint(root: Path) -> Path:
    """Write the checkpoint under `root` and return its directory."""
    src, out = embedded_pair().target, root / "agent-target"
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f, out / f.name)
    tok = json.loads((src / "tokenizer.json").read_text())
    model = tok["model"]
    freed = []
    for _ in range(2):  # the last merges' products: no other merge builds on them
        a, b = model["merges"].pop()
        freed.append(model["vocab"].pop(a + b))
    for token, token_id in zip(("</think>", "<think>"), freed):
        tok["added_tokens"].append({"id": token_id, "content": token, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    (out / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out
