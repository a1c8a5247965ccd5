"""Conversions between protobuf messages and typed Python objects, used at server edges.

Tensors cross the network as raw bytes + dtype + shape; no pickle is ever involved.
"""

from __future__ import annotations

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


def tensor_from_proto(msg: common_pb2.Tensor) -> torch.Tensor:
    """An empty message (no dtype) decodes to an empty float32 tensor."""
    if not msg.dtype:
        return torch.zeros(0)
    dtype = dtype_from_name(msg.dtype)
    shape = tuple(msg.shape)
    if dtype == torch.bfloat16:
        arr = np.frombuffer(msg.data, dtype=np.int16)
        out = torch.from_numpy(arr.copy()).view(torch.bfloat16)
    else:
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        arr = np.frombuffer(msg.data, dtype=np_dtype)
        out = torch.from_numpy(arr.copy())
    expected = int(np.prod(shape)) if shape else 1
    if out.numel() != expected:
        raise ValueError(f"tensor bytes hold {out.numel()} elements but shape {shape} needs {expected}")
    return out.reshape(shape)


def ragged_to_proto(r: Ragged) -> common_pb2.TokenBatch:
    return common_pb2.TokenBatch(
        ids=tensor_to_proto(r.values.to(torch.int32)),
        offsets=tensor_to_proto(r.offsets.to(torch.int64)),
    )


def ragged_from_proto(msg: common_pb2.TokenBatch) -> Ragged:
    if not msg.offsets.dtype:
        return Ragged(torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
    return Ragged(tensor_from_proto(msg.ids).to(torch.int64), tensor_from_proto(msg.offsets))
