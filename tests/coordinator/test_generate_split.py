"""generate_split: prompts spread over rollout replicas, each with a seed of its own."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from meshrl.ragged import Ragged
from services.coordinator.ppo_step import REPLICA_SEED_STRIDE, generate_split
from services.rollout.types import SamplingParams


class FakeReplica:
    """Answers each prompt with its first token plus the seed it was asked with."""

    def __init__(self):
        self.seeds: list[int | None] = []

    def generate(self, prompts: Ragged, sampling: SamplingParams):
        seed = sampling.seed
        self.seeds.append(seed)
        rows = [[row[0], seed or 0] for row in prompts.tolist()]
        return SimpleNamespace(
            responses=Ragged.from_lists(rows),
            logprobs=Ragged.from_lists([[0.0, 0.0] for _ in rows]),
            finish_reasons=["length"] * len(rows),
            weight_version=3,
        )


def test_each_replica_samples_with_its_own_seed_and_the_order_is_kept():
    replicas = [FakeReplica(), FakeReplica(), FakeReplica()]
    prompts = Ragged.from_lists([[p, 1] for p in range(7)])
    sampling = SamplingParams(max_tokens=2, n=1, seed=41)
    with ThreadPoolExecutor(3) as pool:
        out = generate_split(replicas, prompts, sampling, pool)
    assert [r.seeds for r in replicas] == [
        [41],
        [41 + REPLICA_SEED_STRIDE],
        [41 + 2 * REPLICA_SEED_STRIDE],
    ]
    assert [row[0] for row in out.responses.tolist()] == list(range(7))  # joined in order
    assert sampling.seed == 41 and out.weight_version == 3  # the caller's params untouched


def test_an_unset_seed_stays_unset_on_every_replica():
    replicas = [FakeReplica(), FakeReplica()]
    with ThreadPoolExecutor(2) as pool:
        generate_split(replicas, Ragged.from_lists([[1], [2]]), SamplingParams(), pool)
    assert [r.seeds for r in replicas] == [[None], [None]]
