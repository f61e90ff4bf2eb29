"""The family contract: what every family specmoe pages must pass (old and new alike).

For each family of runtime.checkpoints.tiny.FAMILIES (a tiny random-weight checkpoint
built with mlx-lm's own classes and quantization: 4-bit affine, gpt-oss's experts MXFP4
with biases; DeepSeek/GLM with a dense first layer, a shared expert and grouped top-k):
- greedy tokens equal stock mlx-lm's at budgets 100%, 50%, 25% and the minimum, from the
  raw checkpoint and from the packed store (at 25% also specmoe's own decode loop with
  one-sync steps);
- speculative greedy equals plain greedy with a dense drafter (random and the target's
  own weights), with and without SP-MoE expert forecasts (the family's router);
- a budget below the minimum is the usual one-line error;
- the experts are found from the module structure: exactly the expert modules of the
  stock model are paged, with the quantization the model runs; shared experts and dense
  layers stay resident.
"""

from __future__ import annotations

import json

import pytest
from mlx_lm import load
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from runtime.checkpoints.tiny import FAMILIES, make_tiny
from runtime.decode.families import SUPPORTED_MODEL_TYPES
from runtime.decode.moe_blocks import find_expert_modules
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.plain import generate_tokens
from runtime.decode.speculative_run import run_speculative
from storage import ExpertStore
from tests.conftest import PROMPT, TINY, greedy_ids, run_cli
from tests.test_cli_errors import _check_one_line_error

BUDGETS = ["100%", "50%", "25%", "min"]
N_SPEC = 12
EXPERT_MODULE = {"gpt_oss": "experts"}  # the name of the expert module where it is not `switch_mlp`
SHARED = {"deepseek_v2": "shared_experts", "deepseek_v3": "shared_experts", "glm4_moe": "shared_experts",
          "qwen3_next": "shared_expert", "qwen3_5_moe": "shared_expert"}
DENSE_FIRST = {"deepseek_v2", "deepseek_v3", "glm4_moe"}  # first_k_dense_replace = 1 in the fixture


@pytest.fixture(scope="module")
def references(tiny_dirs):
    refs = {}
    for fam, path in tiny_dirs.items():
        model, tok = load(str(path))
        ids = tok.encode(PROMPT)
        refs[fam] = (ids, greedy_ids(model, ids))
    return refs


