"""The rollout replicas as one generator: a batch cut into requests, each sent to the replica
with the fewest prompts outstanding, the results joined in prompt order.

    batch of b prompts -> requests of `rollout.prompts_per_request` prompts, request j seeded
    seed + j * REQUEST_SEED_STRIDE -> the live replica with the fewest prompts outstanding
    (at most ``in_flight`` requests each) -> joined in prompt order

A replica holds at most two requests: one generating, one waiting behind its engine lock, so
it never idles on a round trip. A fast replica frees its room sooner and takes more requests;
a long-tailed request keeps one replica busy, not the others.

A replica whose call fails as down (the connection refused or lost: UNAVAILABLE) leaves the
pool; its requests in flight are sent again to the others (``rollout/resent_requests``). The
generation fails (that RoleCallError, so the run's recovery takes over) only when no replica
is left. A failed request is never turned into an empty response, so a failed rollout never
becomes a zero reward. The run brings the replicas that left back at its next step boundary
(:mod:`services.coordinator.recovery.pool_membership`).

The seed of a request comes from its place in the batch, not from the replica that serves it:
the same batch samples the same responses however its requests were spread.
"""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from meshrl.ragged import Ragged
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.generation.dispatch_gate import DispatchGate
from services.rollout.client import RolloutClient
from services.rollout.types import GenerationResult, SamplingParams

log = logging.getLogger(__name__)

REQUEST_SEED_STRIDE = 1_000_033
"""Seed offset between a batch's requests: far apart from the step seeds
(seed * 1_000_003 + step). With one seed for every request, row r of each request drew the
same noise: a prompt that two requests both hold sampled the very same responses."""

REQUESTS_PER_REPLICA = 4
"""Requests per configured replica when ``rollout.prompts_per_request`` is unset."""

DOWN_CODES = ("UNAVAILABLE",)
"""gRPC status codes that say the replica is gone (connection refused or lost, a server
shutting down), not that the request is wrong: another replica may serve it."""


def replica_down(err: RoleCallError) -> bool:
    """Whether a failed call says its replica is gone rather than the request bad."""
    return err.code_name in DOWN_CODES


def replica_label(name: str) -> str:
    """``rollout2`` -> ``2``: a replica's name in metric keys."""
    return name.removeprefix("rollout")


def token_versions(result: GenerationResult) -> Ragged:
    """The weight version of each response token: the result's own, else every token of
    its ``weight_version``."""
    if result.token_versions is not None:
        return result.token_versions.with_values(result.token_versions.values.long())
    ids = result.responses.values
    return result.responses.with_values(torch.full_like(ids, result.weight_version).long())


def request_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Request ``index``'s sampling: the same, with a seed of its own (unset stays unset)."""
    if index == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed + index * REQUEST_SEED_STRIDE)


def prompts_per_request(configured: int | None, batch: int, replicas: int) -> int:
    """Prompts a request carries: ``configured``, else the whole batch for one replica and
    a quarter of each replica's share for several (``replicas`` is the configured number,
    not the live one: the requests, and so their seeds, do not change with the pool)."""
    if configured is not None:
        return configured
    if replicas <= 1:
        return max(batch, 1)
    return max(1, math.ceil(batch / (REQUESTS_PER_REPLICA * replicas)))


@dataclass
class ReplicaStats:
    """One replica's work since the pool's metrics were last read."""

    tokens: int = 0
    """Response tokens it generated."""
    requests: int = 0


@dataclass
class PoolStats:
    resent: int = 0
    """Requests sent again after their replica went down."""
    seconds: float = 0.0
    """Wall time of the pool's generations."""
    replicas: dict[str, ReplicaStats] = field(default_factory=dict)


