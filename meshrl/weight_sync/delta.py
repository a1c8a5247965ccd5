"""Delta syncs: only the elements that changed since the last sync, checked per tensor.

Between two PPO steps most bf16 weights keep their bits (an update below a weight's bf16
resolution changes nothing). With ``weight_sync.delta`` the actor keeps, per bucket, the
wire-dtype bytes it last sent, and each side of the group keeps one ``DeltaState`` (on its
``WeightGroup``: a new formation starts with none, so its first sync is full). A sync of
the delta protocol sends, per bucket, a small ``meta`` tensor and then a payload:

``meta`` (int64, ``META_HEAD + len(bucket.params)``): [kind, changed elements,
payload bytes, checksum of each parameter of the bucket's result]. kind is ``DENSE`` (the
payload is the whole flat bucket) or ``SPARSE`` (the payload is bytes: int32 indices
into the flat bucket, then their values); a bucket is sent dense whenever that is not larger.

The checksums are those of the bucket's values after the sync, computed on the actor's
device from its kept copy and compared on the receiver with what it built; a receiver that
holds another version than the sync's base, or whose result differs in any tensor, drains
the rest of the sync without touching its model further and raises
:class:`WeightIntegrityError` (the group is then closed and the next sync, in a new group,
is full). See docs/weight_sync.md, "Delta syncs".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from meshrl.weight_sync.types import BucketPlan, WeightManifest

log = logging.getLogger(__name__)

DENSE, SPARSE = 0, 1
META_HEAD = 3
"""kind, changed elements, payload bytes; the per-parameter checksums follow."""
_INDEX = torch.int32  # buckets are far below 2**31 elements
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22
_BLOCK = 16  # words summed before weighting
_MIX = 1000003  # folds partial sums together
_weights: dict[torch.device, torch.Tensor] = {}


class WeightIntegrityError(RuntimeError):
    """A delta sync was refused: the receiver holds another base, or a tensor's checksum
    differs from the sender's. Nothing after the failing bucket reached the model."""


def layout_key(manifest: WeightManifest) -> tuple:
    """What must not change between a delta sync and its base (the bucket plan)."""
    return tuple(
        (b.numel, b.dtype, tuple((p.name, p.offset, p.numel) for p in b.params))
        for b in manifest.buckets
    )


@dataclass
class DeltaState:
    """One side's copy of what the last sync left, bucket by bucket, in the wire dtype."""

    layout: tuple = ()
    version: int | None = None
    """Version the buffers hold; None while a sync is writing them (or after a failure)."""
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)

    def base_for(self, manifest: WeightManifest) -> int:
        """The version a delta to ``manifest`` can start from, or -1 (a full sync)."""
        if self.version is None or self.layout != layout_key(manifest):
            return -1
        return self.version

    def begin(self, manifest: WeightManifest) -> None:
        if manifest.base_version < 0 or self.layout != layout_key(manifest):
            self.buffers.clear()
        self.layout = layout_key(manifest)
        self.version = None

    def buffer(self, k: int, bucket: BucketPlan, device: torch.device) -> torch.Tensor:
        buf = self.buffers.get(k)
        if buf is None:
            buf = self.buffers[k] = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        return buf


