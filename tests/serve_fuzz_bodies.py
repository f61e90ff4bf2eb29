"""Hypothesis strategies for request bodies an attacker or a broken client sends to `specmoe serve`:
malformed JSON, wrong types, huge and negative numbers, NaN, unicode (lone surrogates included),
deep nesting, unknown fields, and valid requests with one field mutated.

`bodies()` draws raw bytes for POST /v1/chat/completions or /v1/completions; every one must get a
4xx (a client error) or a 200 (a request that happened to be valid) -- never a 5xx.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

FIELDS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "stop", "seed", "stream", "stream_options", "n")
EDGE_NUMBERS = [0, -1, 1, 2**31, 2**63, 2**64 - 1, 2**64, 2**70, -2**70, 10**9, 1e9, 1e308, -1e308, 0.5, 1.0000001,
                5e-324]

leaves = (st.none() | st.booleans() | st.integers(min_value=-2**80, max_value=2**80)
          | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(EDGE_NUMBERS)
          | st.text(max_size=20) | st.text(st.characters(codec="utf-8"), max_size=8))
json_values = st.recursive(leaves, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids,
                                                                                            max_size=3), max_leaves=12)
contents = st.text(max_size=40) | st.sampled_from(["\ud800", "\udfff x", "\x00", "\u202e", "🙂" * 10, "<|im_end|>"])


@st.composite
def valid_chat(draw) -> dict:
    body = {"messages": [{"role": draw(st.sampled_from(["user", "system", "assistant"])), "content": draw(contents)}
                         for _ in range(draw(st.integers(1, 3)))]}
    body["messages"][-1]["role"] = "user"
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(1, 6))
    if draw(st.booleans()):
        body["temperature"] = draw(st.floats(0, 2))
    if draw(st.booleans()):
        body["stream"] = True
    return body


@st.composite
def mutated(draw) -> dict:
    """A valid chat body with one to three fields replaced by anything JSON can hold."""
    body = draw(valid_chat())
    for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
        body[name] = draw(json_values)
    if draw(st.booleans()):
        body[draw(st.text(min_size=1, max_size=8))] = draw(json_values)
    return body


def _nested(depth: int, opener: bytes) -> bytes:
    closer = b"]" if opener == b"[" else b"}"
    if opener == b"{":
        return b'{"a":' * depth + b"1" + closer * depth
    return opener * depth + closer * depth


raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.integers(1, 200_000).flatmap(lambda d: st.sampled_from([_nested(d, b"["), _nested(d, b"{")])),
    st.sampled_from([b'{"messages": NaN}', b'{"temperature": Infinity, "messages": []}', b"null", b"[]", b'"x"',
                     b'{"max_tokens": ' + b"9" * 5000 + b"}", b"\xef\xbb\xbf{}", b'{"messages": [' + b"{}," * 500 + b"{}]}",
                     json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode("utf-16")]),
)


def bodies():
    """Raw request bodies: mostly structured mutations, some raw bytes."""
    structured = (mutated() | valid_chat() | json_values).map(lambda b: json.dumps(b).encode())
    return st.one_of(structured, structured, raw_bodies)
