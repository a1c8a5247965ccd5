"""The native engine's fast path: static KV cache, slots kept full, decode in CUDA graphs.

Same answers and interface as :class:`NativeEngine` (scoring, weights and checks are
inherited); only ``generate`` differs. One call:

    admit     waiting sequences take the free slots; their prompts are prefilled (each
              distinct prompt once, its keys/values stored in all n of its samples' slots)
              and their first tokens sampled
    decode    every running slot advances one token per step (a graph replay + sampling
              on the device); finished slots keep running, unseen, until the next check
    check     every ``check_every`` steps (or when some sequence must have hit its length),
              a read of ``done``: finished sequences are collected, their slots freed,
              and the next admit refills them. The read is queued after the round and
              taken during the next one (``harvest.py``: no sync), unless sequences wait
              for slots, one reaches its length or compaction is due

Partial rollouts: at the top of each round (a token boundary of every slot) the engine
lends itself to a waiting weight swap; the running slots then go on under the new weights
over their KV cache as it is (``keep``; the graphs read the weights in place) or over one
prefilled again under them (``recompute``, ``recompute.py``). Each token's version is kept
by ``token_versions.py``.

Runs eagerly (same code, no graphs) on CPU or with ``enforce_eager``, which is how the
tests check it against the plain engine.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from torch.profiler import record_function

from meshrl.ragged import Ragged
from services.rollout.engine import TokenBoundary, check_cancelled
from services.rollout.fast.cuda_graphs import DecodeGraphs, row_bucket, width_bucket
from services.rollout.fast.decoder import StaticDecoder, unsupported_reason
from services.rollout.fast.gpu_sampler import sample_rows
from services.rollout.fast.harvest import Check, Harvest, HarvestRings
from services.rollout.fast.kv_cache import KVView, StaticKVCache, cuda_capacity_tokens
from services.rollout.fast.recompute import recompute_running_slots
from services.rollout.fast.scheduler import Scheduler
from services.rollout.fast.slots import SlotState
from services.rollout.native.engine import NativeEngine
from services.rollout.token_versions import TokenVersions
from services.rollout.types import GenerationResult, SamplingParams

log = logging.getLogger(__name__)

_SLOT_ALIGN = 64  # slot lengths are rounded up to this: few distinct graph sets per run
_WIDTH_STEP = 128  # attended widths are rounded up to this


def fast_path_reason(model_path: str) -> str | None:
    """Why the fast path cannot serve the model in this folder (None when it can)."""
    from transformers import AutoConfig

    return unsupported_reason(AutoConfig.from_pretrained(model_path, local_files_only=True))


class FastEngine(NativeEngine):
    """A :class:`~services.rollout.engine.RolloutEngine` with a static KV cache."""

    def __init__(
        self,
        model_path: str,
        *,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        check_every: int = 8,
        read_late: bool = True,
        max_prefill_tokens: int = 16384,
        compile_ops: bool = True,
        **native: Any,
    ):
        """``native``: the :class:`NativeEngine` keywords (``tokenizer_path``, ``dtype``,
        ``device``, ``max_num_seqs``, ``logprob_batch_size``), with the same defaults."""
        super().__init__(model_path, **native)
        self.decoder = StaticDecoder(self.runner.model)
        config = self.runner.model.config
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.check_every = check_every
        self.read_late = read_late
        self._harvest_rings = HarvestRings(self.max_num_seqs, self.runner.device)
        self.max_prefill_tokens = max_prefill_tokens
        self.gpu_memory_utilization = gpu_memory_utilization
        self.decoder.rope_table(self.max_model_len)  # before any capture: graphs read it
        shape = self.decoder.kv_shape
        dev = self.runner.device
        capacity = None
        if dev.type == "cuda":
            capacity = cuda_capacity_tokens(
                shape,
                dev,
                gpu_memory_utilization,
                self._activation_reserve(),
                self.max_num_seqs * self.max_model_len,
            )
        self.cache = StaticKVCache(shape, dev, capacity)
        self.graphs = DecodeGraphs(self.decoder, self.max_num_seqs, enabled=not enforce_eager)
        if compile_ops and not enforce_eager and self.decoder.use_compiled_ops(True):
            self._warm_up()
        log.info(
            "fast engine: KV cache %.2f GiB (%s positions), cuda graphs %s",
            self.cache.nbytes / 2**30,
            capacity if capacity is not None else "grown on demand",
            "on" if self.graphs.enabled else "off",
        )

    @property
    def kv_cache_bytes(self) -> int:
        return self.cache.nbytes

    def _warm_up(self) -> None:
        """Compiles the fused ops with one tiny generate; falls back to eager ops if that
        fails (a missing compiler shows only at the first call)."""
        # A full batch, not one row: the compiled kernels pick their launch configuration
        # from the sizes of the first call (a one-row warm-up made them 10x slower).
        rows = Ragged.from_lists([[0, 1, 2, 3]] * self.max_num_seqs)
        try:
            self.generate(rows, SamplingParams(temperature=0, max_tokens=3))
        except Exception as e:  # noqa: BLE001
            log.warning(
                "compiled decoder ops failed (%s: %s); using eager ops", type(e).__name__, e
            )
            self.decoder.use_compiled_ops(False)
            self.graphs.clear()

    def _activation_reserve(self) -> int:
        """Bytes kept free for what a call allocates besides the cache: float32 logits of a
        full batch (sampling makes a few copies) and one prefill chunk's activations."""
        cfg = self.runner.model.config
        logits = 4 * self.max_num_seqs * self.vocab_size * 4
        prefill = self.max_prefill_tokens * (2 * cfg.intermediate_size + 6 * cfg.hidden_size) * 4
        return logits + prefill

    # --- memory ---

    def release_memory(self) -> None:
        self.graphs.clear()  # graphs point into the cache: drop them first
        self.cache.release()
        super().release_memory()  # marks released, empties the allocator cache

    def resume_memory(self) -> None:
        self.cache.resume()
        super().resume_memory()

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
        total = len(prompts) * params.n
        if total == 0:
            return super().generate(prompts, params)
        lengths = prompts.lengths.tolist()
        need = max(lengths) + params.max_tokens
        if need > self.max_model_len:
            raise ValueError(
                f"prompt of {max(lengths)} tokens + max_tokens {params.max_tokens} exceeds "
                f"max_model_len {self.max_model_len}"
            )
        with record_function("meshrl/setup"):
            sampling = self._sampling(params)
            slot_len = min(self.max_model_len, -(-need // _SLOT_ALIGN) * _SLOT_ALIGN)
            kv = self.cache.view(slot_len, min(total, self.max_num_seqs))
            state = SlotState(kv.slots, params.max_tokens, slot_len, self.runner.device)
            sched = Scheduler(lengths, params.n, kv.slots, params.max_tokens)
            harvest = Harvest(total, self._harvest_rings)
            versions = TokenVersions(total, self.weight_version)
        pending: Check | None = None  # the previous round's check, read during this round
        steps_done = 0
        while not sched.finished:
            check_cancelled(cancelled, steps_done)  # once a round: an Event read
            if at_token_boundary is not None and at_token_boundary.lend_if_asked():
                self._weights_swapped(versions, prompts, kv, state, sched)
            admitted = sched.admit()
            if admitted:
                with record_function("meshrl/admit"):  # named ranges in profiler traces
                    self._admit(prompts, admitted, kv, state, sampling)
            with record_function("meshrl/decode"):
                steps = sched.steps_until_check(self.check_every)
                for _ in range(steps):
                    self._decode_step(kv, state, sched, sampling)
                steps_done += steps
            with record_function("meshrl/collect"):
                check = harvest.queue_check(state.done, sched.slot_seq)
                if pending is not None and self.read_late:
                    self._collect(pending, state, sched, harvest)
                pending = check
                # Read this round's check now (a sync) when waiting a round would cost
                # more: a sequence reaches its length (the round was cut short for it),
                # sequences wait for slots, or running slots can move down to fewer rows.
                if (
                    not self.read_late
                    or steps < self.check_every
                    or sched.waiting
                    or self._compaction_due(sched)
                ):
                    self._collect(pending, state, sched, harvest)
                    pending = None
                    self._compact(kv, state, sched)
        with record_function("meshrl/finish"):
            responses, logprobs, reasons = harvest.result()
            version, token_versions = versions.result(responses.lengths)
            return GenerationResult(
                responses=responses,
                logprobs=logprobs,
                finish_reasons=reasons,
                weight_version=version,
                token_versions=token_versions,
            )

    def _weights_swapped(
        self,
        versions: TokenVersions,
        prompts: Ragged,
        kv: KVView,
        state: SlotState,
        sched: Scheduler,
    ) -> None:
        """After a swap at a round's start: notes how far each sequence was and, with
        ``recompute``, prefills the running slots again under the new weights."""
        version = self.weight_version
        if not versions.changed_to(version):
            return
        generated = torch.full((versions.total,), state.max_tokens, dtype=torch.int64)
        generated[list(sched.waiting)] = 0
        gen_len = state.gen_len.cpu()
        for slot in sched.active:
            generated[sched.slot_seq[slot]] = gen_len[slot]
        recomputed = 0
        if self.partial_rollout_kv == "recompute":
            recomputed = recompute_running_slots(
                self.decoder, kv, state, sched, prompts, self.max_prefill_tokens
            )
        versions.switch(version, generated)
        log.info("weights v%d swapped in mid-generation (KV cache: %s, %d slots recomputed)",
                 version, self.partial_rollout_kv, recomputed)  # fmt: skip

    def _admit(self, prompts: Ragged, admitted, kv: KVView, state: SlotState, sampling) -> None:
        """Prefills the admitted (sequence, slot) pairs and samples their first tokens.

        A chunk's inputs go to the device in one copy, built while the previous chunk's
        prefill runs. (That copy, from pageable memory, waits for the GPU to finish what is
        queued, so it takes the place of a sync; a copy per tensor made the GPU wait on the
        host between them, ~70 ms of a 256-prompt admit on the H200, and pinning each tensor
        cost ~40 ms.)
        """
        n = sampling.params.n
        distinct = sorted({seq // n for seq, _ in admitted})
        packed = self.decoder.packed_prefill
        chunks = _chunks_by_tokens(distinct, prompts.lengths, self.max_prefill_tokens, packed)
        logits_parts, slots_parts, lengths_parts = [], [], []
        for chunk in chunks:
            with record_function("meshrl/plan"):
                plan = _prefill_plan(prompts, chunk, admitted, n, packed)
                on = _to_device(plan, self.runner.device)
            if packed:
                logits = self.decoder.prefill_packed(
                    on["ids"],
                    on["positions"],
                    on["offsets"],
                    int(plan["max_len"]),
                    on["table"],
                    kv.k,
                    kv.v,
                )
            else:
                logits = self.decoder.prefill(
                    on["ids"], on["lengths"], kv.k, kv.v, on["dest"], on["src"]
                )
            logits_parts.append(logits[on["src"]])
            slots_parts.append(on["dest"])
            lengths_parts.append(on["lengths"][on["src"]])
        with record_function("meshrl/first_tokens"):
            logits = torch.cat(logits_parts)  # (m, V)
            tokens, logprobs = sample_rows(logits, sampling.params, sampling.generator)
            state.admit(
                torch.cat(slots_parts),
                torch.cat(lengths_parts),
                tokens,
                logprobs,
                sampling.stop_ids,
            )

    def _decode_step(self, kv: KVView, state: SlotState, sched: Scheduler, sampling) -> None:
        bs = row_bucket(sched.rows_needed(), min(kv.k.shape[1], self.max_num_seqs))
        width = width_bucket(sched.width_needed(), _WIDTH_STEP, kv.slot_len)
        logits = self.graphs.run(state.last_tokens[:bs], state.positions[:bs], kv, width)
        with record_function("meshrl/sample"):
            tokens, logprobs = sample_rows(logits, sampling.params, sampling.generator)
        with record_function("meshrl/record"):
            state.record(tokens, logprobs, sampling.stop_ids)
        sched.advance()

    def _collect(self, check: Check, state: SlotState, sched: Scheduler, harvest: Harvest):
        """Frees the slots the check found finished, their outputs gathered first."""
        finished = check.finished(sched.slot_seq)
        harvest.take(finished, state)
        sched.release(*(slot for slot, _ in finished))

    @staticmethod
    def _compaction_due(sched: Scheduler) -> bool:
        rows = sched.rows_needed()
        return bool(rows) and row_bucket(rows, 1 << 30) > row_bucket(len(sched.active), 1 << 30)

    def _compact(self, kv: KVView, state: SlotState, sched: Scheduler) -> None:
        """Once nothing waits, moves running slots down when that shrinks the step's rows."""
        if not self._compaction_due(sched):
            return
        src, dst = sched.compaction()
        if not src:
            return
        s = torch.tensor(src, device=kv.k.device)
        d = torch.tensor(dst[: len(src)], device=kv.k.device)
        kv.k[:, d] = kv.k[:, s]
        kv.v[:, d] = kv.v[:, s]
        state.move(s, d)
        sched.move(src, dst[: len(src)])


def _prefill_plan(
    prompts: Ragged, chunk: list[int], admitted, n: int, packed: bool
) -> dict[str, torch.Tensor | int]:
    """Host tensors of one prefill chunk: the prompts ``chunk`` (indices into ``prompts``)
    and the admitted (sequence, slot) pairs sampling them (sequence // n is the prompt).

    src (m,) the chunk row of each pair, dest (m,) its slot, lengths (u,) the prompts';
    packed: ids (T,) back to back, positions (T,) within the prompt, offsets (u + 1,) int32,
    max_len, table (T, C) every slot each token's key/value goes to (-1: none); padded:
    ids (u, P) right-padded.
    """
    index = {p: i for i, p in enumerate(chunk)}
    pairs = [(index[seq // n], slot) for seq, slot in admitted if seq // n in index]
    src = torch.tensor([row for row, _ in pairs], dtype=torch.int64)
    dest = torch.tensor([slot for _, slot in pairs], dtype=torch.int64)
    rows = prompts.select(chunk)
    lengths = rows.lengths
    plan: dict[str, torch.Tensor | int] = {"src": src, "dest": dest, "lengths": lengths}
    if not packed:
        plan["ids"] = rows.to_padded(pad_value=0)[0].long()  # (u, P)
        return plan
    # A prompt's c-th pair (in admission order) takes column c of its row of the table.
    order = torch.argsort(src, stable=True)
    row, slot = src[order], dest[order]
    counts = torch.bincount(row, minlength=len(chunk))
    rank = torch.arange(row.numel()) - (torch.cumsum(counts, 0) - counts)[row]
    table = torch.full((len(chunk), int(counts.max())), -1, dtype=torch.int64)
    table[row, rank] = slot
    starts = rows.offsets[:-1].repeat_interleave(lengths)
    plan.update(
        ids=rows.values.to(torch.int64),
        positions=torch.arange(rows.values.numel(), dtype=torch.int64) - starts,
        offsets=rows.offsets.to(torch.int32),
        max_len=int(lengths.max()),
        table=table.repeat_interleave(lengths, dim=0),  # (T, C): a row per token
    )
    return plan


def _to_device(plan: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The plan's tensors on ``device`` (same names, shapes and dtypes; ints stay on the
    host), moved in a single copy."""
    tensors = [(k, v) for k, v in plan.items() if isinstance(v, torch.Tensor)]
    flat = torch.cat([v.reshape(-1).to(torch.int64) for _, v in tensors])
    parts = flat.to(device).split([v.numel() for _, v in tensors])
    return {k: part.view(v.shape).to(v.dtype) for (k, v), part in zip(tensors, parts, strict=True)}


def _chunks_by_tokens(
    rows: list[int], lengths: torch.Tensor, budget: int, packed: bool = False
) -> list[list[int]]:
    """Splits prompt rows into groups whose size fits ``budget`` tokens: their total length
    when ``packed``, else their padded size (count x longest)."""
    chunks: list[list[int]] = []
    current: list[int] = []
    longest = total = 0
    for r in rows:
        length = int(lengths[r])
        size = total + length if packed else (len(current) + 1) * max(longest, length)
        if current and size > budget:
            chunks.append(current)
            current, longest, total = [], 0, 0
        current.append(r)
        longest = max(longest, length)
        total += length
    if current:
        chunks.append(current)
    return chunks
