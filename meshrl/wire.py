"""Conversions between protobuf messages and typed Python objects, used at server edges.

Tensors cross the network as raw bytes + dtype + shape; no pickle is ever involved.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from meshrl.api.v1 import common_pb2
from meshrl.ragged import Ragged

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown tensor dtype {name!r}; known: {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES[dtype]


def tensor_to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    t = t.detach().to("cpu").contiguous()
    # numpy has no bfloat16: move the raw 16-bit patterns instead.
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return common_pb2.Tensor(
        data=raw.numpy().tobytes(), dtype=dtype_name(t.dtype), shape=list(t.shape)
    )


MAX_DIMS = 8
"""More dimensions than any tensor of the API has: a request with more is malformed."""
MAX_SPAN = 2**48
"""Bound on the product of a shape's sizes, zero sizes counted as 1: an empty tensor of shape
(0, 2**62, 2**62) holds no bytes, but its strides overflow int64 in torch."""


def _check_shape(shape: tuple[int, ...]) -> int:
    """Element count of `shape`; ValueError for negative sizes, too many dimensions, or a
    shape no message could hold."""
    if len(shape) > MAX_DIMS:
        raise ValueError(f"tensor shape has {len(shape)} dimensions; at most {MAX_DIMS}")
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor shape {list(shape)} has a negative size")
    if math.prod(max(d, 1) for d in shape) > MAX_SPAN:
        raise ValueError(f"tensor shape {list(shape)} is too large")
    return math.prod(shape)  # exact: Python ints cannot overflow the way int64 products do


def tensor_from_proto(msg: common_pb2.Tensor) -> torch.Tensor:
    """An empty message (no dtype) decodes to an empty float32 tensor.

    Raises ValueError for anything malformed (unknown dtype, a byte count that is not a whole
    number of elements, a shape that does not match them); never allocates more than the
    message's own bytes.
    """
    if not msg.dtype:
        return torch.zeros(0)
    dtype = dtype_from_name(msg.dtype)
    shape = tuple(msg.shape)
    expected = _check_shape(shape)  # before touching the bytes
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(msg.data) != expected * itemsize:
        raise ValueError(
            f"tensor bytes hold {len(msg.data)} bytes but shape {list(shape)} of {msg.dtype} "
            f"needs {expected} elements ({expected * itemsize} bytes)"
        )
    if dtype == torch.bfloat16:
        arr = np.frombuffer(msg.data, dtype=np.int16)
        out = torch.from_numpy(arr.copy()).view(torch.bfloat16)
    else:
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        arr = np.frombuffer(msg.data, dtype=np_dtype)
        out = torch.from_numpy(arr.copy())
    return out.reshape(shape)


def ragged_to_proto(r: Ragged) -> common_pb2.TokenBatch:
    return common_pb2.TokenBatch(
        ids=tensor_to_proto(r.values.to(torch.int32)),
        offsets=tensor_to_proto(r.offsets.to(torch.int64)),
    )


_INTEGER = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def ragged_from_proto(msg: common_pb2.TokenBatch) -> Ragged:
    """Token rows; ValueError unless ids and offsets are 1-D integer tensors and the offsets
    start at 0, never decrease and end at the number of ids."""
    if not msg.offsets.dtype:
        return Ragged(torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
    offsets = tensor_from_proto(msg.offsets)
    ids = tensor_from_proto(msg.ids) if msg.ids.dtype else torch.zeros(0, dtype=torch.int64)
    for name, t in (("ids", ids), ("offsets", offsets)):
        if t.dim() != 1 or t.dtype not in _INTEGER:
            raise ValueError(
                f"token batch {name} must be a 1-D integer tensor, got {dtype_name(t.dtype)} "
                f"of shape {list(t.shape)}"
            )
    return Ragged(ids.to(torch.int64), offsets.to(torch.int64))


def sequences_to_proto(
    prompts: Ragged, responses: Ragged, loss_mask: Ragged | None = None
) -> common_pb2.SequenceBatch:
    """Prompts and their responses, row for row (what log-prob and value calls score);
    ``loss_mask``: 1 on the response tokens the model sampled (None: all of them)."""
    msg = common_pb2.SequenceBatch(
        prompts=ragged_to_proto(prompts), responses=ragged_to_proto(responses)
    )
    if loss_mask is not None:
        msg.loss_mask.CopyFrom(tensor_to_proto(loss_mask.values.to(torch.uint8)))
    return msg