@pytest.fixture(scope="module")
def dense_drafter(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("drafter") / "d", "qwen3", seed=9, layers=TINY["layers"])
    model, _ = load(str(path))
    return model, {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": TINY["layers"]}


def _min_bytes(store_dir) -> int:
    probe = OffloadedModel.load(store_dir, OffloadConfig(budget="100%"))
    minimum = probe.plan.min_bytes
    probe.close()
    return minimum


def _budget(store_dir, budget: str) -> str:
    return f"{_min_bytes(store_dir)}B" if budget == "min" else budget


def test_every_fixture_family_is_supported():
    assert set(FAMILIES) == set(SUPPORTED_MODEL_TYPES)


# Every family packed (checksummed records) by default; raw checkpoints of qwen3_moe and gpt_oss (MXFP4 experts)
# by default, the other families' raw checkpoints in the long tier (`pytest -m long`).
RAW_BY_DEFAULT = {"qwen3_moe", "gpt_oss"}
MATRIX = [pytest.param(family, source, id=f"{source}-{family}",
                       marks=pytest.mark.long if source == "raw" and family not in RAW_BY_DEFAULT else ())
          for source in ("raw", "packed") for family in FAMILIES]


@pytest.mark.parametrize("family, source", MATRIX)
def test_greedy_tokens_identical_to_stock(family, source, tiny_dirs, packed_dirs, references):
    path = (tiny_dirs if source == "raw" else packed_dirs)[family]
    ids, expected = references[family]
    slots_seen = []
    for budget in BUDGETS:
        om = OffloadedModel.load(path, OffloadConfig(budget=_budget(path, budget), verify_checksums=source == "packed"))
        try:
            got = greedy_ids(om.model, ids)
            slots_seen.append(min(om.plan.slots.values()))
            counters = om.counters()
            if budget == "25%":  # specmoe's own decode loop, device-side lookups (one sync per token)
                ours, stats = generate_tokens(om.model, ids, max_tokens=len(expected), om=om, one_sync="on")
                assert ours == expected and stats.one_sync_tries > 0, f"{family}/{source} one-sync"
        finally:
            om.close()
        assert got == expected, f"{family}/{source} at budget {budget}"
        if budget == "100%":
            assert counters["evictions"] == 0
        else:
            assert counters["misses"] > 0
    # The budgets really were different cache sizes, down to one token's experts.
    assert slots_seen == [32, 16, 8, 4]


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_greedy_equals_plain_greedy(family, packed_dirs, tiny_dirs, dense_drafter):
    path = packed_dirs[family]
    om = OffloadedModel.load(path, OffloadConfig(budget=f"{_min_bytes(path)}B"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        expected = greedy_ids(om.model, ids, N_SPEC)
        related, _ = load(str(tiny_dirs[family]))  # the target's own weights, resident: a drafter that agrees
        for predictor in ("spmoe",):  # forecasts through the family's router; "none" is the same path minus them
            for name, (dmodel, dconfig) in {"random": dense_drafter, "related": (related, om.config)}.items():
                tokens, stats, _ = run_speculative(om, None, ids, max_tokens=N_SPEC, num_draft=3, predictor=predictor,
                                                   cutoff=None, draft_model=dmodel, draft_config=dconfig)
                assert tokens == expected, f"{family} {predictor} {name}"
                assert stats.n_tokens == N_SPEC
                if name == "related":
                    assert stats.acceptance == 1.0, f"{family} {predictor}"
        assert om.counters()["misses"] > 0
    finally:
        om.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_budget_below_minimum_is_one_line_error(family, packed_dirs):
    path = packed_dirs[family]
    too_small = _min_bytes(path) - 1
    code, out, err = run_cli(["generate", "--model", str(path), "--prompt", "hi", "-n", "2", "--budget", f"{too_small}B"])
    _check_one_line_error(code, out, err, f"--budget {too_small}B", "minimum")


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_are_found_from_the_module_structure(family, tiny_dirs, packed_dirs):
    stock, _ = load(str(tiny_dirs[family]))
    found = find_expert_modules(stock)
    name = EXPERT_MODULE.get(family, "switch_mlp")
    assert found and all(p.endswith("." + name) for p in found), sorted(found)
    for src in (tiny_dirs, packed_dirs):
        store = ExpertStore.open(src[family])
        try:
            layouts = store.layouts()
            assert {lay.prefix for lay in layouts.values()} == set(found)
            for lay in layouts.values():  # the store's quantization is the one the stock model runs
                module = found[lay.prefix]
                for proj, q in lay.quant.items():
                    lin = module[proj]
                    assert isinstance(lin, QuantizedSwitchLinear)
                    assert (q.group_size, q.bits, q.mode) == (lin.group_size, lin.bits, lin.mode)
                    has_bias = f"{proj}.bias" in {t.name for t in lay.tensors}
                    assert has_bias == ("bias" in lin) == (family == "gpt_oss")
            resident = set(store.resident_tensors())
            if family in SHARED:  # shared experts are 2-D projections: resident, never paged
                assert any(f".{SHARED[family]}.gate_proj.weight" in n for n in resident)
            if family in DENSE_FIRST:
                assert 0 not in layouts and "model.layers.0.mlp.gate_proj.weight" in resident
        finally:
            store.close()
    if family == "gpt_oss":
        assert {lay.quant["gate_proj"].mode for lay in layouts.values()} == {"mxfp4"}
    om = OffloadedModel.load(packed_dirs[family], OffloadConfig(budget="50%"))
    try:  # the cache-backed module runs the family's own classes and activation object
        for layer, m in om.modules.items():
            assert type(m.switch) is type(found[om.store.layout(layer).prefix])
            assert type(m.switch.activation) is type(found[om.store.layout(layer).prefix].activation)
    finally:
        om.close()


def test_unsupported_model_type_lists_families_and_the_contract(tiny_qwen):
    cfg = json.loads((tiny_qwen / "config.json").read_text())
    (tiny_qwen / "config.json").write_text(json.dumps({**cfg, "model_type": "llama4"}))
    code, out, err = run_cli(["generate", "--model", str(tiny_qwen), "--prompt", "hi", "-n", "2"])
    _check_one_line_error(code, out, err, "unsupported model_type 'llama4'", "SwitchGLU-like",
                          *sorted(SUPPORTED_MODEL_TYPES))


def test_the_contract_catches_a_slab_module_without_the_family_activation_or_biases(tiny_dirs, references):
    """What the parity test guards: gpt-oss over slabs with mlx-lm's plain SwiGLU instead of its clamped
    one, or without the per-expert biases, decodes different tokens."""
    from mlx_lm.models.switch_layers import SwiGLU

    ids, expected = references["gpt_oss"]
    for broken in ("activation", "bias"):
        om = OffloadedModel.load(tiny_dirs["gpt_oss"], OffloadConfig(budget="50%"))
        try:
            assert greedy_ids(om.model, ids) == expected
            for m in om.modules.values():
                if broken == "activation":
                    m.switch.activation = SwiGLU()
                else:
                    for proj in ("gate_proj", "up_proj", "down_proj"):
                        del m.switch[proj]["bias"]
            assert greedy_ids(om.model, ids) != expected, broken
        finally:
            om.close()