def checksum(flat: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """A 0-dim int64 of a contiguous 1-D tensor's bits, on its device; ``offset`` is the
    position of its first element in its bucket (buckets start 8-byte aligned), so that
    sender and receiver read the same words.

    The bytes are read as 64-bit words (the few elements before the first aligned word and
    after the last, one by one); the words are summed in blocks of 16 and each block sum is
    weighted by its position, so a value changed, missing or moved to another block counts
    (a permutation inside one block of 128 bytes would not). Integer sums wrap, so the
    result does not depend on the order of the reduction. It costs about one pass over the
    bytes (widening each bf16 element to int64 and weighting each cost about ten)."""
    size = flat.element_size()
    per, n = 8 // size, flat.numel()
    head = min(n, (-offset) % per)
    if (flat.data_ptr() + head * size) % 8:  # aligned otherwise than a bucket: realign
        shift = offset % per
        buf = torch.empty(n + per, dtype=flat.dtype, device=flat.device)
        buf[shift : shift + n].copy_(flat)
        return checksum(buf[shift : shift + n], offset)
    body = (n - head) // per
    words = flat[head : head + body * per].view(torch.int64)
    blocks = body // _BLOCK
    acc = _weighted_sum(flat[:head].view(_INTS[size]))
    if blocks:
        sums = words[: blocks * _BLOCK].view(blocks, _BLOCK).sum(1)
        acc = acc * _MIX + _weighted_sum(sums)
    acc = acc * _MIX + _weighted_sum(words[blocks * _BLOCK :])
    return acc * _MIX + _weighted_sum(flat[head + body * per :].view(_INTS[size]))


def _weighted_sum(ints: torch.Tensor) -> torch.Tensor:
    """Sum of each element (as int64) times its position's weight, chunk by chunk."""
    w = _weights.get(ints.device)
    if w is None:
        w = _weights[ints.device] = torch.arange(_CHUNK, device=ints.device) % 65521 + 1
    acc = torch.zeros((), dtype=torch.int64, device=ints.device)
    for start in range(0, ints.numel(), _CHUNK):
        part = ints[start : start + _CHUNK]
        acc = acc * _MIX + (part.to(torch.int64) * w[: part.numel()]).sum()
    return acc


def bucket_checksums(bucket: BucketPlan, flat: torch.Tensor) -> torch.Tensor:
    """Each parameter's checksum, int64 (len(bucket.params),)."""
    return torch.stack(
        [checksum(flat[p.offset : p.offset + p.numel], p.offset) for p in bucket.params]
    )


def changed_elements(
    new: torch.Tensor, kept: torch.Tensor, at_most: int | None = None
) -> tuple[torch.Tensor | None, int]:
    """(int64 indices of the elements whose bits differ, ascending; their number).

    Compared as 64-bit words first (a quarter of the bf16 comparisons), then element by
    element inside the words that changed only, so the cost follows the change. When more
    than ``at_most`` words changed (more elements than that changed, then), the indices
    are not built (None): only the number, by one comparison of every element."""
    ints = _INTS[new.element_size()]
    per, n = 8 // new.element_size(), new.numel()
    body = n // per * per
    if per == 1 or not body or new.data_ptr() % 8 or kept.data_ptr() % 8:
        index = (new.view(ints) != kept.view(ints)).nonzero().view(-1)
        return index, index.numel()
    new_words, kept_words = new[:body].view(torch.int64), kept[:body].view(torch.int64)
    words = (new_words != kept_words).nonzero().view(-1)
    if at_most is not None and words.numel() > at_most:
        return None, int(torch.count_nonzero(new.view(ints) != kept.view(ints)))
    inside = new_words[words].view(ints).view(-1, per) != kept_words[words].view(ints).view(-1, per)
    rows, cols = inside.nonzero(as_tuple=True)
    tail = (new[body:].view(ints) != kept[body:].view(ints)).nonzero().view(-1)
    index = torch.cat([words[rows] * per + cols, tail + body])
    return index, index.numel()


@dataclass
class Encoded:
    """A bucket as the delta protocol sends it."""

    meta: torch.Tensor
    payload: torch.Tensor
    changed: int


def encode(bucket: BucketPlan, new: torch.Tensor, kept: torch.Tensor, full: bool) -> Encoded:
    """Sender: the meta and payload of one bucket; ``kept`` (the bucket as last sent) is
    updated to ``new``. A full sync sends every bucket dense. A payload of no bytes (nothing
    changed) is not broadcast at all."""
    itemsize = bucket.dtype.itemsize
    dense_bytes = bucket.numel * itemsize
    if full:
        kept.copy_(new)
        changed, kind, payload = bucket.numel, DENSE, kept
    else:
        # Sparse only if smaller: fewer than this many elements (so words) changed.
        most = (dense_bytes - 1) // (_INDEX.itemsize + itemsize)
        index, changed = changed_elements(new, kept, at_most=most)
        sparse_bytes = changed * (_INDEX.itemsize + itemsize)
        if index is not None and sparse_bytes < dense_bytes:
            kind = SPARSE
            payload = torch.empty(sparse_bytes, dtype=torch.uint8, device=new.device)
            cut = changed * _INDEX.itemsize
            payload[:cut].view(_INDEX).copy_(index)
            values = payload[cut:].view(bucket.dtype)
            torch.index_select(new, 0, index, out=values)
            kept.index_copy_(0, index, values)
        else:
            kind = DENSE
            kept.copy_(new)
            payload = kept
    sums = bucket_checksums(bucket, kept)
    head = torch.tensor([kind, changed, payload.numel() * payload.element_size()])
    meta = torch.cat([head.to(sums.device), sums])
    return Encoded(meta, payload, changed)


def empty_meta(bucket: BucketPlan, device: torch.device) -> torch.Tensor:
    return torch.zeros(META_HEAD + len(bucket.params), dtype=torch.int64, device=device)


def payload_buffer(
    bucket: BucketPlan, meta: torch.Tensor, base: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """Receiver: where the payload announced by ``meta`` lands (a dense bucket straight into
    ``base``, the receiver's copy; None: a bucket to drain only)."""
    kind, nbytes = int(meta[0]), int(meta[2])
    if kind == DENSE and base is not None:
        return base
    if kind == DENSE:
        return torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def apply(bucket: BucketPlan, meta: torch.Tensor, payload: torch.Tensor, base: torch.Tensor):
    """Receiver: writes a received payload into ``base``; raises WeightIntegrityError if a
    parameter's checksum then differs from the sender's (``meta[META_HEAD:]``)."""
    if int(meta[0]) == SPARSE:
        changed = int(meta[1])
        cut = changed * _INDEX.itemsize
        index = payload[:cut].view(_INDEX).to(torch.int64)
        base.index_copy_(0, index, payload[cut:].view(bucket.dtype))
    elif payload.data_ptr() != base.data_ptr():
        base.copy_(payload)
    expected = meta[META_HEAD:].to(base.device)
    got = bucket_checksums(bucket, base)
    bad = [
        p.name for p, ok in zip(bucket.params, (got == expected).tolist(), strict=True) if not ok
    ]
    if bad:
        raise WeightIntegrityError(
            f"checksum of {len(bad)} tensor(s) differs from the sender's after the sync: "
            f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"
        )
