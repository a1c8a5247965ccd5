"""Bounded fuzzing (hypothesis) of what a server decodes from the network and of the answer
extractors that read model output: malformed input raises ValueError, nothing else; nothing
hangs (each example has a deadline, long adversarial texts included); nothing allocates more
than the message's own bytes."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshrl.api.v1 import common_pb2, reward_pb2
from meshrl.data.boxed import last_boxed
from meshrl.ragged import Ragged
from meshrl.wire import (
    _DTYPES,
    ragged_from_proto,
    ragged_to_proto,
    tensor_from_proto,
    tensor_to_proto,
)
from services.reward.convert import item_from_proto
from services.reward.scorers import gsm8k, hellaswag
from services.reward.scorers import math as math_scorer

pytestmark = pytest.mark.timeout(300)

FUZZ = settings(
    max_examples=200,
    deadline=timedelta(seconds=2),  # generous for a loaded 2-core box; a hang is far longer
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,  # the same examples every run: a failure reproduces
)

DTYPE_NAMES = sorted(_DTYPES)
dtype_names = st.one_of(st.sampled_from(DTYPE_NAMES), st.text(max_size=12))
sizes = st.one_of(
    st.integers(-3, 8),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1, -(2**63)]),
)
shapes = st.lists(sizes, max_size=12)


def _check_tensor(msg: common_pb2.Tensor) -> torch.Tensor | None:
    """Decodes; a success must be exactly what the bytes hold."""
    try:
        out = tensor_from_proto(msg)
    except ValueError:
        return None
    if msg.dtype:
        assert list(out.shape) == list(msg.shape)
        assert out.numel() * out.element_size() == len(msg.data)
    return out


@FUZZ
@given(data=st.binary(max_size=2048), dtype=dtype_names, shape=shapes)
def test_tensor_decoding_of_arbitrary_fields(data, dtype, shape):
    _check_tensor(common_pb2.Tensor(data=data, dtype=dtype, shape=shape))


@FUZZ
@given(
    dtype=st.sampled_from(DTYPE_NAMES),
    shape=st.lists(st.integers(0, 5), max_size=4),
    extra=st.integers(-3, 3),
)
def test_tensor_decoding_near_valid(dtype, shape, extra):
    """Right dtype and shape, byte count off by a few: the near misses a bug would produce."""
    itemsize = torch.empty(0, dtype=_DTYPES[dtype]).element_size()
    n = 1
    for d in shape:
        n *= d
    data = bytes(max(0, n * itemsize + extra))
    out = _check_tensor(common_pb2.Tensor(data=data, dtype=dtype, shape=shape))
    assert (out is not None) == (len(data) == n * itemsize)


@FUZZ
@given(raw=st.binary(max_size=4096))
def test_tensor_decoding_of_arbitrary_wire_bytes(raw):
    """What a server gets from the network: protobuf parsing refuses, or our decoding does."""
    try:
        msg = common_pb2.Tensor.FromString(raw)
    except DecodeError:
        return
    _check_tensor(msg)


int_tensors = st.builds(
    lambda values, dtype: (
        torch.tensor(values, dtype=torch.int64)
        .clamp(torch.iinfo(dtype).min, torch.iinfo(dtype).max)
        .to(dtype)
    ),
    st.lists(st.integers(-(2**40), 2**40), max_size=40),
    st.sampled_from([torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]),
)
any_tensors = st.one_of(
    int_tensors,
    st.builds(
        lambda v: torch.tensor(v, dtype=torch.float32), st.lists(st.floats(width=32), max_size=10)
    ),
    st.builds(lambda v: torch.tensor(v, dtype=torch.bool), st.lists(st.booleans(), max_size=10)),
    st.builds(
        lambda v: torch.tensor(v, dtype=torch.int64).reshape(-1, 2),
        st.lists(st.integers(0, 9), min_size=2, max_size=2),
    ),
)


@FUZZ
@given(ids=any_tensors, offsets=any_tensors)
def test_token_batch_decoding(ids, offsets):
    msg = common_pb2.TokenBatch(ids=tensor_to_proto(ids), offsets=tensor_to_proto(offsets))
    try:
        r = ragged_from_proto(msg)
    except ValueError:
        return
    # accepted: a consistent batch, whose padding costs at most what the ids hold
    lengths = r.lengths
    assert int(lengths.sum()) == r.values.numel() and bool((lengths >= 0).all())
    padded, mask = r.to_padded()
    assert int(mask.sum()) == r.values.numel()


@FUZZ
@given(rows=st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=8), max_size=8))
def test_token_batch_round_trip(rows):
    r = Ragged.from_lists(rows)
    assert ragged_from_proto(ragged_to_proto(r)).tolist() == rows


@FUZZ
@given(raw=st.binary(max_size=4096))
def test_token_batch_of_arbitrary_wire_bytes(raw):
    try:
        msg = common_pb2.TokenBatch.FromString(raw)
    except DecodeError:
        return
    try:
        ragged_from_proto(msg)
    except ValueError:
        pass


@FUZZ
@given(
    extra=st.one_of(
        st.text(max_size=200),
        st.integers(1, 200_000).map(lambda n: "[" * n),
        st.integers(1, 200_000).map(lambda n: '{"a":' * n),
        st.recursive(
            st.none() | st.integers() | st.text(max_size=5),
            lambda c: st.lists(c) | st.dictionaries(st.text(max_size=3), c),
        ).map(repr),
    )
)
def test_score_item_decoding(extra):
    try:
        item = item_from_proto(
            reward_pb2.ScoreItem(data_source="openai/gsm8k", extra_info_json=extra)
        )
    except ValueError:
        return
    assert isinstance(item.extra_info, dict)


# --- answer extractors -------------------------------------------------------------------
# Model output is arbitrary, and degenerate output (long runs of one character) is common:
# texts built from the characters the patterns care about, up to tens of kilobytes.
def _runs(alphabet: str, max_len: int = 30_000):
    return st.lists(
        st.tuples(st.sampled_from(alphabet), st.integers(1, max_len)), min_size=1, max_size=6
    ).map(lambda parts: "".join(c * n for c, n in parts))


TOKENS = [
    "####",
    "$",
    " ",
    "\n",
    "\t",
    ".",
    ",",
    "-",
    "1",
    "42",
    "answer",
    "is",
    ":",
    "(",
    ")",
    "A",
    "c",
    "\\boxed{",
    "\\boxed ",
    "\\fbox{",
    "{",
    "}",
    "x",
]
texts = st.one_of(
    st.text(max_size=500),
    st.lists(st.sampled_from(TOKENS), max_size=300).map("".join),
    st.tuples(
        st.sampled_from(["#### ", "answer", "The answer is ", "\\boxed{", ""]), _runs(" \n.,-${}(")
    ).map("".join),
)


def _bounded(fn, *args, limit_s: float = 1.0):
    t0 = time.perf_counter()
    out = fn(*args)
    assert time.perf_counter() - t0 < limit_s, f"{fn.__qualname__} took too long"
    return out


@FUZZ
@given(text=texts, method=st.sampled_from(gsm8k.METHODS))
def test_gsm8k_extraction(text, method):
    out = _bounded(gsm8k.extract_answer, text, method)
    assert out is None or isinstance(out, str)
    if method == "lenient":  # verl's methods may read "" (from "#### ,") or "," as written
        assert out not in ("", "-")
    score = _bounded(lambda t: gsm8k.compute_score(t, "42", method=method), text)
    assert score in (0.0, 1.0)


@FUZZ
@given(text=texts)
def test_math_extraction(text):
    out = _bounded(math_scorer.extract_answer, text)
    assert out is None or (isinstance(out, str) and out in text)


nested = st.tuples(st.integers(0, 5000), st.integers(0, 5000), st.text("{}1\\", max_size=50)).map(
    lambda t: "\\boxed{" + "{" * t[0] + t[2] + "}" * t[1]
)


@FUZZ
@given(text=nested)
def test_boxed_nested_braces(text):
    out = _bounded(last_boxed, text)
    if out is not None:  # what was returned is balanced: the box really closed there
        depth = 0
        for c in out:
            depth += {"{": 1, "}": -1}.get(c, 0)
            assert depth >= 0
        assert depth == 0


@FUZZ
@given(text=texts, endings=st.lists(st.text(max_size=20), max_size=4))
def test_hellaswag_extraction(text, endings):
    out = _bounded(hellaswag.extract_choice, text, endings or None)
    assert out is None or 0 <= out <= 3


@pytest.mark.parametrize(
    ("fn", "text"),
    [
        # each took seconds to minutes before the patterns were rewritten
        (lambda t: gsm8k.extract_answer(t, "strict"), "#### " + " " * 50_000 + "x"),
        (lambda t: gsm8k.extract_answer(t, "flexible"), "." * 50_000),
        (lambda t: gsm8k.extract_answer(t, "lenient"), "#### " + " " * 50_000 + "x"),
        (lambda t: gsm8k.extract_answer(t, "lenient"), "#### " + "." * 50_000),
        (hellaswag.extract_choice, "answer" + " " * 50_000 + "x"),
        (hellaswag.extract_choice, "\n" * 50_000 + "x"),
    ],
)
def test_known_backtracking_inputs_are_linear(fn, text):
    _bounded(fn, text, limit_s=0.5)
