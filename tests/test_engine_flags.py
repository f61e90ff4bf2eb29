"""`generate`, `chat` and `serve` take one set of engine flags (runtime/cli/engine_options.py): same names,
defaults and help text in all three, and the same one-line errors for bad values. The decode levers taken out
of main for want of a measured win (docs/flags.md, "Taken out of main") are no flag of any command."""

from __future__ import annotations

import typer.main

from runtime.cli.app import app
from tests.conftest import run_cli

ENGINE_FLAGS = ["--io-mode", "--memory-governor", "--memory-limit", "--kv-bits", "--seed",
                "--budget", "--draft", "--num-draft", "--predictor", "--cutoff", "--policy"]
REMOVED = ["--one-sync", "--fixed-k", "--adaptive-k", "--warm", "--max-prefetch-mb", "--threads"]
COMMANDS = {"generate": ["-p", "hi"], "chat": [], "serve": [], "tune": ["--draft", ".", "--prompts", "p"]}


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


def test_the_removed_decode_flags_are_refused_by_every_command(tiny_qwen):
    """Each is a one-line usage error naming it (exit 2), and no --help lists it."""
    for command, rest in COMMANDS.items():
        names = {n for p in typer.main.get_command(app).commands[command].params if p.param_type_name == "option"
                 for n in p.opts + p.secondary_opts}
        assert not names & set(REMOVED), (command, names & set(REMOVED))
        for flag in REMOVED:
            value = [] if flag in ("--fixed-k", "--adaptive-k") else ["1"]
            code, _, err = run_cli([command, "-m", str(tiny_qwen), *rest, flag, *value])
            line = err.strip()  # click may add "(Possible options: ...)" for a near name
            assert code == 2 and "\n" not in line and line.startswith(f"specmoe: error: No such option: {flag} ") \
                and line.endswith(f"(see `specmoe {command} -h`)"), (command, flag, err)


def test_kv_bits_on_a_head_dim_mlx_lm_cannot_group_is_refused_before_the_prefill():
    """The embedded target's head_dim is 32; mlx-lm's quantized KV cache groups values in 64s from its 5000th token
    (bench/results/kv_bits.txt measures --kv-bits on a head_dim-64 model). A run that would get there is one line,
    exit 2, before any token; a shorter run is not quantized and is not refused."""
    from runtime.checkpoints.embedded import embedded_pair

    target = str(embedded_pair().target)
    base = ["generate", "-m", target, "--raw-prompt", "--budget", "100%", "--kv-bits", "8"]
    code, out, err = run_cli(base + ["-p", " ".join(["word"] * 5200), "-n", "4"])
    assert code == 2 and out == "" and "this model's head_dim is 32" in err, err
    assert err.strip().splitlines()[-1].startswith("specmoe: error: kv_bits 8 with ")
    code, out, err = run_cli(base + ["-p", "hello there", "-n", "4"])
    assert code == 0, err


def test_serve_refuses_kv_bits_its_context_would_break_before_loading(tmp_path):
    """serve answers requests up to the model's context: with a head_dim mlx-lm's quantized KV cache cannot group
    and a context past its 5000th token, --kv-bits is one line, exit 2, before the port is bound or the model loads
    (a long request would otherwise fail mid-reply)."""
    import json
    import shutil

    from runtime.checkpoints.embedded import embedded_pair

    model = tmp_path / "long-context"
    shutil.copytree(embedded_pair().target, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (model / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli(["serve", "-m", str(model), "--kv-bits", "8", "--port", "0"])
    line = err.strip()
    assert code == 2 and out == "" and "\n" not in line, err
    assert line.startswith("specmoe: error: --kv-bits 8: requests up to the context length would fail"), line
    assert "head_dim is 32" in line and "--max-prompt-tokens" in line, line
