"""Adaptive K (runtime/decode/draft_length.py): a drafter the target rejects falls back to
plain decoding, round by round, and the output stays lossless."""

from __future__ import annotations

import pytest
from mlx_lm import load

from runtime.checkpoints.tiny import make_tiny
from runtime.decode.draft_length import DraftLength
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.speculative_run import run_speculative
from tests.conftest import PROMPT, TINY, greedy_ids


def _run(length: DraftLength, accept, rounds: int) -> list[int]:
    ks = []
    for _ in range(rounds):
        k = length.next_k()
        ks.append(k)
        length.record(k, accept(k))
    return ks


def test_never_accepted_drafts_fall_back_to_plain_rounds_with_growing_probes():
    ks = _run(DraftLength(4), lambda k: 0, 60)
    assert ks[:6] == [1, 0, 0, 0, 0, 1]  # the first round is a probe; rejected: a stretch of `backoff` plain rounds
    probes = [i for i, k in enumerate(ks) if k == 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # failed probes wait longer each time
    assert sum(ks) < 0.2 * 4 * len(ks)  # a small share of the fixed-K drafting work
    assert max(ks[6:]) == 1 and ks.count(0) > 40


def test_an_accepted_first_probe_drafts_at_k_max_and_k_follows_acceptance():
    accepted = iter([1, 1, 0, 0, 0])  # the probe, 1 of 4, then none: K falls by one per rejected round
    assert _run(DraftLength(4), lambda k: next(accepted), 5) == [1, 4, 4, 3, 2]


def test_the_history_is_the_k_of_every_round_in_runs():
    length = DraftLength(3)
    ks = _run(length, lambda k: 0, 12)
    assert [k for k, n in length.history for _ in range(n)] == ks
    assert all(a[0] != b[0] for a, b in zip(length.history, length.history[1:]))


def test_accepted_drafts_keep_k_and_a_good_probe_resumes():
    ks = _run(DraftLength(4), lambda k: k, 20)
    assert ks[0] == 1 and set(ks[1:]) == {4}  # the first round's probe, then k_max
    assert set(_run(DraftLength(3, adaptive=False), lambda k: 0, 20)) == {3}
    length = DraftLength(4)
    _run(length, lambda k: 0, 8)  # fell back to plain rounds
    ks = _run(length, lambda k: k, 12)  # the drafter starts to agree: the next probe resumes drafting
    assert ks[-1] == 4


@pytest.fixture(scope="module")
def random_drafter(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("rnd") / "d", "qwen3", seed=11, layers=TINY["layers"])
    model, _ = load(str(path))
    return model, {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": TINY["layers"]}


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_a_drafter_never_accepted_falls_back_to_plain_decoding_losslessly(family, tiny_dirs, random_drafter):
    om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="50%"))
    try:
        ids = om.tokenizer.encode(PROMPT)
        n = 30
        expected = greedy_ids(om.model, ids, n)
        dmodel, dconfig = random_drafter
        tokens, stats, _ = run_speculative(om, None, ids, max_tokens=n, num_draft=4, predictor="none", cutoff=None,
                                           draft_model=dmodel, draft_config=dconfig)
        assert tokens == expected
        assert stats.acceptance < 0.2 and stats.n_plain_rounds > stats.n_rounds / 2, stats.to_json()
        assert stats.mean_k < 1.5  # fixed K would draft 4 per round
        fixed_tokens, fixed, _ = run_speculative(om, None, ids, max_tokens=n, num_draft=4, predictor="none",
                                                 cutoff=None, draft_model=dmodel, draft_config=dconfig,
                                                 adaptive_k=False)
        # fixed K drafts 4 a round but for the last rounds, cut to the tokens still wanted (the last one a plain round)
        assert fixed_tokens == expected and fixed.n_plain_rounds == 1 and fixed.n_drafted == 4 * (n - 4) + 3 + 2 + 1
    finally:
        om.close()


