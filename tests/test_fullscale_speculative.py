"""bench/fullscale_speculative.py on a toy-width checkpoint under a real 1 GB cgroup cap: plain and --draft runs of
specmoe generate in alternating pairs, the speculative/plain ratio computed from the runs' own decode rates, tokens
checked equal; reads held to a rate by a blkio throttle and counted."""

from __future__ import annotations

import json
import sys

import pytest

from tests.bench_scripts import BENCH

sys.path.insert(0, str(BENCH.parent))
from bench import fullscale_speculative  # noqa: E402
from bench.fullscale_cgroup import available  # noqa: E402
from bench.fullscale_checkpoint import write_checkpoint  # noqa: E402
from bench.random_drafter import write_random_drafter  # noqa: E402


def test_pairs_under_a_cap_on_a_small_checkpoint(tmp_path):
    if available():
        pytest.skip(available())
    model = write_checkpoint(tmp_path / "ckpt", "qwen3-30b-a3b", small=True, layers=2)["out"]
    draft = write_random_drafter(tmp_path / "d", tmp_path / "ckpt", hidden=64, layers=2, seed=3)
    out = tmp_path / "spec.txt"
    assert fullscale_speculative.main(["--model", model, "--draft", str(draft), "--cap", "1GB", "--budget", "50%",
                                       "-n", "8", "--pairs", "2", "--read-mbps", "200", "--predictor", "previous",
                                       "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# fullscale_speculative:") and "load average before" in lines[0]
    result = json.loads(lines[-1])
    pairs, summary = result["pairs"], result["summary"]
    assert [p["order"] for p in pairs] == [["plain", "spec"], ["spec", "plain"]]
    assert result["read_mbps"] == 200 and "disk GB" in lines[1]
    assert summary["tokens_equal"] and summary["n_pairs"] == 2
    for p in pairs:
        assert p["plain"]["exit_code"] == 0 and p["spec"]["exit_code"] == 0
        assert 0 < p["spec"]["cgroup_peak_gb"] <= 1.0 and not p["spec"]["oom_killed"]
        assert all(p[k]["disk_read_gb"] > 0 for k in ("plain", "spec"))  # the throttled group's reads, counted
        assert p["spec"]["acceptance"] < 0.5 and p["spec"]["n_plain_rounds"] > 0  # the drafter is not accepted
        assert p["spec"]["predictor"] == "previous"  # --predictor reaches the speculative runs
    assert summary["ratios"] == pytest.approx([p["spec"]["tok_s"] / p["plain"]["tok_s"] for p in pairs])
    e2e = sorted(p["plain"]["e2e_s"] / p["spec"]["e2e_s"] for p in pairs)
    assert summary["e2e_min"] == pytest.approx(e2e[0]) and summary["e2e_max"] == pytest.approx(e2e[-1])
    assert all(p[k]["e2e_s"] > p[k]["ttft_s"] for p in pairs for k in ("plain", "spec"))


def test_summary_flags_unequal_tokens():
    run = {"tok_s": 1.0, "ttft_s": 1.0, "tokens": [1, 2]}
    pairs = [{"plain": run, "spec": {**run, "tokens": [1, 3]}}]
    assert not fullscale_speculative.summarize(pairs)["tokens_equal"]
    assert fullscale_speculative.summarize([{"plain": run, "spec": run}])["tokens_equal"]


def test_bad_cap_is_one_line_exit_2(tmp_path, capsys):
    assert fullscale_speculative.main(["--model", str(tmp_path), "--cap", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cap 'lots'" in err


def test_a_drafter_sharing_the_targets_output_proposes_argmax_lm_head_of_its_embedding(tmp_path):
    import mlx.core as mx
    from mlx_lm import load

    model = write_checkpoint(tmp_path / "ckpt", "qwen3-30b-a3b", small=True, layers=2)["out"]
    draft = write_random_drafter(tmp_path / "d", tmp_path / "ckpt", layers=2, share_output=True)
    target, _ = load(model)
    drafter, _ = load(str(draft))
    tokens = mx.array([[5, 17, 230, 41, 99, 3]])
    t = target.model
    # The drafter's layers add exactly nothing: its logits are the target's output layer on its normed embedding.
    expected = target.lm_head(t.norm(t.embed_tokens(tokens)))
    assert mx.array_equal(drafter(tokens), expected)
    with pytest.raises(ValueError, match="not empty"):
        write_random_drafter(tmp_path / "d", tmp_path / "ckpt", share_output=True)
