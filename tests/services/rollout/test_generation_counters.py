"""The rollout server's counters of one Generate call, partial rollouts' included."""

import torch
from prometheus_client import CollectorRegistry

from meshrl.ragged import Ragged
from services.rollout.metrics import ALL, count_generation

# The rollout's metrics are exported by a rollout server alone (metrics.register); read
# here through a registry of the test's own.
REGISTRY = CollectorRegistry()
for metric in ALL:
    REGISTRY.register(metric)


def _read(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def test_a_call_spanning_a_sync_counts_once_with_its_older_tokens():
    names = [
        "meshrl_rollout_spanning_generations_total",
        "meshrl_rollout_older_version_tokens_total",
        "meshrl_rollout_generated_tokens_total",
    ]
    before = [_read(n) for n in names]
    prompts = Ragged.from_lists([[1, 2], [3]])
    responses = Ragged.from_lists([[4, 5, 6], [7, 8]])
    count_generation(prompts, responses, ["length", "stop"])  # no sync landed
    versions = Ragged(torch.tensor([2, 3, 3, 2, 2]), responses.offsets)  # 3 tokens of v2
    count_generation(prompts, responses, ["length", "stop"], versions, weight_version=3)
    after = [_read(n) for n in names]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 3, 10]
