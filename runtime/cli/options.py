"""The flags every `specmoe` command shares: one name, one short form, one default, one help text.

Follows mlx-lm's names (`--model`, `--prompt/-p`, `--max-tokens`, `--temp`, `--top-p`, `--top-k`,
`--min-p`, `--seed`, `--system-prompt`, `-p -` for stdin); the deliberate differences are listed
in docs/serve.md (e.g. `-m` is `--model` here, as in the rest of this CLI, and
`--max-tokens` is `-n`).

Invariants: a command that takes a model takes it as `-m/--model` and resolves a hub id through
runtime.checkpoints.resolve_model before its body runs; every option has help text; defaults
come from the constants below, never from literals in a command.
"""

from __future__ import annotations

import sys

import typer

from runtime.checkpoints import resolve_model

__all__ = [
    "DEFAULT_BUDGET", "DEMO_BUDGET", "DEFAULT_MAX_TOKENS", "DEFAULT_NUM_DRAFT", "DEFAULT_SEED", "model_option", "draft_option",
    "budget_option", "max_tokens_option", "temp_option", "top_p_option", "top_k_option", "min_p_option",
    "seed_option", "num_draft_option", "prompt_option", "system_prompt_option", "json_option", "read_prompt",
    "resolve_draft", "pipeline_option", "pipeline_split_option", "pipeline_timeout_option",
    "DEFAULT_THREADS", "MEASURE_TOKENS", "measure_tokens_option",
]

DEFAULT_BUDGET = "auto"  # what RAM allows; every command that pages experts (demo: 40%, to show paging)
DEMO_BUDGET = "40%"
DEFAULT_MAX_TOKENS = 100  # mlx_lm.generate's default; every command's -n/--max-tokens
MEASURE_TOKENS = 32  # tune/sweep: tokens per prompt of one measured setting (a grid of short runs; its own flag)
DEFAULT_THREADS = 4  # loader I/O threads (storage.LoaderConfig's default; no flag: 1, 2 and 8 read within the noise
# of 4, bench/results/loader_threads.txt)
DEFAULT_NUM_DRAFT = 3  # mlx-lm's --num-draft-tokens default; also the tuner's fallback (runtime/tune/settings.py)
DEFAULT_SEED = 0  # reproducible by default (mlx-lm: unseeded)

BUDGET_HELP = "Expert cache size: 6GB, 512MiB, 40% (of the expert bytes) or auto (what RAM allows)."


def _as_typed(text: str) -> str:
    """A model reference as typed: `./models/x` must stay a path (Path() would drop the `./` and leave
    the hub-id-shaped `models/x`); the callback resolves it to a Path."""
    return text


def _resolve(value):
    return resolve_model(value, "--model")


def resolve_draft(value):
    return resolve_model(value, "--draft")


def model_option(required: bool = True, help: str | None = None, resolve: bool = True):
    """`resolve=False` leaves a hub id as typed (the command resolves it, e.g. to also report the id)."""
    return typer.Option(... if required else None, "--model", "-m", callback=_resolve if resolve else None,
                        metavar="PATH|HUB_ID", parser=_as_typed,
                        help=help or "mlx-lm checkpoint directory, a store made by `specmoe convert`, or a "
                                     "Hugging Face id such as mlx-community/Qwen3-30B-A3B-4bit.")


def draft_option(required: bool = False, help: str | None = None):
    return typer.Option(... if required else None, "--draft", callback=resolve_draft, metavar="PATH|HUB_ID",
                        parser=_as_typed,
                        help=help or "Drafter (an mlx-lm model sharing the tokenizer, path or hub id): "
                                     "enables speculative decoding.")


def budget_option(help: str = BUDGET_HELP, default: str = DEFAULT_BUDGET):
    return typer.Option(default, "--budget", "-b", help=help)


def max_tokens_option(help: str = "Maximum number of tokens to generate."):
    """One default everywhere (a command that needs another length has its own flag, e.g. --measure-tokens)."""
    return typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens", "-n", min=1, help=help)


def measure_tokens_option():
    return typer.Option(MEASURE_TOKENS, "--measure-tokens", min=1,
                        help="Tokens to generate per prompt for each measured setting (short runs keep a grid fast).")


def temp_option():
    return typer.Option(0.0, "--temp", min=0.0, help="Sampling temperature; 0 is greedy.")


def top_p_option():
    return typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="Sampling top-p (nucleus mass); 1 disables it.")


def top_k_option():
    return typer.Option(0, "--top-k", min=0, help="Sampling top-k; 0 disables it.")


def min_p_option():
    return typer.Option(0.0, "--min-p", min=0.0, max=1.0, help="Sampling min-p; 0 disables it.")


def seed_option(help: str = "PRNG seed for sampling."):
    return typer.Option(DEFAULT_SEED, "--seed", help=help)


def num_draft_option(default=None, help: str | None = None):
    return typer.Option(default, "--num-draft", "-k", help=help or f"Tokens the drafter proposes per round "
                        f"(K; default: tuned, else {DEFAULT_NUM_DRAFT}).")


def predictor_option():
    return typer.Option(None, "--predictor", help="Expert forecaster for prefetch: none, previous, popularity, spmoe, "
                                                  "oracle (default: tuned, else spmoe).")


def cutoff_option():
    return typer.Option(None, "--cutoff", help="Prefetch for the first L MoE layers (0: no prefetch; default: tuned, "
                                               "else all).")


def policy_option():
    return typer.Option(None, "--policy", help="Cache eviction policy: dlfu (decayed LFU), lfu or lru "
                                               "(default: tuned, else dlfu).")


def pipeline_option(command: str):
    return typer.Option(False, "--pipeline",
                        help="Run as one stage of a pipeline over several processes or Macs; start every rank with "
                             f"`mlx.launch -n N --backend ring -- specmoe {command} ... --pipeline` (--budget is per "
                             "rank" + ("; rank 0 serves HTTP" if command == "serve" else "") + ").")


def pipeline_split_option():
    return typer.Option(None, "--pipeline-split", help="Layers per rank, e.g. 3,5 (default: balanced by bytes).")


def pipeline_timeout_option():
    return typer.Option(300.0, "--pipeline-timeout",
                        help="Seconds a rank waits for any message before it gives up (a server's rank 0 sends "
                             "heartbeats while idle).")


def prompt_option(required: bool = True, default: str | None = None):
    return typer.Option(... if required else default, "--prompt", "-p",
                        help="The prompt text ('-' reads it from stdin).")


def system_prompt_option():
    return typer.Option(None, "--system-prompt", help="System prompt for the chat template.")


def json_option(help: str = "Also write the results as JSON to this path."):
    return typer.Option(None, "--json", help=help)


def read_prompt(prompt: str) -> str:
    """`-p -` reads the prompt from stdin, as mlx_lm.generate does."""
    if prompt != "-":
        return prompt
    text = sys.stdin.read()
    if not text.strip():
        raise ValueError("--prompt -: stdin was empty; expected the prompt text")
    return text
