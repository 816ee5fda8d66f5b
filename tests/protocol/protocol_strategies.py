"""Hypothesis strategies for every protocol message (valid by construction)."""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from moeswarm import protocol as p
from moeswarm.protocol._codec import ENDPOINT_RE, MODEL_ID_RE, SOFTWARE_RE
from moeswarm.protocol._identity import PEER_ID_PREFIX

U32 = 2**32 - 1
U64 = 2**64 - 1


def fixed(n: int) -> st.SearchStrategy[bytes]:
    return st.binary(min_size=n, max_size=n)


u32 = st.integers(0, U32)
u64 = st.integers(0, U64)
peer_ids = fixed(32).map(lambda b: PEER_ID_PREFIX + b)
model_ids = st.from_regex(MODEL_ID_RE, fullmatch=True).filter(lambda s: len(s) <= 128)
endpoints = st.from_regex(ENDPOINT_RE, fullmatch=True).filter(lambda s: len(s) <= 256)
software = st.from_regex(SOFTWARE_RE, fullmatch=True).filter(lambda s: len(s) <= 64)


@st.composite
def tensors(draw: st.DrawFn, rows: int | None = None, width: int | None = None,
            dtype: str | None = None) -> np.ndarray:
    """A finite (rows, width) tensor of a wire dtype."""
    name = dtype or draw(st.sampled_from(["f32", "f16", "bf16"]))
    shape = (rows or draw(st.integers(1, 4)), width or draw(st.integers(1, 6)))
    if name == "f16":
        return draw(hnp.arrays(np.float16, shape, elements=st.floats(width=16, allow_nan=False,
                                                                        allow_infinity=False)))
    if name == "f32":
        return draw(hnp.arrays(np.float32, shape, elements=st.floats(width=32, allow_nan=False,
                                                                        allow_infinity=False)))
    f32 = draw(hnp.arrays(np.float32, shape, elements=st.floats(-(2.0**100), 2.0**100, width=32)))
    return f32.astype(ml_dtypes.bfloat16)


@st.composite
def expert_requests(draw: st.DrawFn) -> p.ExpertRequest:
    hidden = draw(tensors())  # (N, H)
    n = hidden.shape[0]
    ids = draw(st.lists(u32, min_size=1, max_size=5, unique=True))
    rows = [draw(st.sets(st.integers(0, n - 1), min_size=1)) for _ in ids]
    rows[0] |= set(range(n)) - set().union(*rows)  # every row routed somewhere
    experts = tuple(p.ExpertRows(e, np.array(sorted(r), dtype=np.uint32)) for e, r in zip(ids, rows))
    return p.ExpertRequest(draw(fixed(16)), draw(model_ids), draw(u32), draw(u64), hidden, experts,
                           draw(st.none() | st.integers(1, U32)))


@st.composite
def receipts(draw: st.DrawFn, pairs: int | None = None, request_id: bytes | None = None) -> p.Receipt:
    pairs = pairs or draw(st.integers(1, 20))
    experts = tuple(draw(st.lists(u32, min_size=1, max_size=min(pairs, 5), unique=True)))
    tokens = draw(st.integers(math.ceil(pairs / len(experts)), U32))
    return p.Receipt(request_id or draw(fixed(16)), draw(peer_ids), draw(peer_ids), draw(model_ids),
                     draw(u32), experts, tokens, pairs, draw(u64), draw(fixed(32)), draw(fixed(32)),
                     draw(u64), draw(u64), draw(fixed(64)))


@st.composite
def expert_responses(draw: st.DrawFn) -> p.ExpertResponse:
    outputs = draw(tensors())  # (P, H)
    rid = draw(fixed(16))
    receipt = draw(receipts(pairs=outputs.shape[0], request_id=rid))
    return p.ExpertResponse(rid, outputs, receipt, draw(u64), draw(st.integers(0, 1000)))


def _range(hi: int) -> st.SearchStrategy[tuple[int, int]]:
    bound = st.integers(0, hi)
    return st.tuples(bound, bound).map(lambda t: (min(t), max(t)))


announcements = st.builds(  # ranges within the protocol's bounds on layers and experts
    p.Announcement, model_ids, _range(p.MAX_LAYER), _range(p.MAX_EXPERT),
    st.lists(endpoints, min_size=1, max_size=8).map(tuple), u64, u64, st.integers(0, 1000),
    software, u64, u64, peer_ids, fixed(32), fixed(64),
)

hellos = st.builds(
    p.Hello, st.lists(st.integers(1, 65535), min_size=1, max_size=16, unique=True).map(
        lambda v: tuple(sorted(v))), peer_ids, fixed(32), fixed(32))
hello_acks = st.builds(p.HelloAck, st.integers(1, 65535), peer_ids, fixed(32), fixed(32), fixed(64))
auths = st.builds(p.Auth, fixed(64))
errors = st.builds(p.Error, u32, st.text(max_size=200), st.none() | fixed(16))
pings = st.builds(p.Ping, u64, st.binary(max_size=64), st.integers(0, p.MAX_PROBE_BYTES))
pongs = st.builds(p.Pong, u64, st.binary(max_size=64))


@st.composite
def weights_requests(draw: st.DrawFn) -> p.WeightsRequest:
    start = draw(st.integers(0, U32 - 1))
    return p.WeightsRequest(draw(fixed(16)), draw(model_ids), draw(u32), draw(u32),
                            draw(st.sampled_from(p.EXPERT_TENSORS)), start, draw(st.integers(start + 1, U32)))


weights_responses = st.builds(p.WeightsResponse, fixed(16), tensors())
countersigned = st.builds(p.CountersignedReceipt, receipts(), fixed(64))

messages: st.SearchStrategy[Any] = st.one_of(
    hellos, hello_acks, auths, errors, pings, pongs, expert_requests(), expert_responses(),
    countersigned, announcements, weights_requests(), weights_responses,
)

# any msgpack value v1 might meet (ints span int64..uint64)
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), U64) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)
