"""The native rollout engine: batched sampling with a KV cache on a Hugging Face causal LM.

Runs on CPU (development, CI) or one GPU, eager. A generate call expands B prompts into
B*n sequences and decodes them in chunks of at most ``max_num_seqs``:

    prefill   each distinct prompt of the chunk once (left-padded), then copy its KV cache
              rows to its n samples
    step()    schedule (drop finished rows) -> run (one decode forward) -> postprocess
              (sample, record, check stops), until every sequence has stopped

The log-probs returned with the tokens are float32 ``log_softmax(logits / T)``, the same
quantity :meth:`NativeEngine.compute_logprobs` (and the trainer) get from a full forward.

Partial rollouts: before each decode step (a token boundary) the engine lends itself to a
waiting weight swap (``at_token_boundary``); the unfinished rows then go on under the new
weights, over their KV cache as it is (``keep``) or over one recomputed under the new weights
(``recompute``), and each token's version is kept (``token_versions.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import NamedTuple

import torch

from meshrl.algorithms.entropy import entropy_from_logits, logprobs_from_logits
from meshrl.ragged import Ragged
from meshrl.weight_sync.types import GroupSpec
from meshrl.wire import dtype_from_name
from services.rollout.engine import (
    KVAfterSwap,
    MemoryReleasedError,
    TokenBoundary,
    WeightIntake,
    check_cancelled,
)
from services.rollout.eos import eos_token_ids
from services.rollout.intake import InProcessIntake
from services.rollout.native.batch import DecodeBatch, left_pad
from services.rollout.native.model_runner import ModelRunner
from services.rollout.native.sampler import sample
from services.rollout.token_versions import TokenVersions
from services.rollout.types import FinishReason, GenerationResult, SamplingParams, TokenScores

log = logging.getLogger(__name__)

_PAD_ID = 0  # any valid id: padded positions are masked out


class _Sampling(NamedTuple):
    """What every step of one generate call samples with."""

    params: SamplingParams
    generator: torch.Generator
    stop_ids: torch.Tensor  # (s,) int64: EOS ids + the request's stop ids


class _Call(NamedTuple):
    """What every chunk of one generate call shares besides sampling."""

    cancelled: threading.Event | None
    at_token_boundary: TokenBoundary | None
    versions: TokenVersions
    steps: list[int]  # decode steps of the call so far, for a cancellation's message


class NativeEngine:
    """A :class:`~services.rollout.engine.RolloutEngine` in plain torch + transformers."""

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        max_num_seqs: int = 256,
        logprob_batch_size: int = 16,
        max_model_len: int | None = None,
        partial_rollout_kv: KVAfterSwap = "keep",
    ):
        """``max_model_len``: positions a prompt and its response may take together (the run
        gives data.max_prompt_length + data.max_response_length); None: the model's
        ``max_position_embeddings``, or no limit when its config has none.
        ``partial_rollout_kv``: the KV cache of unfinished rows at a weight swap mid-call."""
        if max_num_seqs < 1 or logprob_batch_size < 1:
            raise ValueError("max_num_seqs and logprob_batch_size must be >= 1")
        self.partial_rollout_kv = partial_rollout_kv
        self.runner = ModelRunner(model_path, dtype_from_name(dtype), device)
        self.model_path = model_path
        self.max_model_len = max_model_len or getattr(
            self.runner.model.config, "max_position_embeddings", None
        )
        self._max_len_source = (
            "data.max_prompt_length + data.max_response_length"
            if max_model_len
            else "the model's max_position_embeddings"
        )
        self.max_num_seqs = max_num_seqs
        self.logprob_batch_size = logprob_batch_size
        model = self.runner.model
        self.eos_token_ids = eos_token_ids(
            [getattr(model, "generation_config", None), model.config], tokenizer_path or model_path
        )
        self.weight_version = 0
        self._released = False
        log.info(
            "native engine: %s (%d parameters, %s, %s), eos ids %s",
            model_path,
            self.num_parameters,
            dtype,
            device,
            self.eos_token_ids,
        )

    @property
    def num_parameters(self) -> int:
        return self.runner.num_parameters

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def kv_cache_bytes(self) -> int:
        return 0  # the KV cache lives only during a generate call

    # --- generation ---

    def generate(
        self,
        prompts: Ragged,
        params: SamplingParams,
        cancelled: threading.Event | None = None,
        at_token_boundary: TokenBoundary | None = None,
    ) -> GenerationResult:
        self._check_memory()
        self._check_tokens(prompts, "prompts")
        self._check_length(prompts, params.max_tokens)
        sampling = self._sampling(params)
        total = len(prompts) * params.n
        call = _Call(cancelled, at_token_boundary, TokenVersions(total, self.weight_version), [0])
        tokens: list[torch.Tensor] = []
        logprobs: list[torch.Tensor] = []
        reasons: list[FinishReason] = []
        for start in range(0, total, self.max_num_seqs):
            seqs = range(start, min(total, start + self.max_num_seqs))
            chunk = self._generate_chunk(prompts, seqs, sampling, call)
            t, lp, r = chunk.results()
            tokens += t
            logprobs += lp
            reasons += r
        responses = _ragged(tokens, torch.int64)
        version, token_versions = call.versions.result(responses.lengths)
        return GenerationResult(
            responses=responses,
            logprobs=_ragged(logprobs, torch.float32),
            finish_reasons=reasons,
            weight_version=version,
            token_versions=token_versions,
        )

    def _generate_chunk(
        self, prompts: Ragged, seqs: range, sampling: _Sampling, call: _Call
    ) -> DecodeBatch:
        """Decodes sequences ``seqs`` (sequence k is sample k % n of prompt k // n) to the
        end; counts its decode steps into ``call.steps[0]``."""
        check_cancelled(call.cancelled, call.steps[0])
        self._at_token_boundary(call, seqs, None, sampling.params.max_tokens)
        batch, logits = self._prefill(prompts, seqs, sampling.params)
        tokens, logprobs = sample(logits, sampling.params, sampling.generator)
        num_alive = batch.append(tokens, logprobs, sampling.stop_ids)
        while num_alive:
            check_cancelled(call.cancelled, call.steps[0])  # an Event read: nothing next to a step
            self._at_token_boundary(call, seqs, batch, sampling.params.max_tokens)
            num_alive = self.step(batch, num_alive, sampling)
            call.steps[0] += 1
        return batch

    def _at_token_boundary(
        self, call: _Call, seqs: range, batch: DecodeBatch | None, max_tokens: int
    ) -> None:
        """Lends the engine to a waiting weight swap; if the weights changed, notes where
        each sequence of the call was and, with ``recompute``, rebuilds the batch's cache.
        ``batch``: the chunk ``seqs`` being decoded (None: not prefilled yet)."""
        if call.at_token_boundary is None or not call.at_token_boundary.lend_if_asked():
            return
        version = self.weight_version
        if not call.versions.changed_to(version):
            return
        generated = torch.zeros(call.versions.total, dtype=torch.int64)
        generated[: seqs.start] = max_tokens  # earlier chunks: finished
        if batch is not None:
            generated[seqs.start : seqs.stop] = batch.lengths.cpu()
            if self.partial_rollout_kv == "recompute":
                self._recompute_cache(batch)
        call.versions.switch(version, generated)
        log.info("weights v%d swapped in mid-generation (KV cache: %s)", version,
                 self.partial_rollout_kv)  # fmt: skip

    def _recompute_cache(self, batch: DecodeBatch) -> None:
        """Prefills every row's prompt and tokens so far, but the last one (fed by the next
        step), under the weights now loaded, into a fresh cache."""
        fed = batch.prompt_width + batch.step - 1  # columns the cache holds
        ids = torch.cat([batch.prompt_ids, batch.tokens[batch.seq_ids, : batch.step - 1]], dim=1)
        cache = self.runner.new_cache()
        self.runner.prefill(ids, batch.attention_mask[:, :fed], cache)  # (rows, fed)
        batch.cache = cache

    def _prefill(
        self, prompts: Ragged, seqs: range, params: SamplingParams
    ) -> tuple[DecodeBatch, torch.Tensor]:
        """Runs each distinct prompt of the chunk once; returns the batch and logits (rows, v)."""
        n = params.n
        first = seqs.start // n
        distinct = prompts.select(range(first, (seqs.stop - 1) // n + 1))
        ids, mask = left_pad(distinct, _PAD_ID, self.runner.device)  # (u, P)
        cache = self.runner.new_cache()
        logits = self.runner.prefill(ids, mask, cache)  # (u, v)
        rows = torch.arange(seqs.start, seqs.stop, device=ids.device) // n - first  # (rows,)
        if rows.numel() != len(distinct):
            # n samples of a prompt share its prefill: copy its KV rows instead of recomputing.
            cache.batch_select_indices(rows)
            logits, mask = logits[rows], mask[rows]
        ids = ids[rows]  # (rows, P): kept for a recompute of the cache after a weight swap
        return DecodeBatch.start(cache, ids, mask, params.max_tokens), logits

    def step(self, batch: DecodeBatch, num_alive: int, sampling: _Sampling) -> int:
        """One decode step of every row; returns the rows still alive."""
        # schedule: once half the rows are done, stop paying for them.
        if num_alive <= len(batch.seq_ids) // 2:
            batch.compact()
        # run
        logits = self.runner.decode(*batch.decode_inputs(), batch.cache)  # (rows, v)
        # postprocess
        tokens, logprobs = sample(logits, sampling.params, sampling.generator)
        return batch.append(tokens, logprobs, sampling.stop_ids)

    def _sampling(self, params: SamplingParams) -> _Sampling:
        generator = torch.Generator(device=self.runner.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        stop = sorted(set(self.eos_token_ids) | set(params.stop_token_ids))
        stop_ids = torch.tensor(stop, dtype=torch.int64, device=self.runner.device)
        return _Sampling(params, generator, stop_ids)

    # --- scoring ---

    def compute_logprobs(self, prompts: Ragged, responses: Ragged, temperature: float) -> Ragged:
        return self.score(prompts, responses, temperature, with_entropy=False).logprobs

    def score(
        self, prompts: Ragged, responses: Ragged, temperature: float, with_entropy: bool
    ) -> TokenScores:
        """Log-probs (and entropy) of each response token from a full forward over
        prompt+response, right-padded, as the trainer computes them."""
        self._check_memory()
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self._check_tokens(prompts, "prompts")
        self._check_tokens(responses, "responses", allow_empty=True)
        logprobs, entropy = [], []
        for start in range(0, len(prompts), self.logprob_batch_size):
            rows = range(start, min(len(prompts), start + self.logprob_batch_size))
            lp, ent = self._score_chunk(
                prompts.select(rows), responses.select(rows), temperature, with_entropy
            )
            logprobs.append(lp)
            entropy.append(ent)
        offsets = responses.offsets
        return TokenScores(
            logprobs=Ragged(_cat(logprobs), offsets),
            entropy=Ragged(_cat(entropy), offsets) if with_entropy else None,
        )

    def _score_chunk(
        self, prompts: Ragged, responses: Ragged, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat log-probs and entropy (total_response_tokens,) of one chunk."""
        p_len, r_len = prompts.lengths, responses.lengths  # (b,)
        if int(r_len.sum()) == 0:
            return torch.zeros(0), torch.zeros(0)
        joined = Ragged.from_tensors(
            [torch.cat([prompts.row(i), responses.row(i)]) for i in range(len(prompts))]
        )
        ids, mask = joined.to_padded(pad_value=_PAD_ID)  # (b, t) right-padded
        # Response token j of row i is predicted at column p_i - 1 + j; only the columns from
        # the first such prediction to the last one need logits.
        lo, hi = int(p_len.min()) - 1, int((p_len + r_len).max()) - 1
        columns = torch.arange(lo, hi)  # (k,)
        device = self.runner.device
        ids, mask, columns = ids.long().to(device), mask.long().to(device), columns.to(device)
        scaled = self.runner.logits_at(ids, mask, columns).float() / temperature  # (b, k, v)
        labels = ids[:, lo + 1 : hi + 1]  # (b, k): the token each kept column predicts
        col = columns[None, :]  # (1, k)
        p_len, r_len = p_len.to(device)[:, None], r_len.to(device)[:, None]  # (b, 1)
        wanted = (col >= p_len - 1) & (col < p_len + r_len - 1)  # (b, k) response predictions
        logprobs = logprobs_from_logits(scaled, labels)[wanted].cpu()
        entropy = entropy_from_logits(scaled)[wanted].cpu() if with_entropy else torch.zeros(0)
        return logprobs, entropy

    # --- weights and memory ---

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        count = self.runner.load_weights(named_tensors)
        log.info("loaded %d tensors", count)

    def join_weight_group(self, spec: GroupSpec) -> WeightIntake:
        """This process is the group's member: see ``services/rollout/intake.py``."""
        return InProcessIntake.join(self, spec)

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The model's own tensors by Hugging Face name: a weight sync may receive straight
        into them (under the rollout's engine lock), and ``load_weights`` then copies nothing."""
        model = self.runner.model
        targets = dict(model.named_parameters(remove_duplicate=False))
        targets.update(model.named_buffers(remove_duplicate=False))
        return {name: t.detach() for name, t in targets.items()}

    def release_memory(self) -> None:
        self._released = True
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        self._released = False

    def reset_prefix_cache(self) -> None:
        """Nothing to drop: prompt prefixes are shared only within one generate call."""

    # --- checks ---

    def _check_memory(self) -> None:
        if self._released:
            raise MemoryReleasedError("rollout memory is released: resume it before generating")

    def _check_length(self, prompts: Ragged, max_tokens: int) -> None:
        """Every prompt plus max_tokens within max_model_len. Past it the model would run on
        positions it never saw (rope extrapolates silently), and the GPU engines refuse it:
        the same request must fail the same way on a CPU."""
        if self.max_model_len is None or len(prompts) == 0:
            return
        lengths = prompts.lengths  # (b,)
        i = int(lengths.argmax())
        if int(lengths[i]) + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompts[{i}] has {int(lengths[i])} tokens; with sampling.max_tokens "
                f"{max_tokens} that exceeds max_model_len {self.max_model_len} "
                f"({self._max_len_source})"
            )

    def _check_tokens(self, rows: Ragged, field: str, allow_empty: bool = False) -> None:
        """Token ids inside the vocabulary, and no empty rows unless allowed."""
        if not allow_empty and len(rows) and int(rows.lengths.min()) == 0:
            i = int((rows.lengths == 0).nonzero()[0])
            raise ValueError(f"{field}[{i}] is empty")
        rows.check_token_ids(field, self.vocab_size)


def _ragged(rows: list[torch.Tensor], dtype: torch.dtype) -> Ragged:
    if not rows:
        return Ragged(torch.zeros(0, dtype=dtype), torch.zeros(1, dtype=torch.int64))
    return Ragged.from_tensors(rows)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0)
