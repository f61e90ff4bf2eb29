"""`generate`, `chat` and `serve` take one set of engine flags (runtime/cli/engine_options.py): same names,
defaults and help text in all three, and the same one-line errors for bad values."""

from __future__ import annotations

import typer.main

from runtime.cli.app import app
from tests.conftest import run_cli

ENGINE_FLAGS = ["--one-sync", "--io-mode", "--threads", "--memory-governor", "--memory-limit", "--kv-bits", "--seed",
                "--budget", "--draft", "--num-draft", "--predictor", "--cutoff", "--policy"]


def _options(name: str) -> dict:
    command = typer.main.get_command(app).commands[name]
    return {p.opts[0]: p for p in command.params if p.param_type_name == "option"}


def test_generate_chat_and_serve_share_the_engine_flags():
    commands = {name: _options(name) for name in ("generate", "chat", "serve")}
    for flag in ENGINE_FLAGS:
        params = [commands[name].get(flag) for name in commands]
        assert all(p is not None for p in params), (flag, [name for name, p in zip(commands, params) if p is None])
        assert len({p.default for p in params}) == 1, (flag, [p.default for p in params])
        if flag != "--seed":  # serve's --seed says it seeds once at start-up
            assert len({p.help for p in params}) == 1, (flag, [p.help for p in params])


def test_bad_engine_flag_values_are_one_line_errors(tiny_qwen):
    for command in ("chat", "serve"):
        code, _, err = run_cli([command, "-m", str(tiny_qwen), "--kv-bits", "7"])
        assert code == 2 and err.strip() == "specmoe: error: --kv-bits 7; expected 4 or 8 (mlx-lm also takes 2, 3, 5, 6)"
        code, _, err = run_cli([command, "-m", str(tiny_qwen), "--one-sync", "maybe"])
        assert code == 2 and err.strip() == "specmoe: error: --one-sync 'maybe'; expected auto, on or off"
