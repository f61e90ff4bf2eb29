"""Pairing a drafter with an offloaded target: checks, layer map, projections, predictor.

Invariants: a drafter is accepted only if its tokenizer maps every token string to
the same id as the target's and its output layer covers every id (whatever the
predictor; the error names both vocabularies); `spmoe` runs only when drafter and target widths match
or a projection file made for exactly this pair is available.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from mlx_lm import load as mlx_load

from predictor import make_predictor
from predictor.layer_map import layer_map
from predictor.projection import Projections, config_digest
from runtime.decode.drafter import ModelDrafter
from runtime.decode.families import text_config
from runtime.checkpoints import model_fingerprint
from storage import drop_pages


def default_projection_path(target_dir: Path, drafter_config: dict) -> Path:
    return Path(target_dir) / f"specmoe-projection-{config_digest(drafter_config)}.safetensors"


def _vocab_digest(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    return hashlib.sha256(repr(sorted(vocab.items())).encode()).hexdigest()


def _first_difference(draft_vocab: dict, target_vocab: dict) -> str:
    for token in sorted(set(draft_vocab) | set(target_vocab)):
        a, b = draft_vocab.get(token), target_vocab.get(token)
        if a != b:
            name = lambda i: "absent" if i is None else f"id {i}"  # noqa: E731
            return f"e.g. {token!r} is {name(a)} in the drafter's, {name(b)} in the target's"
    return "same tokens, different ids"


def check_vocabularies(draft_dir: Path, draft_tokenizer, draft_config: dict, target) -> None:
    """Refuse a drafter whose vocabulary is not the target's, naming both (any predictor: acceptance
    compares token ids, so another vocabulary would propose tokens that mean something else)."""
    dv, tv = draft_tokenizer.get_vocab(), target.tokenizer.get_vocab()
    where = f"target {target.store.model_dir}"
    if _vocab_digest(draft_tokenizer) != _vocab_digest(target.tokenizer):
        raise ValueError(
            f"--draft {draft_dir}: its tokenizer differs from the target's: drafter vocabulary {len(dv)} tokens "
            f"(sha256 {_vocab_digest(draft_tokenizer)[:12]}) vs {where} vocabulary {len(tv)} tokens "
            f"(sha256 {_vocab_digest(target.tokenizer)[:12]}); {_first_difference(dv, tv)}. "
            "A drafter must share the target's tokenizer"
        )
    rows = text_config(draft_config).get("vocab_size")
    if rows is not None and rows < max(tv.values()) + 1:
        raise ValueError(
            f"--draft {draft_dir}: its output layer has {rows} rows (vocab_size) but the shared tokenizer's vocabulary "
            f"has ids up to {max(tv.values())} (the {where}): the drafter was trained on a smaller vocabulary"
        )


def load_drafter(draft_dir: Path, target) -> tuple[object, dict]:
    """Load an mlx-lm drafter and check it shares the target's vocabulary (check_vocabularies)."""
    draft_dir = Path(draft_dir)
    if not (draft_dir / "config.json").exists():
        raise ValueError(f"--draft {draft_dir}: no config.json; expected an mlx-lm model directory")
    model, tokenizer, config = mlx_load(str(draft_dir), return_config=True)
    check_vocabularies(draft_dir, tokenizer, config, target)
    if target.store.reader.io_mode == "direct":  # the drafter is resident now: no page-cache copy of its files
        for f in sorted(draft_dir.glob("*.safetensors")):
            drop_pages(f)
    return model, config


def build_predictor(name: str, target, draft_model, draft_config: dict, *, projection: Path | None = None,
                    recording=None, limit: int | None = None):
    """The named predictor for this target/drafter pair.

    limit: experts forecast per layer per round at most (default: spmoe the whole union of
    its per-token top-k, the others 2k)."""
    routers = lm = proj = None
    if name == "spmoe":
        lm = layer_map(len(target.model.layers), len(draft_model.layers))
        t_width = text_config(target.config)["hidden_size"]
        d_width = text_config(draft_config)["hidden_size"]
        path = projection or default_projection_path(target.store.model_dir, draft_config)
        if Path(path).exists():
            proj = Projections.load(path)
            proj.check(target.config, draft_config, path,
                       (model_fingerprint(target.model), model_fingerprint(draft_model)))
        elif projection is not None:
            raise ValueError(f"--projection {projection}: file not found")
        elif t_width != d_width:
            raise ValueError(
                f"drafter width {d_width} differs from the target's {t_width}: spmoe needs a projection; "
                f"run `specmoe calibrate --model {target.store.model_dir} --draft DIR`"
            )
        routers = target.routers()
    return make_predictor(name, top_k=target.top_k, routers=routers, layer_map=lm, projections=proj,
                          recording=recording,
                          limit=limit or (None if name == "spmoe" else 2 * target.top_k))


def make_drafter(draft_model, predictor_name: str) -> ModelDrafter:
    """The drafter of a round; taps only when the predictor reads the drafter's hidden states (spmoe). The last
    draft d_K is not fed within its round: feeding it for the forecast of the window's last token cost more
    drafting than the reads it saved took to wait (bench/results/hotpath_speculative_2ms.txt, spmoe+last)."""
    return ModelDrafter(draft_model, taps=predictor_name == "spmoe")
