"""WindowReads (runtime/decode/window_reads.py): a verify window's demand reads, by the window tokens that
routed to them; and a speculative run's count of them (the last draft's blind spot)."""

from __future__ import annotations

import numpy as np

from runtime.checkpoints.embedded import embedded_pair
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.pairing import load_drafter
from runtime.decode.speculative_run import run_speculative
from runtime.decode.window_reads import WindowReads


def test_each_read_is_booked_to_the_window_tokens_that_routed_to_it():
    w = WindowReads()
    # a window of 4 tokens [pending, d1, d2, d3], top-2
    routing = {3: np.array([[1, 2], [3, 4], [5, 6], [7, 2]]), 5: np.array([[0, 9], [8, 9], [8, 10], [11, 12]])}
    reads = {3: np.array([1, 2, 4, 7, 63]), 5: np.array([10, 11, 8])}
    w.add(routing, reads, 4)
    assert (w.windows, w.first_only, w.middle_only, w.last_only, w.shared, w.unrouted) == (1, 1, 2, 2, 2, 1)
    assert w.total == 8 and w.to_json()["total"] == 8
    w.add(routing, reads, 1)  # a plain round (one token): not a window
    assert w.windows == 1 and w.total == 8
    # a layer observed twice (a repair's call and the accepted one): its last rows are the window's
    w.add({3: np.concatenate([np.full((4, 2), 50), routing[3]])}, {3: np.array([7])}, 4)
    assert w.last_only == 3 and w.unrouted == 1


def test_a_speculative_run_counts_its_verify_reads_and_the_last_draft_is_a_large_share():
    """The embedded pair at 50%: every verify demand read is booked, and the last draft (never fed to the drafter,
    so no forecast names its experts) is a large share of them."""
    pair = embedded_pair()
    prompt = "The old steward walked the length of the hall and said to the king that the winter would be long."
    out = {}
    for last in (False,):
        om = OffloadedModel.load(pair.target, OffloadConfig(budget="50%"))
        try:
            dmodel, dconfig = load_drafter(pair.default_drafter, om)
            ids = list(om.tokenizer.encode(prompt))
            _, st, _ = run_speculative(om, pair.default_drafter, ids, max_tokens=32, num_draft=3, predictor="spmoe",
                                       cutoff=None, draft_model=dmodel, draft_config=dconfig)
        finally:
            om.close()
        w = st.window_reads
        assert w.windows == st.n_verifies  # plain rounds and probes run no verify window
        assert w.total > 0 and w.unrouted == 0  # routed windows repair nothing: every read was routed to
        assert st.to_json()["window_reads"]["total"] == w.total
        out[last] = w.last_only / w.total
    assert out[False] > 0.25, out  # the drafter never fed d_K: its experts are a large share of the reads


def test_ranks_counts_sum_over_their_layers_of_the_same_windows():
    """Pipeline ranks count the same windows in different layers: summed, the reads add and the windows do not."""
    a, b = WindowReads(3, 1, 2, 3, 0, 0), WindowReads(3, 0, 1, 1, 2, 1)
    s = WindowReads.summed([a.to_json(), b.to_json()])
    assert s == WindowReads(3, 1, 3, 4, 2, 1) and s.total == a.total + b.total