class RolloutPool:
    """Live rollout replicas by name (``rollout0``, ...) and the requests spread over them.
    Thread-safe: ``add``/``remove`` may come while a generation runs (a removed replica takes
    no new request; those it holds finish)."""

    def __init__(
        self,
        replicas: dict[str, RolloutClient],
        configured_replicas: int,
        prompts_per_request: int | None = None,
        in_flight: int = 2,
    ):
        self._live: dict[str, RolloutClient] = dict(replicas)
        self._departed: list[str] = []
        self.configured_replicas = configured_replicas
        self.prompts_per_request = prompts_per_request
        self.in_flight = in_flight
        self._lock = threading.Lock()
        self._stats = PoolStats()
        self.gate = DispatchGate()
        """Closed by a weight sync that must not overlap a request (fully async mode)."""

    # --- membership ---------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._live)

    @property
    def clients(self) -> list[RolloutClient]:
        with self._lock:
            return list(self._live.values())

    def __iter__(self) -> Iterator[RolloutClient]:
        return iter(self.clients)

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def add(self, name: str, client: RolloutClient) -> None:
        with self._lock:
            self._live[name] = client

    def remove(self, name: str) -> RolloutClient | None:
        with self._lock:
            return self._live.pop(name, None)

    def take_departed(self) -> list[str]:
        """The replicas that went down since the last call, in the order they left."""
        with self._lock:
            departed, self._departed = self._departed, []
            return departed

    def _leave(self, name: str, err: RoleCallError) -> None:
        with self._lock:
            if self._live.pop(name, None) is None:
                return  # its other request failed first
            self._departed.append(name)
            left = len(self._live)
        log.warning(
            "rollout replica %s left the pool (%s); its requests go to the %d left", name, err, left
        )

    # --- generation ---------------------------------------------------------------------
    def generate(
        self, prompts: Ragged, sampling: SamplingParams, mixed_versions: bool = False
    ) -> GenerationResult:
        """B·n responses, sample j of prompt i at row i·n + j, whichever replicas served them;
        ``token_versions`` always filled (a request's ``weight_version`` where it sent none).
        ``mixed_versions``: requests may be served by different weight versions (a sync
        landed during the batch, fully async mode); ``weight_version`` is then the newest.

        Raises:
            RoleCallError: no replica is left (the last one's error), or a call failed for
                a reason other than its replica going down.
            RuntimeError: the replicas served different weight versions (unless
                ``mixed_versions``).
        """
        start = time.perf_counter()
        b = len(prompts)
        size = prompts_per_request(self.prompts_per_request, b, self.configured_replicas)
        bounds = list(range(0, b, size)) + [b] if b else [0, 0]
        requests = [prompts.select(range(lo, hi)) for lo, hi in itertools.pairwise(bounds)]
        results = self._dispatch(requests, sampling)
        with self._lock:
            self._stats.seconds += time.perf_counter() - start
        versions = {r.weight_version for r in results}
        if len(versions) != 1 and not mixed_versions:
            raise RuntimeError(
                f"rollout replicas serve different weight versions: {sorted(versions)}"
            )
        return GenerationResult(
            responses=Ragged.from_tensors(
                [r.responses.row(i) for r in results for i in range(len(r.responses))]
            ),
            logprobs=Ragged.from_tensors(
                [r.logprobs.row(i) for r in results for i in range(len(r.logprobs))]
            ),
            finish_reasons=[x for r in results for x in r.finish_reasons],
            weight_version=max(versions),
            token_versions=Ragged.concat([token_versions(r) for r in results]),
        )

    def _dispatch(
        self, requests: Sequence[Ragged], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """Each request's result, in order: requests go out as replicas have room, and come
        back to the queue's front when their replica goes down."""
        results: list[GenerationResult | None] = [None] * len(requests)
        pending = deque(range(len(requests)))
        running: dict[Future, tuple[str, int]] = {}
        outstanding: dict[str, int] = {}  # prompts held by each replica
        last_error: RoleCallError | None = None
        executor = ThreadPoolExecutor(
            max_workers=max(1, self.in_flight * len(self)), thread_name_prefix="pool"
        )
        try:
            while pending or running:
                while (
                    pending
                    and (target := self._least_loaded(outstanding, running)) is not None
                    and self.gate.try_enter()
                ):
                    name, client = target
                    i = pending.popleft()
                    future = executor.submit(
                        # in the caller's context: a validation's calls are said as such
                        contextvars.copy_context().run,
                        client.generate,
                        requests[i],
                        request_sampling(sampling, i),
                    )
                    future.add_done_callback(lambda _: self.gate.leave())
                    running[future] = (name, i)
                    outstanding[name] = outstanding.get(name, 0) + len(requests[i])
                if not running:
                    if not self.gate.is_open:  # a weight sync: requests go out after it
                        self.gate.wait_open()
                        continue
                    assert last_error is not None  # only replicas that went down leave
                    raise last_error  # requests left, no replica to take them
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    name, i = running.pop(future)
                    outstanding[name] -= len(requests[i])
                    try:
                        results[i] = future.result()
                    except RoleCallError as err:
                        if not replica_down(err):
                            raise
                        last_error = err
                        self._leave(name, err)
                        pending.appendleft(i)
                        with self._lock:
                            self._stats.resent += 1
                        continue
                    self._count(name, results[i])
        finally:
            # A failure leaves the other calls to their threads (each has its deadline).
            executor.shutdown(wait=False, cancel_futures=True)
        return [r for r in results if r is not None]

    def _least_loaded(
        self, outstanding: dict[str, int], running: dict[Future, tuple[str, int]]
    ) -> tuple[str, RolloutClient] | None:
        """The live replica with room and the fewest prompts outstanding (the first named
        on a tie); None when none has room."""
        held: dict[str, int] = {}
        for name, _ in running.values():
            held[name] = held.get(name, 0) + 1
        with self._lock:
            room = [(n, c) for n, c in self._live.items() if held.get(n, 0) < self.in_flight]
        if not room:
            return None
        return min(room, key=lambda nc: outstanding.get(nc[0], 0))

    def _count(self, name: str, result: GenerationResult | None) -> None:
        assert result is not None
        with self._lock:
            stats = self._stats.replicas.setdefault(name, ReplicaStats())
            stats.tokens += int(result.responses.lengths.sum())
            stats.requests += 1

    # --- metrics ------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """The pool's metrics since they were last read (a step's), then starts afresh:
        ``rollout/replicas`` (live now), ``rollout/resent_requests``, and per replica
        ``rollout/replica/<i>/tokens_per_s`` (its response tokens over the wall time of the
        pool's generations) and ``.../requests``; ``<i>`` is ``rollout<i>``'s number."""
        with self._lock:
            stats, self._stats = self._stats, PoolStats()
            out = {
                "rollout/replicas": float(len(self._live)),
                "rollout/resent_requests": float(stats.resent),
            }
            names = sorted(set(self._live) | set(stats.replicas))
        for name in names:
            replica = stats.replicas.get(name, ReplicaStats())
            key = f"rollout/replica/{replica_label(name)}"
            out[f"{key}/tokens_per_s"] = replica.tokens / max(stats.seconds, 1e-9)
            out[f"{key}/requests"] = float(replica.requests)
        return out
