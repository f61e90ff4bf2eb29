"""runtime.pipeline: one model over several Macs -- pipeline stages over mx.distributed.

Each rank of an `mlx.launch` group owns a contiguous range of decoder layers and keeps
resident only those layers' non-expert weights plus its own ExpertCache and AsyncLoader
over its local copy of the store (rank 0 also the embedding, head, tokenizer and
drafter; with `serve --pipeline`, the HTTP server). Hidden states pass rank to rank with send/recv; rank 0 samples and streams;
speculative verify windows pass as one message per hop and forecasts go to the rank
owning each layer so its loader prefetches while rank 0 drafts.

Invariants kept at this boundary: greedy tokens equal the resident mlx-lm model's in
one process; every receive has a timeout; a failure ends every rank with one error
line naming the rank at fault; ranks refuse to run on stores that differ.
"""

from runtime.pipeline.channel import Channel, Message
from runtime.pipeline.driver import PipelineDriver
from runtime.pipeline.errors import PipelineError
from runtime.pipeline.fingerprint import check_same_stores, store_fingerprint
from runtime.pipeline.generation import PipelineStats, generate_plain
from runtime.pipeline.launch import PipelineRun, run_generate
from runtime.pipeline.serving import PipelineBackend, run_serve
from runtime.pipeline.speculative import PipelineSpeculative, pipeline_predictor
from runtime.plan import StageSplit, balanced_split, explicit_split, parse_split  # the split is the planner's
from runtime.pipeline.stage import Stage, StageConfig, plan_split
from runtime.pipeline.worker import serve_stage

__all__ = [
    "Channel", "Message", "PipelineDriver", "PipelineError", "check_same_stores", "store_fingerprint", "PipelineStats",
    "generate_plain", "PipelineRun", "run_generate", "PipelineBackend", "run_serve", "PipelineSpeculative",
    "pipeline_predictor", "StageSplit", "balanced_split", "explicit_split", "parse_split", "Stage", "StageConfig",
    "plan_split", "serve_stage",
]
