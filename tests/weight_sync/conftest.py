"""Fixtures of the weight-sync tests."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from meshrl.weight_sync.group import WeightGroup
from meshrl.weight_sync.types import GroupSpec


@pytest.fixture
def pair():
    """(sender group, receiver group), both joined; closed afterwards."""
    store, spec = WeightGroup.open("127.0.0.1", timeout_s=10, world_size=2)
    peer = GroupSpec(**{**spec.__dict__, "rank": 1})
    with ThreadPoolExecutor(2) as pool:
        sender = pool.submit(WeightGroup.join, spec, store)
        receiver = pool.submit(WeightGroup.join, peer)
        groups = sender.result(), receiver.result()
    yield groups
    for g in groups:
        g.close()
