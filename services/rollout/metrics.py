"""The rollout server's own Prometheus metrics, beside every server's (meshrl.rpc.metrics):
what it generated and with which weights. Kept whether or not an endpoint serves them (a
counter's increment is a few hundred nanoseconds a Generate call).

Made outside prometheus_client's default registry: every server process may import this
module (the fork server imports every server's code once), and only a rollout server
exports them, once :func:`register` is called as it starts. Before, the reward and trainer
servers exported ``meshrl_rollout_weight_version`` too."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from prometheus_client import REGISTRY, Counter, Gauge

from meshrl.ragged import Ragged

PROMPT_TOKENS = Counter(
    "meshrl_rollout_prompt_tokens_total",
    "Prompt tokens of the Generate calls (each prompt once).",
    registry=None,
)
GENERATED_TOKENS = Counter(
    "meshrl_rollout_generated_tokens_total",
    "Response tokens generated (training and validation; an EOS that ended one counts).",
    registry=None,
)
GENERATED_SEQUENCES = Counter(
    "meshrl_rollout_generated_sequences_total",
    "Responses generated.",
    ["finish_reason"],
    registry=None,
)
SPANNING_GENERATIONS = Counter(
    "meshrl_rollout_spanning_generations_total",
    "Generate calls whose responses span a weight sync that landed mid-generation (partial "
    "rollouts).",
    registry=None,
)
OLDER_VERSION_TOKENS = Counter(
    "meshrl_rollout_older_version_tokens_total",
    "Response tokens sampled under an older weight version than the newest of their Generate "
    "call (partial rollouts).",
    registry=None,
)
WEIGHT_VERSION = Gauge(
    "meshrl_rollout_weight_version",
    "Version of the weights the engine generates with: 0 as loaded, then that of the last "
    "weight sync; -1 before Initialize.",
    registry=None,
)


ALL = (
    PROMPT_TOKENS,
    GENERATED_TOKENS,
    GENERATED_SEQUENCES,
    SPANNING_GENERATIONS,
    OLDER_VERSION_TOKENS,
    WEIGHT_VERSION,
)
_registered = False


def register() -> None:
    """Exports the rollout's metrics from this process (a rollout server); once."""
    global _registered
    if not _registered:
        for metric in ALL:
            REGISTRY.register(metric)
        _registered = True


def count_generation(
    prompts: Ragged,
    responses: Ragged,
    finish_reasons: Sequence[str],
    token_versions: Ragged | None = None,
    weight_version: int = 0,
) -> None:
    """Counts one Generate call's prompt and response tokens and its responses; with
    ``token_versions`` (a sync landed mid-call), the call and its tokens older than
    ``weight_version``."""
    PROMPT_TOKENS.inc(int(prompts.values.numel()))
    GENERATED_TOKENS.inc(int(responses.values.numel()))
    for reason, n in collections.Counter(finish_reasons).items():
        GENERATED_SEQUENCES.labels(reason).inc(n)
    if token_versions is not None:
        SPANNING_GENERATIONS.inc()
        OLDER_VERSION_TOKENS.inc(int((token_versions.values != weight_version).sum()))


def report_weight_version(read: Callable[[], int]) -> None:
    """``meshrl_rollout_weight_version`` read from ``read`` at each scrape."""
    WEIGHT_VERSION.set_function(read)
