"""A live `specmoe serve` process whose next reply a test can steer, and whose prompts it can read.

    python -m tests.steered_server FORCE_FILE PROMPT_LOG serve -m MODEL ...

Steering goes through the real sampler: runtime.api's `make_sampler` is wrapped so that, when
FORCE_FILE holds a JSON list of token ids, the next request's sampler adds a mask that leaves
only the forced token at each step (then calls mlx-lm's sampler on the masked log-probabilities),
and the file is consumed. Every prompt the backend generates for is appended to PROMPT_LOG as a
JSON list of ids, so a test sees exactly what the chat template rendered.

`steered_serve(model, tmp, *args)` starts one (on a free 127.0.0.1 port, waited for until /health
answers, always terminated) and yields a `Steering` handle: `.force(ids)`, `.prompts()`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.serve_process import ROOT, cli_env, end_process, free_port, wait_for_health


@dataclass
class Steering:
    base: str  # http://127.0.0.1:PORT
    force_file: Path
    prompt_log: Path

    def force(self, ids: list[int]) -> None:
        """The next generation emits exactly `ids` (then stops, if they end with EOS)."""
        tmp = self.force_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(ids))
        os.replace(tmp, self.force_file)

    def prompts(self) -> list[list[int]]:
        if not self.prompt_log.exists():
            return []
        return [json.loads(line) for line in self.prompt_log.read_text().splitlines() if line]


@contextmanager
def steered_serve(model: Path, tmp: Path, *args: str, startup_s: float = 240.0):
    port = free_port()
    steering = Steering(f"http://127.0.0.1:{port}", tmp / "force.json", tmp / "prompts.jsonl")
    log_path = tmp / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.steered_server", str(steering.force_file),
                             str(steering.prompt_log), "serve", "-m", str(model), *args, "--port", str(port)],
                            cwd=ROOT, env=cli_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_health(steering.base, proc, log_path, startup_s, "specmoe serve (steered)")
        yield steering
    finally:
        end_process(proc, log)


def _install(force_file: Path, prompt_log: Path) -> None:
    import mlx.core as mx

    import runtime.api as api
    from runtime.serve.backend import Backend

    real_make_sampler = api.make_sampler

    def make_sampler(**kwargs):
        sampler = real_make_sampler(**kwargs)
        try:
            forced = json.loads(force_file.read_text())
            force_file.unlink()
        except FileNotFoundError:
            return sampler
        steps = iter(forced)

        def steered(logprobs):
            token = next(steps, None)
            if token is None:
                return sampler(logprobs)
            keep = mx.arange(logprobs.shape[-1]) == token
            return sampler(mx.where(keep, logprobs, -1e9))

        return steered

    real_stream = Backend.stream

    def stream(self, ids, request):
        with open(prompt_log, "a") as f:
            f.write(json.dumps(list(ids)) + "\n")
        yield from real_stream(self, ids, request)

    api.make_sampler = make_sampler
    Backend.stream = stream


if __name__ == "__main__":
    _install(Path(sys.argv[1]), Path(sys.argv[2]))
    from runtime.cli.app import main

    sys.exit(main(sys.argv[3:]))
