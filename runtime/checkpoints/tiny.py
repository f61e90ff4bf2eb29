"""Tiny real-layout checkpoints for tests and demos (`specmoe make-tiny`).

Each family's checkpoint is built from mlx-lm's own model class with random
weights (seeded), quantized the way mlx-community checkpoints are (4-bit affine,
router gates 8-bit where the family says so, gpt-oss experts MXFP4), saved with mlx-lm's savers, plus a
small byte-level BPE tokenizer trained on a built-in paragraph. So paging code
meets exactly the tensor names, shapes, dtypes and byte layouts of real models.

Invariants: the same (family, seed, sizes) give byte-identical weights; the
directory loads with stock `mlx_lm.load`; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, quantize_model, save_config

_SAMPLE_TEXT = """
Experts live on disk and wake when the router calls their names. A small cache keeps
the busy ones close, and the loader fetches the others before they are missed.
The quick brown fox jumps over the lazy dog while the river runs past the old mill.
Numbers such as 1, 2, 3, 10, 42 and 2048 appear in text, and so do words like
memory, budget, token, layer, expert, draft, verify, accept and reject.
Once upon a time a model was larger than the machine that ran it, and it ran anyway.
"""

FAMILIES = ("qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss")
DENSE_FAMILIES = ("qwen3",)  # drafters


def family_config(family: str, *, vocab_size: int, hidden: int = 64, layers: int = 4,
                  n_experts: int = 16, top_k: int = 4, expert_hidden: int = 32) -> dict:
    """An mlx-lm config.json dict for a tiny model of `family`."""
    common = {
        "model_type": family, "vocab_size": vocab_size, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "num_experts_per_tok": top_k, "max_position_embeddings": 4096,
    }
    if family == "qwen3":
        return {**common, "intermediate_size": 2 * hidden, "head_dim": hidden // 4, "rope_theta": 10000.0}
    if family == "qwen3_moe":
        return {**common, "intermediate_size": 2 * hidden, "num_experts": n_experts, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "moe_intermediate_size": expert_hidden, "head_dim": hidden // 4,
                "rope_theta": 10000.0, "norm_topk_prob": True}
    if family == "mixtral":
        return {**common, "intermediate_size": expert_hidden, "num_local_experts": n_experts, "rope_theta": 1e6}
    hybrid = {
        "intermediate_size": 2 * hidden, "num_experts": n_experts, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "moe_intermediate_size": expert_hidden, "shared_expert_intermediate_size": expert_hidden,
        "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": hidden // 4,
        "linear_value_head_dim": hidden // 4, "linear_conv_kernel_dim": 4, "head_dim": hidden // 4,
        "full_attention_interval": 2, "norm_topk_prob": True,
    }
    if family == "qwen3_next":
        return {**common, **hybrid, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    if family == "qwen3_5_moe":
        return {**common, **hybrid, "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
    new = _new_family_config(family, common, hidden=hidden, n_experts=n_experts, expert_hidden=expert_hidden)
    if new is not None:
        return new
    raise ValueError(f"family {family!r}; expected one of {FAMILIES + DENSE_FAMILIES}")


def _new_family_config(family: str, common: dict, *, hidden: int, n_experts: int, expert_hidden: int) -> dict | None:
    """OLMoE, DeepSeek-V2/V3, GLM-4.5 and gpt-oss: dense first layer, shared experts and grouped
    top-k where the family has them (so the fixture exercises them); None for other families."""
    if family == "olmoe":
        return {**common, "intermediate_size": expert_hidden, "num_experts": n_experts, "head_dim": hidden // 4,
                "norm_topk_prob": False, "rope_theta": 10000.0}
    deepseek = {
        "intermediate_size": 2 * hidden, "moe_intermediate_size": expert_hidden, "n_routed_experts": n_experts,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 32,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_group": 4, "topk_group": 2,
        "rope_theta": 10000.0, "attention_bias": False,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},  # V2-Lite's
    }
    if family == "deepseek_v2":  # V2 proper: softmax gate, group-limited greedy top-k, no q LoRA (as V2-Lite)
        return {**common, **deepseek, "q_lora_rank": None, "topk_method": "group_limited_greedy",
                "routed_scaling_factor": 1.0}
    if family == "deepseek_v3":  # sigmoid gate + correction bias, grouped top-k (noaux_tc)
        return {**common, **deepseek, "q_lora_rank": 32, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                "norm_topk_prob": True, "routed_scaling_factor": 2.5}
    if family == "glm4_moe":
        return {**common, "intermediate_size": 2 * hidden, "moe_intermediate_size": expert_hidden,
                "n_routed_experts": n_experts, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4,
                "topk_group": 2, "head_dim": hidden // 4, "use_qk_norm": True, "attention_bias": True,
                "partial_rotary_factor": 0.5, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                "rope_theta": 10000.0, "rope_scaling": None}
    if family == "gpt_oss":  # alternating sliding / full attention, experts `experts` with biases
        n = common["num_hidden_layers"]  # explicit layer_types: mlx-lm's default covers only an even count
        return {**common, "num_local_experts": n_experts, "intermediate_size": expert_hidden, "head_dim": hidden // 4,
                "sliding_window": 8, "rope_theta": 150000, "rope_scaling": None,
                "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]}
    return None


# Families whose mlx-lm classes initialise routing-relevant parameters to zeros (MoEGate weights,
# correction biases, expert biases): a random-weight fixture fills them, else every token routes alike.
_ZERO_INIT = {"deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss"}


def _fill_zero_params(model) -> None:
    """Replace all-zero parameters (gates, biases, sinks) by small seeded random values."""
    from mlx.utils import tree_unflatten

    fills = []
    for name, p in tree_flatten(model.parameters()):
        if p.size and not mx.any(p).item():
            fills.append((name, (0.5 * mx.random.normal(p.shape)).astype(p.dtype)))
    model.update(tree_unflatten(fills))


def _quant_predicate(family: str, model):
    """gpt-oss: experts MXFP4 (as OpenAI ships them), router 8-bit (mlx-lm's predicate); else the model's own."""
    own = getattr(model, "quant_predicate", None)
    if family != "gpt_oss":
        return own

    def predicate(path, module):
        if ".experts." in path + ".":
            return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        return own(path, module) if own is not None else True

    return predicate


def write_tokenizer(out: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE on the built-in text; returns the real vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_SAMPLE_TEXT] * 4, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": None,
        "model_max_length": 4096,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
    }, indent=1))
    return tok.get_vocab_size()


def make_tiny(out: str | Path, family: str = "qwen3_moe", *, seed: int = 0, shards: int = 1, bits: int = 4,
              group_size: int = 32, **sizes) -> Path:
    """Write a tiny quantized checkpoint of `family` to `out` (created; must not exist or be empty)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; make-tiny writes a new checkpoint directory")
    if family not in FAMILIES + DENSE_FAMILIES:
        raise ValueError(f"--family {family!r}; expected one of {', '.join(FAMILIES + DENSE_FAMILIES)}")
    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(out)
    config = family_config(family, vocab_size=vocab, **sizes)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    if family in _ZERO_INIT:
        _fill_zero_params(model)
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints bits per weight
        model, config = quantize_model(model, config, group_size=group_size, bits=bits,
                                       quant_predicate=_quant_predicate(family, model))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    _save_shards(out, weights, shards)
    save_config(config, out / "config.json")
    return out


def _save_shards(out: Path, weights: dict, shards: int) -> None:
    names = sorted(weights)
    if shards <= 1:
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
        return
    weight_map = {}
    per = (len(names) + shards - 1) // shards
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(out / fname), {n: weights[n] for n in part}, metadata={"format": "mlx"})
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
