"""One CLI with mlx-lm's habits: the same flags everywhere, -h, --version, help on every flag,
plain --x/--no-x booleans, `-p -`, --system-prompt, `info` exit codes, progress off a terminal."""

from __future__ import annotations

import io
import json

from runtime.cli import options as opt
from runtime.cli.app import command
from tests.conftest import run_cli


def _commands():
    def walk(c, path=()):
        if hasattr(c, "commands"):
            for name, sub in c.commands.items():
                yield from walk(sub, path + (name,))
        else:
            yield path, c

    return list(walk(command()))


COMMANDS = _commands()
SHARED = {  # long flag -> (all its flags, None or the set of allowed defaults)
    "--model": (["--model", "-m"], None),
    "--budget": (["--budget", "-b"], {opt.DEFAULT_BUDGET}),
    "--num-draft": (["--num-draft", "-k"], {None, opt.DEFAULT_NUM_DRAFT}),  # None: tuned, else the default
    "--max-tokens": (["--max-tokens", "-n"], {opt.DEFAULT_MAX_TOKENS}),  # other lengths have their own flags
    "--temp": (["--temp"], {0.0}),
    "--top-p": (["--top-p"], {1.0}),
    "--top-k": (["--top-k"], {0}),
    "--min-p": (["--min-p"], {0.0}),
    "--seed": (["--seed"], {opt.DEFAULT_SEED}),
    "--draft": (["--draft"], {None}),
    "--prompt": (["--prompt", "-p"], None),
}
DELIBERATE = {("demo", "--budget"), ("info", "--budget")}  # demo pages at 40% on purpose; info: only if asked


def test_every_command_has_help_on_every_flag_and_no_bool_placeholder():
    assert len(COMMANDS) >= 14
    for path, cmd in COMMANDS:
        code, out, err = run_cli([*path, "-h"])
        assert code == 0, (path, err)
        assert "<bool>" not in out and "Usage: specmoe " + " ".join(path) in out, out
        for p in cmd.params:
            if p.param_type_name == "option" and not p.hidden:
                assert p.help, (path, p.opts)
        assert not [p.name for p in cmd.params if p.param_type_name == "argument"], path  # no positional models
    code, out, _ = run_cli(["generate", "-h"])
    assert "--verify / --no-verify" in out and "--memory-governor / --no-memory-governor" in out


def test_shared_flags_have_one_name_one_short_form_one_default():
    seen = set()
    for path, cmd in COMMANDS:
        for p in cmd.params:
            long = p.opts[0] if p.param_type_name == "option" else None
            if long in SHARED:
                flags, defaults = SHARED[long]
                assert p.opts == flags, (path, p.opts)
                if defaults is not None and (path[0], long) not in DELIBERATE:
                    assert p.default in defaults, (path, long, p.default)
                seen.add(long)
            assert not {"--draft-len", "--draft-model", "--top-k"} & set(p.opts) or long == "--top-k", (path, p.opts)
    assert seen == set(SHARED)
    for path, cmd in COMMANDS:  # -k is only ever the draft length, -m only ever the model
        for p in cmd.params:
            if "-k" in p.opts:
                assert p.opts[0] == "--num-draft", path
            if "-m" in p.opts:
                assert p.opts[0] == "--model", path
    for path, command_ in COMMANDS:  # capped the same way wherever it is taken (one option factory)
        for p in command_.params:
            if p.opts[0] == "--max-tokens":
                assert p.min == 1, path
    plan = dict(COMMANDS)[("plan",)]
    assert [p.opts for p in plan.params if p.name == "draft_len"] == [["--num-draft", "-k"]]
    assert [p.default for p in plan.params if p.name == "draft_len"] == [opt.DEFAULT_NUM_DRAFT]


def test_version_and_short_help():
    code, out, _ = run_cli(["--version"])
    assert code == 0 and out.startswith("specmoe ")
    code, out, _ = run_cli(["-h"])
    assert code == 0 and "serve" in out and "chat" in out


def test_prompt_from_stdin_and_system_prompt(tiny_dirs, tmp_path, monkeypatch):
    model = str(tiny_dirs["qwen3_moe"])
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    assert run_cli(["generate", "-m", model, "-p", "The quick brown fox", "-n", "4", "--json", str(a)])[0] == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("The quick brown fox"))
    assert run_cli(["generate", "-m", model, "-p", "-", "-n", "4", "--json", str(b)])[0] == 0
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    assert ra["tokens"] == rb["tokens"] and ra["stats"]["prompt_tokens"] == rb["stats"]["prompt_tokens"]
    assert run_cli(["generate", "-m", model, "-p", "The quick brown fox", "-n", "4", "--system-prompt",
                    "You are terse.", "--json", str(c)])[0] == 0
    assert json.loads(c.read_text())["stats"]["prompt_tokens"] > ra["stats"]["prompt_tokens"]
    monkeypatch.setattr("sys.stdin", io.StringIO("   "))
    code, _, err = run_cli(["generate", "-m", model, "-p", "-", "-n", "4"])
    assert code == 2 and "--prompt -: stdin was empty" in err


def test_info_exits_2_on_an_unsupported_model_after_the_facts(tiny_qwen):
    code, out, err = run_cli(["info", "-m", str(tiny_qwen)])
    assert code == 0 and "supported" in out
    cfg = json.loads((tiny_qwen / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tiny_qwen / "config.json").write_text(json.dumps(cfg))
    code, out, err = run_cli(["info", "-m", str(tiny_qwen)])
    assert code == 2 and "False" in out and "unsupported model_type 'llama'" in err and "Traceback" not in err


def test_line_progress_prints_periodically_and_at_the_end():
    from rich.console import Console

    from runtime.observe import LineProgress

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    with LineProgress(console, every_s=0.05) as bar:
        task = bar.add_task("calibrating", total=10)
        import time

        for _ in range(5):
            bar.advance(task, 2)
            time.sleep(0.06)
    lines = buf.getvalue().splitlines()
    assert len(lines) >= 3 and all(l.startswith("calibrating: ") for l in lines)
    assert lines[-1].startswith("calibrating: 10/10 (100%), done")


def test_long_steps_print_progress_lines_off_a_terminal(calibrated):
    code, err = calibrated["code"], calibrated["err"]  # `specmoe calibrate`, run once for the session
    assert code == 0, err
    assert any(l.startswith("calibrating: ") and ", done," in l for l in err.splitlines()), err
