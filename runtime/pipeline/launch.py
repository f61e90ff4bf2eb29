"""Running `specmoe generate --pipeline` on every rank of an `mlx.launch` group.

    mlx.launch -n 2 --backend ring -- specmoe generate -m MODEL -p "..." --pipeline
    mlx.launch --hosts 10.0.0.1,10.0.0.2 --backend ring -- specmoe generate -m MODEL -p "..." --pipeline

Every rank: join the group, load its stage (its layers, its cache and loader on its
local store), then a start-up exchange in which each rank states whether it loaded
and its store fingerprint. Rank 0 then tokenizes, drafts, samples and streams; the
other ranks serve their stage until STOP.

Invariants: every rank ends with the same outcome -- all succeed, or each prints one
error line naming the rank at fault and exits non-zero (1: the pipeline failed, 2:
bad input); nothing waits without a timeout. A failing rank tells the next rank before
it exits; a rank stopped by mlx.launch (SIGTERM, sent when another rank exits with an
error) says so. Failures exit with os._exit because a timed-out receive leaves a
thread blocked inside MLX.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime.pipeline.channel import ERROR, Channel, Message, text_payload
from runtime.pipeline.errors import PipelineError
from runtime.pipeline.fingerprint import check_same_stores, store_fingerprint
from runtime.pipeline.stage import Stage, StageConfig
from runtime.pipeline.worker import parse_fault, serve_stage


@dataclass(frozen=True)
class PipelineRun:
    model: Path  # the store or checkpoint, at the same path on every host
    prompt: str  # the prompt text (rank 0)
    max_tokens: int = 100
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # mlx-lm's sampler filters (0: off)
    min_p: float = 0.0
    seed: int = 0
    chat: bool = True  # apply the chat template
    draft: Path | None = None  # drafter dir (rank 0): speculative decoding
    num_draft: int = 4
    predictor: str = "spmoe"
    cutoff: int | None = None
    projection: Path | None = None
    forecast_k: int | None = None
    stage: StageConfig = StageConfig()
    timeout_s: float = 300.0  # --pipeline-timeout: the longest wait for any message
    fault: str | None = None  # --pipeline-fault (debug): die:RANK:WINDOW or hang:RANK:WINDOW
    json_path: Path | None = None  # rank 0 writes tokens, text and every rank's report here


JOIN_ATTEMPTS = 3  # mx.distributed.init tries (each waits ~30 s for a neighbour that is not listening yet)


def join_group():
    import mlx.core as mx

    for attempt in range(JOIN_ATTEMPTS):
        try:
            return mx.distributed.init(strict=True)
        except RuntimeError as e:
            # The ring backend gives up on a neighbour that is not listening after ~30 s; a loaded host may
            # take longer than that to start a rank (Python imports). Another attempt costs nothing.
            if "Couldn't connect" in str(e) and attempt + 1 < JOIN_ATTEMPTS:
                continue
            error = e
            break
    raise ValueError(f"--pipeline: this process is not part of an mlx.launch group ({error}); start every rank with "
                     f"`mlx.launch -n N --backend ring -- specmoe generate ... --pipeline`") from None


def say(rank: int, text: str) -> None:
    sys.stderr.write(f"specmoe (rank {rank}): {text}\n")
    sys.stderr.flush()


def _on_sigterm(rank: int, ch: Channel):
    def handler(signum, frame):
        peer = ch.waiting_for
        waiting = f" (this rank was waiting for {'rank ' + str(peer) if isinstance(peer, int) else peer})" if peer is not None else ""
        say(rank, f"error: stopped by mlx.launch because another rank exited{waiting}; see that rank's error")
        sys.stdout.flush()
        os._exit(1)
    return handler


def fail_rank(ch: Channel | None, rank: int, e: BaseException, told_by: int | None) -> None:
    """Report `e` on this rank, tell the next rank (unless it told us), exit non-zero."""
    code = 2 if isinstance(e, ValueError) else 1
    say(rank, f"error: {e}")
    if ch is not None and ch.size > 1 and ch.next_rank != told_by:
        text = str(e) if isinstance(e, PipelineError) else f"rank {rank} failed: {e}"
        try:
            ch.send(Message(ERROR, origin=told_by if told_by is not None else rank, payload=text_payload(text)), timeout_s=5.0)
        except BaseException:  # noqa: BLE001 - the next rank may be gone too; our error is already printed
            pass
    sys.stdout.flush()
    os._exit(code)


def load_rank(run: PipelineRun, rank: int, size: int):
    """This rank's stage (and drafter on rank 0); the start-up record every rank shares."""
    stage = draft = None
    record = {"ok": True, "path": str(Path(run.model).resolve()), "fingerprint": "", "error": ""}
    try:
        stage = Stage.load(run.model, rank, size, run.stage)
        record["fingerprint"] = store_fingerprint(stage.store)
        if rank == 0 and run.draft is not None:
            from runtime.decode import load_drafter

            draft = load_drafter(run.draft, stage)
    except Exception as e:  # noqa: BLE001 - reported to every rank by the start-up exchange
        record.update(ok=False, error=f"{type(e).__name__}: {e}" if not isinstance(e, (ValueError, OSError)) else str(e),
                      kind="input" if isinstance(e, ValueError) else "load")
    record["error"] = record["error"][:2000]  # the whole record travels in a 4 KiB start-up slot
    return stage, draft, record


