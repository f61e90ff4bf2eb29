"""`specmoe chat`: a multi-turn streaming REPL, as mlx_lm.chat, on an offloaded model.

Lines typed are user turns; `/reset` starts a new conversation, `/stats` shows the expert cache
and the last reply's numbers, `/help` lists the commands, `/quit` (or end of input) leaves;
Ctrl-C during a reply stops that reply only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from runtime.cli import engine_options as eo
from runtime.cli import options as opt

HELP = "commands: /reset (new conversation), /stats (cache and last reply), /help, /quit (or Ctrl-D)"


def _stats_line(session) -> str:
    s = session.backend.stats()
    cache, io = s["expert_cache"], s["io"]
    hit = "-" if cache["hit_rate"] is None else f"{cache['hit_rate']:.1%}"
    line = (f"turns {session.turns} | expert cache hit rate {hit}, {cache['misses']} misses, "
            f"{io['bytes_read'] / 1e6:.1f} MB read | prompt tokens reused {s['requests']['cached_prompt_tokens']}")
    last = s.get("last_request")
    if last:
        line += (f" | last reply: {last['generation_tokens']} tokens, {last['generation_tps']:.1f} tok/s, "
                 f"prompt {last['prompt_tokens']} tokens")
        if last.get("acceptance") is not None:
            line += f", acceptance {last['acceptance']:.0%}"
    return line


def run_repl(session, lines, out=sys.stdout, prompt: str = ">> ") -> None:
    """Drive `session` from an iterator of input lines (stdin in the CLI, a list in tests)."""
    out.write(f"[{HELP}]\n")
    while True:
        out.write(prompt)
        out.flush()
        line = next(lines, None)
        if line is None:
            out.write("\n")
            return
        text = line.rstrip("\n")
        command = text.strip()
        if not command:
            continue
        if command in ("/quit", "/exit"):
            return
        if command == "/reset":
            session.reset()
            out.write("[conversation reset]\n")
            continue
        if command == "/stats":
            out.write(_stats_line(session) + "\n")
            continue
        if command == "/help":
            out.write(HELP + "\n")
            continue
        if command.startswith("/"):
            out.write(f"unknown command {command}; {HELP}\n")
            continue
        try:
            for segment in session.say(text):
                out.write(segment)
                out.flush()
        except KeyboardInterrupt:  # Ctrl-C stops the reply, not the session (the shown part stays in the history)
            out.write(" [interrupted]")
        out.write("\n")


def register(app: typer.Typer) -> None:
    @app.command()
    def chat(
        model: Path = opt.model_option(),
        draft: Path = opt.draft_option(),
        budget: str = opt.budget_option(),
        system_prompt: str = opt.system_prompt_option(),
        max_tokens: int = opt.max_tokens_option(help="Maximum number of tokens per reply."),
        temp: float = opt.temp_option(),
        top_p: float = opt.top_p_option(),
        top_k: int = opt.top_k_option(),
        min_p: float = opt.min_p_option(),
        seed: int = opt.seed_option(),
        num_draft: int = opt.num_draft_option(),
        predictor: str = opt.predictor_option(),
        cutoff: int = opt.cutoff_option(),
        policy: str = opt.policy_option(),
        io_mode: str = eo.io_mode_option(),
        governor: bool = eo.governor_option(),
        memory_limit: str = eo.memory_limit_option(),
        kv_bits: int = eo.kv_bits_option(),
    ):
        """Chat with the model: multi-turn, streaming, the prompt cache reused across turns."""
        from runtime.serve import Backend, ChatSession

        engine = eo.load_engine(model, budget=budget, draft=draft, num_draft=num_draft, predictor=predictor,
                                cutoff=cutoff, policy=policy, io_mode=io_mode, governor=governor,
                                memory_limit=memory_limit, kv_bits=kv_bits)
        try:
            sampling = dict(max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
            backend = Backend(engine, prompt_cache_size=1, kv_bits=kv_bits)
            session = ChatSession(backend, sampling, system_prompt)
            run_repl(session, iter(sys.stdin.readline, ""), sys.stdout)
        finally:
            engine.close()
