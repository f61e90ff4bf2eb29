"""Prompt cache reuse (runtime/decode/prompt_cache.py): a second turn prefills only its own tokens and
its output equals a from-scratch run, for trimmable KV caches and snapshotted hybrid state."""

from __future__ import annotations

import json

import pytest
from mlx_lm import load

from runtime.checkpoints.tiny import FAMILIES
from runtime.decode import generate_tokens
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.prompt_cache import PromptCache
from tests.conftest import PROMPT, REPRESENTATIVE_FAMILIES, greedy_ids, long_tier, run_cli

N = 6


# Representative families by default (plain KV + switch_mlp, hybrid linear-attention state, rotating KV with MXFP4
# experts and biases, shared experts with grouped routing); every family in the long tier (`pytest -m long`).
@pytest.mark.parametrize("family", long_tier(FAMILIES, keep=REPRESENTATIVE_FAMILIES))
def test_second_turn_prefills_only_its_tokens_and_equals_a_fresh_run(family, tiny_dirs):
    path = tiny_dirs[family]
    stock, tok = load(str(path))
    om = OffloadedModel.load(path, OffloadConfig(budget="25%"))
    try:
        pc = PromptCache(om.model)
        ids1 = tok.encode(PROMPT)
        out1, st1 = generate_tokens(om.model, ids1, max_tokens=N, om=om, prompt_cache=pc)
        assert out1 == greedy_ids(stock, ids1, N)
        assert st1.prefill.reused_tokens == 0 and st1.prefill.n_tokens == len(ids1)
        assert pc.tokens == ids1 + out1

        new = tok.encode(" The miller said the river was slow.")
        ids2 = ids1 + out1 + new
        out2, st2 = generate_tokens(om.model, ids2, max_tokens=N, om=om, prompt_cache=pc)
        assert st2.prefill.reused_tokens == len(ids1) + len(out1)  # only the new turn is prefilled
        assert st2.prefill.n_tokens == len(new) and pc.prefilled == len(new) - 1
        assert out2 == greedy_ids(stock, ids2, N)

        # A prompt that leaves the conversation earlier: rolled back (trim, or the last snapshot before it).
        ids3 = ids1[:-3] + tok.encode(" Once upon a time")
        out3, st3 = generate_tokens(om.model, ids3, max_tokens=N, om=om, prompt_cache=pc)
        assert out3 == greedy_ids(stock, ids3, N)
        assert st3.prefill.reused_tokens == (len(ids1) - 3 if pc.trimmable else 0)
        assert pc.tokens == ids3 + out3
    finally:
        om.close()


def test_prompt_cache_file_saves_a_prefix_and_a_later_run_prefills_only_the_rest(tiny_dirs, tmp_path):
    path, f = tiny_dirs["qwen3_next"], tmp_path / "prefix.safetensors"  # hybrid: state snapshotted, not trimmed
    stock, tok = load(str(path))
    first, second = PROMPT, " And the loader fetches the experts."
    args = ["generate", "-m", str(path), "-b", "25%", "-n", str(N), "--raw-prompt", "--prompt-cache", str(f)]
    code, out, err = run_cli(args + ["-p", first, "--json", str(tmp_path / "a.json")])
    assert code == 0, err
    assert f.exists() and "wrote prompt cache" in err
    code, out, err = run_cli(args + ["-p", second, "--json", str(tmp_path / "b.json")])
    assert code == 0, err
    run = json.loads((tmp_path / "b.json").read_text())
    ids = tok.encode(first) + tok.encode(second)
    assert run["tokens"] == greedy_ids(stock, ids, N)
    assert run["detail"]["prefill"]["reused_tokens"] == len(tok.encode(first)) - 1
    assert run["detail"]["prefill"]["n_tokens"] == len(tok.encode(second)) + 1
    assert run["stats"]["prefill"]["tokens"] == run["detail"]["prefill"]["n_tokens"]  # the reused prefix is not prefilled


def test_prompt_cache_file_of_another_model_is_refused(tiny_dirs, tmp_path):
    f = tmp_path / "p.safetensors"
    code, _, err = run_cli(["generate", "-m", str(tiny_dirs["qwen3_moe"]), "-b", "50%", "-n", "2", "--raw-prompt",
                            "-p", PROMPT, "--prompt-cache", str(f)])
    assert code == 0, err
    code, _, err = run_cli(["generate", "-m", str(tiny_dirs["mixtral"]), "-b", "50%", "-n", "2", "--raw-prompt",
                            "-p", PROMPT, "--prompt-cache", str(f)])
    assert code == 2 and "--prompt-cache" in err and "another model" in err


def test_prompt_cache_and_kv_bits_with_a_drafter_are_refused_before_loading_saying_why(tiny_dirs, tmp_path):
    base = ["generate", "-m", str(tiny_dirs["qwen3_moe"]), "-p", PROMPT, "-n", "2", "--draft", str(tmp_path)]  # no model there: never loaded
    code, _, err = run_cli(base + ["--prompt-cache", str(tmp_path / "p.safetensors")])
    assert code == 2 and "--prompt-cache with --draft: the drafter's KV cache is not saved" in " ".join(err.split())
    code, _, err = run_cli(base + ["--kv-bits", "8"])
    assert code == 2 and "--kv-bits with --draft: the speculative decoder keeps its KV caches unquantized" in " ".join(err.split())
