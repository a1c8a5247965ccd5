"""A decode step cut into row groups (``split_decode.py``) computes what the whole batch
does: the same logits and the same keys/values written to the cache (CPU, float32; the
groups run one after another here, on parallel streams on a GPU)."""

import pytest
import torch

from meshrl.testing.tiny_model import make_tiny_qwen2_dir
from services.rollout.fast_engine import FastEngine
from services.rollout.split_decode import SplitDecode, row_groups

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return FastEngine(str(make_tiny_qwen2_dir(tmp_path_factory.mktemp("qwen2"))), max_num_seqs=40)


@pytest.mark.parametrize(
    "rows, parts, groups",
    [
        (256, 2, [(0, 128), (128, 256)]),
        (256, 4, [(0, 64), (64, 128), (128, 192), (192, 256)]),
        (40, 2, [(0, 32), (32, 40)]),
        (40, 3, [(0, 16), (16, 32), (32, 40)]),
        (20, 4, [(0, 16), (16, 20)]),  # fewer groups than asked: none under 16 rows but the last
        (7, 2, [(0, 7)]),
    ],
)
def test_row_groups_cover_the_rows_at_whole_tiles(rows, parts, groups):
    assert row_groups(rows, parts) == groups


def test_row_groups_refuse_nothing_to_cut():
    with pytest.raises(ValueError, match="rows > 0"):
        row_groups(0, 2)


@pytest.mark.parametrize("parts", [2, 3])
def test_split_step_equals_the_whole_batch(engine, parts):
    rows, width = 40, 64
    dec = engine.decoder
    g = torch.Generator().manual_seed(parts)
    kv = engine.cache.view(width, rows)
    for t in (kv.k, kv.v):
        t.copy_(torch.randn(t.shape, generator=g))
    tokens = torch.randint(4, engine.vocab_size, (rows,), generator=g)
    positions = torch.randint(0, width, (rows,), generator=g)
    before_k, before_v = kv.k.clone(), kv.v.clone()

    whole = dec.decode(tokens, positions, kv.k, kv.v, width)
    whole_k, whole_v = kv.k.clone(), kv.v.clone()
    assert not torch.equal(whole_k, before_k)  # the step wrote its keys: the check can fail
    kv.k.copy_(before_k)
    kv.v.copy_(before_v)
    split = SplitDecode(dec, parts)(tokens, positions, kv.k, kv.v, width)

    assert split.shape == whole.shape == (rows, engine.vocab_size)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.k, whole_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kv.v, whole_v, atol=1e-6, rtol=1e-6)


def test_split_needs_two_parts(engine):
    with pytest.raises(ValueError, match="parts >= 2"):
        SplitDecode(engine.decoder, 1)
