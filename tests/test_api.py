"""The public API (`from runtime import load, generate, stream_generate`) against stock mlx-lm.

Only the public names are used here: what a user of the package writes."""

import pytest
from conftest import greedy_ids
from mlx_lm import load as mlx_load
from mlx_lm import stream_generate as mlx_stream_generate

from runtime import generate, load, stream_generate
from runtime.checkpoints import embedded_pair

PROMPT = "Enter the king, with his lords."


@pytest.fixture(scope="module")
def pair():
    return embedded_pair()


@pytest.fixture(scope="module")
def stock(pair):
    model, tokenizer = mlx_load(str(pair.target))
    return model, tokenizer


@pytest.mark.parametrize("budget", ["100%", "25%"])
def test_public_api_greedy_tokens_equal_stock(pair, stock, budget):
    model, tokenizer = stock
    ids = list(tokenizer.encode(PROMPT))
    expected = greedy_ids(model, ids, 24)
    with load(pair.target, budget=budget) as engine:
        responses = list(stream_generate(engine, PROMPT, max_tokens=24))
    assert [r.token for r in responses] == expected[: len(responses)]
    assert len(responses) == 24 or responses[-1].token in tokenizer.eos_token_ids
    assert [r.finish_reason for r in responses[:-1]] == [None] * (len(responses) - 1)
    assert responses[-1].finish_reason in ("stop", "length")
    stats = responses[-1].stats
    assert stats.generation_tokens == len(responses) and stats.prompt_tokens == len(ids)
    assert stats.acceptance is None and stats.speculative is None and 0.0 <= stats.hit_rate <= 1.0
    assert stats.decode.tokens == len(responses) - 1 and stats.prefill.tokens == len(ids)
    if budget == "25%":
        assert stats.misses > 0 and stats.bytes_read > 0  # a quarter of the experts cannot serve a run without reads


def test_public_api_text_equals_stock_stream_generate(pair, stock):
    model, tokenizer = stock
    want = "".join(r.text for r in mlx_stream_generate(model, tokenizer, PROMPT, max_tokens=20))
    with load(pair.target, budget="50%") as engine:
        assert generate(engine, PROMPT, max_tokens=20) == want


def test_speculative_through_the_api_equals_plain_and_reports_acceptance(pair):
    with load(pair.target, budget="50%") as plain:
        want = [r.token for r in stream_generate(plain, PROMPT, max_tokens=20)]
    with load(pair.target, budget="50%", draft=pair.default_drafter, num_draft=3, predictor="spmoe") as engine:
        responses = list(stream_generate(engine, PROMPT, max_tokens=20))
        assert [r.token for r in responses] == want
        last = responses[-1]
        assert 0.0 <= last.stats.acceptance <= 1.0
        assert last.detail.n_tokens == len(responses) and last.detail.n_rounds >= 1
        spec = last.stats.speculative
        assert (spec.rounds, spec.drafted, spec.accepted) == (last.detail.n_rounds, last.detail.n_drafted,
                                                              last.detail.n_accepted)
        assert spec.cutoff == engine.draft.cutoff == len(engine.model.moe_layers)  # all layers, said as the count
        assert spec.tokens_per_verify == pytest.approx(last.detail.tokens_per_verify)
        # A stream closed early releases the drafter: a new stream still works and is still lossless.
        early = stream_generate(engine, PROMPT, max_tokens=20)
        first = next(early)
        early.close()
        assert first.token == want[0]
        assert [r.token for r in stream_generate(engine, PROMPT, max_tokens=20)] == want


def test_bad_arguments_are_value_errors(pair):
    with load(pair.target, budget="50%") as engine:
        with pytest.raises(ValueError, match="max_tokens 0"):
            list(stream_generate(engine, PROMPT, max_tokens=0))
        with pytest.raises(ValueError, match="prompt is empty"):
            list(stream_generate(engine, [], max_tokens=4))


def test_one_stats_shape_for_plain_and_speculative(pair):
    """Both decoders' responses carry one RunStats with the same fields; decode-only rates at the top."""
    from runtime import RunStats

    shapes = {}
    for name, draft in (("plain", None), ("speculative", pair.default_drafter)):
        with load(pair.target, budget="50%", draft=draft) as engine:
            responses = list(stream_generate(engine, PROMPT, max_tokens=12))
        assert all(type(r.stats) is RunStats for r in responses)
        last = responses[-1].stats
        shapes[name] = last.to_json()
        assert last.tokens_per_s == last.generation_tps == last.decode.tokens_per_s > 0
        assert last.hit_rate == last.decode.hit_rate and last.bytes_read == last.prefill.bytes_read + last.decode.bytes_read
        assert last.host_syncs_per_token == last.decode.host_syncs / last.decode.tokens > 0
        assert [r.stats.generation_tokens for r in responses] == list(range(1, len(responses) + 1))
        # The prefill part is fixed from the first token on: decode numbers never mix it in.
        assert all(r.stats.prefill == responses[0].stats.prefill for r in responses)
    assert shapes["plain"].keys() == shapes["speculative"].keys()
    assert shapes["plain"]["speculative"] is None and shapes["speculative"]["speculative"]["rounds"] >= 1


def test_engine_settings_live_in_load_and_totals_and_plan_are_public(pair):
    """one_sync is a load() setting (stream_generate may still override it per call); Engine.totals()
    and Engine.plan expose the running totals and what the budget became."""
    with load(pair.target, budget="50%", one_sync="off") as engine:
        assert engine.one_sync == "off"
        plan = engine.plan
        assert set(plan.slots) == set(engine.model.moe_layers) and 0 < plan.fraction <= 0.5 + 1e-9
        before = engine.totals()
        off = list(stream_generate(engine, PROMPT, max_tokens=8))
        after = engine.totals()
        on = list(stream_generate(engine, PROMPT, max_tokens=8, one_sync="on"))
    assert off[-1].detail.one_sync_tries == 0 and on[-1].detail.one_sync_tries > 0
    assert [r.token for r in off] == [r.token for r in on]
    stats = off[-1].stats
    assert after.misses - before.misses >= stats.misses > 0
    assert after.bytes_read - before.bytes_read >= stats.bytes_read > 0
    assert after.host_syncs - before.host_syncs >= stats.prefill.host_syncs + stats.decode.host_syncs
    assert after.usable_slots == sum(plan.slots.values())
    with pytest.raises(ValueError, match="one_sync 'sometimes'"):
        load(pair.target, budget="50%", one_sync="sometimes")


def test_your_own_loop_over_the_paged_model_is_lossless_but_syncs_per_moe_layer(pair, stock):
    """engine.model.model in mlx-lm's generate_step: stock tokens, and what it loses against
    stream_generate: a host sync per MoE layer instead of one per token (100% budget)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, tokenizer = stock
    ids = list(tokenizer.encode(PROMPT))
    expected = greedy_ids(model, ids, 12)
    with load(pair.target, budget="100%") as engine:
        n_moe = len(engine.model.moe_layers)
        before = engine.totals()
        own = [int(t) for t, _ in generate_step(mx.array(ids), engine.model.model, max_tokens=12)]
        own_syncs = engine.totals().host_syncs - before.host_syncs
        api = list(stream_generate(engine, ids, max_tokens=12))
    assert own == expected == [r.token for r in api]
    assert own_syncs >= n_moe * len(own)  # every forward reads each MoE layer's routing back
    assert api[-1].stats.host_syncs_per_token == 1.0  # one per token, as stock mlx-lm