def run_generate(run: PipelineRun, write) -> int:
    """Run on every rank; rank 0 streams text through `write`. Returns 0 or exits the process."""
    return run_ranks(run, lambda stage, draft, ch: _rank0(run, stage, draft, ch, write))


def run_ranks(run: PipelineRun, rank0, *, serving: bool = False) -> int:
    """Join, load, check the start-up facts; then rank0(stage, draft, ch) on rank 0 (it must end with
    driver.stop()) and the stage loop elsewhere. Returns 0 or exits the process. serving: the ranks
    other than 0 ignore SIGINT (Ctrl-C on a local launch reaches every rank; rank 0 then stops them)."""
    fault = parse_fault(run.fault)
    group = join_group()
    rank, size = group.rank(), group.size()
    ch = Channel(group, run.timeout_s)
    signal.signal(signal.SIGTERM, _on_sigterm(rank, ch))
    if serving and rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    stage, draft, record = load_rank(run, rank, size)
    try:
        try:  # every rank learns the same start-up facts, so every rank fails the same way without messages
            records = [json.loads(r) for r in ch.all_gather_bytes(json.dumps(record).encode())]
            failed = [(r, x) for r, x in enumerate(records) if not x["ok"]]
            if failed:
                msg = "; ".join(f"rank {r} could not start: {x['error']}" for r, x in failed)
                if all(x.get("kind") == "input" for _, x in failed):
                    raise ValueError(msg)
                raise PipelineError(msg, failed[0][0])
            check_same_stores([x["fingerprint"] for x in records], [x["path"] for x in records])
        except (ValueError, PipelineError) as e:
            fail_rank(None, rank, e, None)
        if rank == 0:
            say(0, f"{size} ranks: {stage.split.describe()}")
            return rank0(stage, draft, ch)
        serve_stage(stage, ch, fault)
        return 0
    except PipelineError as e:
        fail_rank(ch, rank, e, e.rank if e.rank is not None and e.rank != rank else None)
    except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks, not just this one's traceback
        fail_rank(ch, rank, e, None)
    finally:
        if stage is not None:
            stage.close()
    return 1


def _rank0(run: PipelineRun, stage, draft, ch: Channel, write) -> int:
    import mlx.core as mx

    from runtime.decode import SpecConfig, encode_prompt, make_drafter
    from runtime.observe import write_json
    from runtime.pipeline.driver import PipelineDriver
    from runtime.pipeline.generation import generate_plain
    from runtime.pipeline.speculative import PipelineSpeculative, pipeline_predictor

    mx.random.seed(run.seed)
    driver = PipelineDriver(stage, ch)
    ids = encode_prompt(stage.tokenizer, run.prompt, chat=run.chat)
    detok = stage.tokenizer.detokenizer
    detok.reset()

    def show(token: int) -> None:
        detok.add_token(token)
        write(detok.last_segment)

    eos = set(stage.tokenizer.eos_token_ids)
    if draft is None:
        tokens, stats = generate_plain(driver, ids, max_tokens=run.max_tokens, temp=run.temp, top_p=run.top_p,
                                       top_k=run.top_k, min_p=run.min_p, eos_ids=eos, on_token=show)
    else:
        draft_model, draft_config = draft
        predictor = pipeline_predictor(run.predictor, stage, draft_model, draft_config, projection=run.projection,
                                       forecast_k=run.forecast_k)
        drafter = make_drafter(draft_model, run.predictor if run.cutoff != 0 else "none")
        cfg = SpecConfig(num_draft=run.num_draft, cutoff=run.cutoff, temp=run.temp, top_p=run.top_p, top_k=run.top_k,
                         min_p=run.min_p, seed=run.seed)
        try:
            tokens, stats = PipelineSpeculative(driver, drafter, predictor, cfg).generate(ids, run.max_tokens, eos, show)
        finally:
            if drafter.taps:
                drafter.taps.remove()
    stats.ranks = driver.stop()
    detok.finalize()
    write(detok.last_segment + "\n")
    say(0, stats.line())
    if run.json_path:
        write_json(run.json_path, {"model": str(run.model), "tokens": tokens, "text": stage.tokenizer.decode(tokens),
                                   "split": [list(r) for r in stage.split.ranges], "stats": stats.to_json()})
    return 0
