"""RewardScorer: the logic the reward server calls (no gRPC here).

Per item: the rule scorer of its data_source (or the custom function, for every data_source)
runs in a worker process; with a reward model enabled, the model scores the item too and
``score = rule + weight * rm`` (items without a rule scorer get ``weight * rm``). Extras:
``rule_score`` and ``acc`` (rule score >= 1 - 1e-6, unless the scorer gave its own ``acc``),
``rm_score`` and ``rm_cut`` (1.0 when the pair was longer than the model's ``max_length`` and
lost its start, else 0.0).

Thread-safe: the server's Score calls share one RewardScorer. Their samples interleave in the
worker pool; the reward model (in this process) scores one call's batch at a time.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshrl.config.sections import RewardConfig
from services.reward.pool import DEFAULT_MEMORY_LIMIT_MB, ScorerPool
from services.reward.scorers.registry import DATA_SOURCES, UnknownDataSource, known_data_sources
from services.reward.types import (
    CANCELLED_REASON,
    ScoreItem,
    ScoreOutcome,
    ScoringCancelled,
    failed,
)

if TYPE_CHECKING:  # torch + transformers: imported only with a reward model
    from services.reward.reward_model import ScoredPair

log = logging.getLogger(__name__)

ACC_TOLERANCE = 1e-6
ANY_SOURCE = "*"
"""Listed among the known names when every data_source is accepted (custom function, RM)."""
MODEL_WAIT_POLL_S = 0.1
"""How often a call waiting for the reward model checks whether its caller has left."""


class RewardScorer:
    """Scores batches of items per `cfg` (a RewardConfig, or anything with its fields)."""

    def __init__(self, cfg: RewardConfig | None = None, *, memory_limit_mb: int | None = None):
        self.cfg = cfg or RewardConfig()
        _check_reward_model(self.cfg)  # fail before any worker starts
        if memory_limit_mb is None:  # 0 = no limit
            memory_limit_mb = getattr(self.cfg, "memory_limit_mb", DEFAULT_MEMORY_LIMIT_MB)
        self.pool = ScorerPool(self.cfg.num_workers, memory_limit_mb)
        # One batch at a time through the model: a fast tokenizer refuses concurrent use
        # ("Already borrowed") and concurrent forwards would only share the same cores.
        self._model_lock = threading.Lock()
        self._calls_lock = threading.Lock()
        self._calls: set[threading.Event] = set()
        """The `cancelled` events of the calls under way (set by `abandon`)."""
        self._abandoned = False
        self._warned_of_cuts = False
        try:
            self.pool.warm_up()
            if self.cfg.custom_function:
                self.pool.check_custom(self.cfg.custom_function)
            self.reward_model = _load_reward_model(self.cfg)
        except BaseException:
            self.pool.close()
            raise

    @property
    def _rule_options(self) -> dict[str, dict[str, Any]]:
        """The rule scorers' keyword arguments per family, from the config."""
        return {"gsm8k": {"method": self.cfg.gsm8k_method}}

    def known_data_sources(self) -> list[str]:
        names = known_data_sources()
        return names + [ANY_SOURCE] if self._accepts_any else names

    @property
    def _accepts_any(self) -> bool:
        return bool(self.cfg.custom_function) or self.reward_model is not None

    def validate(self, items: list[ScoreItem]) -> None:
        """Raises UnknownDataSource for the first item no scorer can score (before any work)."""
        if self._accepts_any:
            return
        for it in items:
            if it.data_source not in DATA_SOURCES:
                raise UnknownDataSource(it.data_source, self.known_data_sources())

    def score(
        self,
        items: list[ScoreItem],
        timeout_s: float | None = None,
        when_caller_leaves: Callable[[Callable[[], None]], object] | None = None,
    ) -> list[ScoreOutcome]:
        """One outcome per item, same order. Raises only UnknownDataSource (a bad request).

        ``when_caller_leaves(fn)``: registers ``fn`` to run once the caller is gone, and
        returns False if it is gone already (the server passes its RPC's
        ``add_callback``); ``fn`` cancels the samples not scored yet, so they stop taking
        the workers and the reward model from other calls' samples. A cancelled call's
        samples come back failed (``CANCELLED_REASON``)."""
        self.validate(items)
        timeout = timeout_s if timeout_s and timeout_s > 0 else self.cfg.timeout_s
        custom = self.cfg.custom_function
        ruled = [i for i, it in enumerate(items) if custom or it.data_source in DATA_SOURCES]
        pending = self.pool.submit([items[i] for i in ruled], timeout, custom, self._rule_options)
        cancelled = threading.Event()  # read by the reward model between micro-batches

        def cancel() -> None:
            cancelled.set()
            ScorerPool.cancel(pending)

        with self._calls_lock:
            self._calls.add(cancelled)
            if self._abandoned:
                cancelled.set()
        try:
            if when_caller_leaves is not None and when_caller_leaves(cancel) is False:
                cancel()
            try:
                # in this process, while the workers score the rules
                rm = self._model_scores(items, cancelled)
            except ScoringCancelled:  # `cancel` or `abandon` took its rule samples too
                return [failed(CANCELLED_REASON) for _ in items]
            rule = dict(zip(ruled, self.pool.collect(pending, timeout), strict=True))
        finally:
            with self._calls_lock:
                self._calls.discard(cancelled)
        return [
            _combine(rule.get(i), rm[i] if rm else None, self._rm_weight) for i in range(len(items))
        ]

    def _warn_of_cut_pairs(self, scored: list[ScoredPair]) -> None:
        """Says once per scorer (each Initialize builds one: once a run), at the first call
        that cuts any, that pairs lose their start to the model's length limit; a run logs
        how many each step as ``reward/rm_clip_ratio``. Called under ``_model_lock``."""
        cut = sum(pair.cut for pair in scored)
        if not cut or self._warned_of_cuts:
            return
        self._warned_of_cuts = True
        limit, asked = self.reward_model.max_length, self.cfg.reward_model.max_length
        if limit < asked:  # capped at load to what the model's positions can read
            limit_is = (
                f"the reward model's max_position_embeddings={limit} tokens (which "
                f"reward.reward_model.max_length={asked} was cut to at load)"
            )
        else:
            limit_is = (
                f"reward.reward_model.max_length={limit} tokens (raise it to score them whole)"
            )
        log.warning(
            "reward model: %d of %d (prompt, response) pairs were longer than %s and lost "
            "their start (the head reads the end); said once, a run logs reward/rm_clip_ratio "
            "each step",
            cut,
            len(scored),
            limit_is,
        )

    @property
    def _rm_weight(self) -> float:
        return self.cfg.reward_model.weight

    def _model_scores(
        self, items: list[ScoreItem], cancelled: threading.Event
    ) -> list[ScoredPair] | None:
        """The reward model's scores, or None without one. Raises ScoringCancelled once
        ``cancelled`` is set, also while waiting for another call's batch to finish."""
        if self.reward_model is None or not items:
            return None
        while not self._model_lock.acquire(timeout=MODEL_WAIT_POLL_S):
            if cancelled.is_set():
                raise ScoringCancelled("before the reward model took it")
        try:
            scored = self.reward_model.score_pairs(
                [it.prompt for it in items], [it.response for it in items], cancelled
            )
            self._warn_of_cut_pairs(scored)
            return scored
        finally:
            self._model_lock.release()

    def close(self) -> None:
        self.pool.close()

    def abandon(self) -> None:
        """Closes at once: the rule samples being scored are cancelled, and the calls
        using the reward model stop after the micro-batch under way (a forward running in
        this process cannot be cut short). Their samples come back failed."""
        with self._calls_lock:
            self._abandoned = True
            calls = list(self._calls)
        for cancelled in calls:
            cancelled.set()
        self.pool.abandon()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_reward_model(cfg: RewardConfig) -> None:
    """ValueError for a reward model that cannot be one (no path, a path that does not exist,
    a language model, ...), before the workers start and any weights are read."""
    rm = cfg.reward_model
    if not rm.enable:
        return
    if not rm.path:
        raise ValueError("reward.reward_model.enable is true but reward.reward_model.path is empty")
    from services.reward.reward_model import checked_config  # torch + transformers: only when used

    checked_config(rm.path)


def _load_reward_model(cfg: RewardConfig):
    rm = cfg.reward_model
    if not rm.enable:
        return None
    from services.reward.reward_model import RewardModel  # torch + transformers: only when used

    log.info("loading reward model %s", rm.path)
    return RewardModel(rm.path, micro_batch_size=rm.micro_batch_size, max_length=rm.max_length)


def _combine(rule: ScoreOutcome | None, scored: ScoredPair | None, weight: float) -> ScoreOutcome:
    if rule is not None and not rule.ok:
        return rule
    out = ScoreOutcome(score=0.0)
    if rule is not None:
        out.pred = rule.pred
        out.extra.update(rule.extra)
        out.extra["rule_score"] = rule.score
        out.extra.setdefault("acc", float(rule.score >= 1.0 - ACC_TOLERANCE))
        out.score += rule.score
    if scored is not None:
        rm = scored.score
        if not math.isfinite(rm):
            return ScoreOutcome(score=0.0, ok=False, reason=f"reward model returned {rm}")
        out.extra["rm_score"] = rm
        out.extra["rm_cut"] = float(scored.cut)
        out.score += weight * rm
    return out