@pytest.mark.parametrize("predictor", ["none", "previous", "popularity", "spmoe", "oracle"])
def test_a_drafter_with_another_vocabulary_is_refused_whatever_the_predictor(predictor, tiny_dirs, tmp_path_factory):
    import shutil

    from runtime.checkpoints.tiny import write_tokenizer

    other = tmp_path_factory.mktemp("vocab") / "other"
    base = make_tiny(tmp_path_factory.mktemp("vocab_base") / "d", "qwen3", seed=12, layers=TINY["layers"])
    shutil.copytree(base, other)
    write_tokenizer(other, vocab_size=290)
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="50%"))
    try:
        with pytest.raises(ValueError) as e:
            run_speculative(om, other, om.tokenizer.encode(PROMPT), max_tokens=4, num_draft=2, predictor=predictor,
                            cutoff=None)
        msg = str(e.value)
        assert "tokenizer differs" in msg and str(other) in msg and str(tiny_dirs["qwen3_moe"]) in msg
        assert "290 tokens" in msg and f"{len(om.tokenizer.get_vocab())} tokens" in msg and "in the target's" in msg
    finally:
        om.close()


def test_a_drafter_whose_output_layer_misses_token_ids_is_refused(tiny_dirs):
    from runtime.decode.pairing import check_vocabularies

    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="50%"))
    try:
        n = len(om.tokenizer.get_vocab())
        check_vocabularies("d", om.tokenizer, {"vocab_size": n}, om)  # the same vocabulary: accepted
        with pytest.raises(ValueError, match=f"--draft d: its output layer has {n - 20} rows"):
            check_vocabularies("d", om.tokenizer, {"vocab_size": n - 20}, om)
    finally:
        om.close()


def test_a_cut_window_keeps_k():
    length = DraftLength(4)
    _run(length, lambda k: k, 3)  # probe, then K = 4 accepted
    length.record(1, 1, cut=True)  # the generation's last window, cut to one draft, accepted
    assert length.next_k() == 4  # a full K: the short window said nothing about a longer one
    length.record(2, 0, cut=True)
    assert length.next_k() == 4 and length.acceptance < 1.0  # its share still counts


@pytest.fixture()
def self_drafting(tiny_dirs):
    """(om, new_decoder): the qwen3_moe target fully resident and a factory of K = 3 decoders whose drafter is the
    target's own weights, so every draft is accepted."""
    import json

    from runtime.decode.pairing import build_predictor, make_drafter
    from runtime.decode.speculative import SpecConfig, SpeculativeDecoder

    path = tiny_dirs["qwen3_moe"]
    om = OffloadedModel.load(path, OffloadConfig(budget="100%", threads=1))
    dmodel, _ = load(str(path))
    config = json.loads((path / "config.json").read_text())
    try:
        yield om, lambda: SpeculativeDecoder(om, make_drafter(dmodel, "none"), build_predictor("none", om, dmodel, config),
                                             SpecConfig(num_draft=3))
    finally:
        om.close()


def test_no_window_drafts_past_the_last_token_wanted(self_drafting, monkeypatch):
    """A drafter that is always accepted drafts to the end of the generation; each round's window holds at most the
    tokens still wanted, so no draft is read, computed and thrown away, and the tokens stay the target's."""
    om, new_decoder = self_drafting
    ids = om.tokenizer.encode(PROMPT)
    for n in (7, 9, 10):
        dec = new_decoder()
        windows = []
        verify = dec._verify
        monkeypatch.setattr(dec, "_verify", lambda w, snap: windows.append(len(w)) or verify(w, snap))
        out = dec.generate(ids, n)
        assert out == greedy_ids(om.model, ids, n)
        assert dec.stats.acceptance == 1.0 and 4 in windows  # full windows ran, every draft accepted ...
        # ... and emitted: each round emits its accepted drafts and the target's own token (a probe's accepted
        # proposal is that token)
        assert dec.stats.n_accepted + dec.stats.n_rounds - dec.stats.n_probes == n, dec.stats.to_json()
        assert dec.draft_length.next_k() == 3  # a cut window left K at k_max


def test_a_decoder_runs_one_generation(self_drafting):
    """Its KV caches keep the context it ran: a second generation on the same decoder would continue that context
    and emit other tokens than the target's, so it is refused in one line."""
    om, new_decoder = self_drafting
    dec = new_decoder()
    ids = om.tokenizer.encode(PROMPT)
    assert dec.generate(ids, 6) == greedy_ids(om.model, ids, 6)
    with pytest.raises(RuntimeError, match="one per generation"):
        dec.generate(ids, 6)
