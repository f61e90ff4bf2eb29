"""plan_pieces: the reads of all pieces tile the caller's buffers exactly once, within piece_bytes, never across ranges."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.read_plan import plan_pieces

# A record: ranges laid end to end in one file, each filling one or more destination buffers.
records = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=3), min_size=1, max_size=6)


def _layout(sizes: list[list[int]], gap: int = 7):
    """(reads, buffers, file bytes, range spans) for ranges of the given buffer sizes, `gap` bytes apart."""
    data = np.random.default_rng(0).integers(0, 256, size=sum(map(sum, sizes)) + gap * (len(sizes) + 1), dtype=np.uint8)
    reads, bufs, spans, offset = [], [], [], gap
    for range_sizes in sizes:
        views = [np.full(n, 0, np.uint8) for n in range_sizes]
        reads.append(("f", offset, views))
        bufs.append(views)
        spans.append((offset, offset + sum(range_sizes)))
        offset += sum(range_sizes) + gap
    return reads, bufs, data, spans


@settings(max_examples=200, deadline=None)
@given(records, st.one_of(st.none(), st.integers(1, 50)))
def test_pieces_tile_the_buffers_once_within_size_and_range(sizes, piece_bytes):
    reads, bufs, data, spans = _layout(sizes)
    pieces = plan_pieces(reads, piece_bytes)
    writes = {id(v): np.zeros(len(v), np.int64) for views in bufs for v in views}
    assert all(pieces), "no piece is empty"
    if piece_bytes is None:
        assert len(pieces) == 1
    for piece in pieces:
        assert piece_bytes is None or sum(r.nbytes for r in piece) <= piece_bytes
        for r in piece:
            assert any(a <= r.offset and r.offset + r.nbytes <= b for a, b in spans), "a read stays in one range"
            assert sum(len(v) for v in r.views) == r.nbytes
            pos = r.offset
            for v in r.views:  # what a reader does: fill the views in order from the file
                v[:] = data[pos : pos + len(v)].tobytes()
                pos += len(v)
    for views, (a, b) in zip(bufs, spans):
        assert b"".join(v.tobytes() for v in views) == data[a:b].tobytes()
    # every byte written once: count through the base buffers the views slice
    for views in bufs:
        for v in views:
            seen = writes[id(v)]
            base = np.frombuffer(v, np.uint8)
            for piece in pieces:
                for r in piece:
                    for w in r.views:
                        w_arr = np.frombuffer(w, np.uint8)
                        if len(w_arr) and np.shares_memory(w_arr, base):
                            start = w_arr.__array_interface__["data"][0] - base.__array_interface__["data"][0]
                            seen[start : start + len(w_arr)] += 1
            assert (seen == 1).all()


def test_full_size_experts_cut_as_documented():
    """gpt-oss-20b: three 4.1 MB weights, each with 259 KB of scales and 12 KB of biases; Qwen3-30B-A3B: three
    786 KB weights, each with two 98 KB tables. 512 KiB pieces: 27 and 9."""
    def reads(sizes):
        views = [np.empty(n, np.uint8) for n in sizes]
        offs = np.cumsum([0] + sizes[:-1]).tolist()
        return [("f", o, [v]) for o, v in zip(offs, views)]

    gpt = reads([4147200, 259200, 11520] * 3)
    qwen = reads([786432, 98304, 98304] * 3)
    assert len(plan_pieces(gpt, 512 << 10)) == 27
    assert [sum(r.nbytes for r in p) for p in plan_pieces(qwen, 512 << 10)] == [524288, 262144, 196608] * 3
    assert len(plan_pieces(qwen, None)) == 1 and len(plan_pieces(qwen, None)[0]) == 9
