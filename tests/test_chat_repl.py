"""`specmoe chat` driven through stdin: multi-turn replies equal fresh generations of the same
history, /stats reports, /reset starts over, end of input leaves cleanly."""

from __future__ import annotations

import subprocess
import sys

from runtime.checkpoints import embedded_pair
from tests.serve_process import ROOT, cli_env

N = 8


def _expected_replies(target, turns: list[str]) -> list[str]:
    """Each reply generated from scratch on the whole history (no prompt cache)."""
    from runtime import load, stream_generate

    history, replies = [], []
    with load(target) as engine:
        for text in turns:
            history.append({"role": "user", "content": text})
            ids = list(engine.tokenizer.apply_chat_template(history, add_generation_prompt=True))
            reply = "".join(r.text for r in stream_generate(engine, ids, N, temp=0.0))
            history.append({"role": "assistant", "content": reply})
            replies.append(reply)
    return replies


def test_chat_repl_multi_turn_stats_reset():
    target = embedded_pair().target
    turns = ["Enter the king.", "What says the queen?"]
    stdin = f"{turns[0]}\n{turns[1]}\n/stats\n/reset\n{turns[0]}\n/nonsense\n"
    proc = subprocess.run([sys.executable, "-m", "runtime.cli.app", "chat", "-m", str(target), "-n", str(N)],
                          input=stdin, capture_output=True, text=True, cwd=ROOT, env=cli_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    first, second = _expected_replies(target, turns)
    chunks = out.split(">> ")
    assert chunks[1] == first + "\n" and chunks[2] == second + "\n"  # streamed replies, one per turn
    assert chunks[3].startswith("turns 2 | expert cache hit rate") and "last reply: " in chunks[3]
    reused = int(chunks[3].split("prompt tokens reused ")[1].split(" ")[0])
    assert reused > 15  # the second turn re-used the first turn's KV (its 15-token prompt and more)
    assert chunks[4] == "[conversation reset]\n"
    assert chunks[5] == first + "\n"  # a fresh conversation answers as the first did
    assert chunks[6].startswith("unknown command /nonsense")
    assert chunks[-1] == "\n"  # end of input: a clean exit


def test_ctrl_c_stops_a_reply_not_the_session():
    import io

    from runtime.cli.chat import run_repl

    class Session:
        turns = 0

        def say(self, text):
            yield "partial"
            raise KeyboardInterrupt

    out = io.StringIO()
    run_repl(Session(), iter(["hello\n", "again\n"]), out)
    assert out.getvalue().count("partial [interrupted]\n") == 2 and out.getvalue().endswith(">> \n")
