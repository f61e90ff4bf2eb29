"""`mlx.launch -n 2 --backend ring -- specmoe serve ... --pipeline` on 127.0.0.1: one launch, bounded.

Rank 0 serves HTTP and drives the stages; rank 1 loops on its stage. Shown in one launch (each
costs two Python processes): greedy text of a plain and a streaming request equals stock mlx-lm's;
a bad request is answered 4xx and serving goes on; the idle ranks outlive several receive timeouts
(heartbeats); a repeated prompt reuses the cached prefix on every rank; SIGINT to rank 0 stops
every rank cleanly. Every wait has a timeout; the launch is killed (its process group) whatever happens.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlx_lm import load as mlx_load
from mlx_lm import stream_generate

from runtime.pipeline.local import local_launch_command
from tests.serve_process import free_port, get_json, post_raw, wait_for_health

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "runtime" / "data" / "tiny" / "target"
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Enter the king, with his lords."]
N = 8  # tokens per answer
TIMEOUT_S = 5.0  # --pipeline-timeout: short, so the idle wait below spans it twice


def _stock_text(prompt: str) -> str:
    model, tok = mlx_load(str(TARGET))
    return "".join(r.text for r in stream_generate(model, tok, list(tok.encode(prompt)), max_tokens=N))


def _post(base: str, body: dict, timeout: float = 120.0) -> tuple[int, bytes]:
    return post_raw(base + "/v1/completions", json.dumps(body).encode(), timeout=timeout)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("pserve") / "launch.log"
    port = free_port()
    cli = [sys.executable, "-m", "runtime.cli.app", "serve", "-m", str(TARGET), "--pipeline", "--budget", "50%",
           "--pipeline-timeout", str(TIMEOUT_S), "--max-tokens", str(N), "--max-prompt-tokens", "64", "--port", str(port)]
    log = open(log_path, "w")
    proc = subprocess.Popen(local_launch_command(2, cli), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(base, proc, log_path, 240, "the launch")
        pid = int(re.search(r"rank 0 pid (\d+)", log_path.read_text()).group(1))
        yield base, proc, pid, log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


@pytest.mark.long  # launches two rank processes behind a server
def test_serve_through_two_ranks_equals_stock_and_stops_every_rank(launch):
    base, proc, pid, log_path = launch
    # 1. plain request: greedy text = stock mlx-lm in one process
    code, body = _post(base, {"prompt": PROMPTS[0], "max_tokens": N, "temperature": 0})
    assert code == 200, body
    first = json.loads(body)
    assert first["choices"][0]["text"] == _stock_text(PROMPTS[0])
    assert first["choices"][0]["finish_reason"] == "length" and first["usage"]["completion_tokens"] == N
    # 2. bad requests: 4xx, nothing sent down the chain, serving goes on
    assert _post(base, {"prompt": PROMPTS[0], "max_tokens": -1})[0] == 400
    assert _post(base, {"prompt": "word " * 200})[0] == 400  # over --max-prompt-tokens
    assert post_raw(base + "/v1/completions", b"{not json", timeout=30)[0] == 400
    # 3. idle for more than the ranks' receive timeout: heartbeats keep rank 1 waiting, not failing
    time.sleep(2.5 * TIMEOUT_S)
    assert proc.poll() is None, log_path.read_text()
    # 4. streaming request (another prompt): same text as stock, chunk by chunk
    code, raw = _post(base, {"prompt": PROMPTS[1], "max_tokens": N, "temperature": 0, "stream": True})
    assert code == 200, raw
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == _stock_text(PROMPTS[1])
    assert chunks[-1]["finish_reason"] == "length"
    # 5. the conversation goes on: every rank keeps the shared prefix (one RESET trims it), same text as stock
    more = PROMPTS[1] + " The king speaks:"
    code, body = _post(base, {"prompt": more, "max_tokens": N, "temperature": 0})
    assert code == 200, body
    third = json.loads(body)
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, third
    assert third["choices"][0]["text"] == _stock_text(more)
    code, stats = get_json(base + "/v1/specmoe/stats")
    assert stats["requests"]["requests"] == 3 and stats["requests"]["heartbeats"] >= 2, stats
    assert stats["pipeline"]["ranks"] == 2
    # 6. shutdown: SIGINT to rank 0 -> STOP down the chain -> every rank exits 0, and the launch ends
    os.kill(pid, signal.SIGINT)
    proc.wait(timeout=90)
    log = log_path.read_text()
    assert "stopped every rank (3 requests)" in log, log
    assert "rank 1 layers 4-7" in log  # rank 1's report came back with STOP
    assert "error" not in log.lower() and "exited with code" not in log and "was killed" not in log, log


class _OneRank:
    """The channel of a pipeline of one rank: the driver runs its stage locally and sends nothing."""

    rank, size, timeout_s = 0, 1, 60.0

    def __init__(self):
        from runtime.pipeline.channel import ChannelStats

        self.stats = ChannelStats()


@pytest.mark.parametrize("draft", [False, True])
def test_pipeline_backend_in_one_process_frames_text_as_stock(draft):
    """The server's backend without sockets: greedy text = stock mlx-lm's, plain (the continued prompt
    keeps its cached prefix) and speculative (adaptive K, fresh caches per request)."""
    from runtime.decode import load_drafter
    from runtime.pipeline import PipelineBackend, PipelineRun, Stage, StageConfig
    from runtime.serve import CompletionRequest

    stage = Stage.load(TARGET, 0, 1, StageConfig(budget="50%"))
    backend = None
    try:
        drafter = load_drafter(TARGET.parent / "drafter", stage) if draft else None
        run = PipelineRun(model=TARGET, prompt="", draft=TARGET.parent / "drafter" if draft else None, num_draft=3,
                          predictor="none", timeout_s=60.0)
        backend = PipelineBackend(stage, drafter, _OneRank(), run, log=lambda line: None)
        more = PROMPTS[1] + " The king speaks:"
        for prompt in (PROMPTS[1], more):
            request = CompletionRequest(kind="text", model=None, prompt=prompt, max_tokens=N, temperature=0.0)
            pieces = list(backend.stream(backend.encode(request), request))
            assert "".join(p.text for p in pieces) == _stock_text(prompt)
            assert [p.finish_reason for p in pieces] == [None] * (N - 1) + ["length"]
        assert pieces[0].cached_tokens == (0 if draft else len(backend.encode_text(PROMPTS[1])))
        last = backend.stats()["last_request"]
        assert (last["n_rounds"] > 0) == draft
        backend.close()  # stops the heartbeat thread; STOP has no other rank to reach
    finally:
        stage.close()
