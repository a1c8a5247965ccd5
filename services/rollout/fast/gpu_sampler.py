"""Sampling for the fast path: the plain sampler's distribution in fewer passes over the
(rows, vocabulary) logits, which at a few hundred rows cost as much as the model step.

Without top-k/top-p, the exponential race ``argmax(p / E)`` of ``sampler.py`` is taken
in log space, ``argmax(logits / T - log E)``: the same draw, without a softmax. Greedy
takes the argmax of the logits as they come (bf16 to float32 is exact, so the same
index). Log-probs are ``logits / T - logsumexp`` at the drawn token, as before. With
top-k/top-p the plain sampler runs.

On CUDA (or under the Triton interpreter) the draw and its log-prob come from a kernel
(``SAMPLING_KERNEL``): by default :func:`kernels.sample_inverse_cdf` (the row's logsumexp
in split partials, then one uniform per row walked down the cumulative mass), else
:func:`kernels.sample_gumbel` (Gumbel-max, ``argmax(logits / T + G)``, the same
distribution as the race: ``-log E`` is a Gumbel draw). Both use their own Philox stream
keyed on the host, so a step makes no (rows, vocabulary) noise tensor and never syncs. Its seed and counter come from the request's generator:
a CUDA generator's seed and Philox offset (read and advanced on the host, as torch's own
kernels do), or a draw from a CPU generator. Same ``SamplingParams.seed``, same tokens.
Elsewhere the two reductions (race argmax, log-prob) are compiled into one pass each over
the bf16 logits on CUDA; the eager versions are the reference and the fallback.
"""

from __future__ import annotations

import logging

import torch

from services.rollout.fast import kernels
from services.rollout.native.sampler import sample
from services.rollout.types import SamplingParams

log = logging.getLogger(__name__)


def _race_argmax(logits: torch.Tensor, race: torch.Tensor, temperature: float) -> torch.Tensor:
    """argmax(logits / T - log E) over rows; race E (b, v) float32 ~ Exp(1)."""
    # A float32 draw can round to 0: log 0 = -inf would make that token win.
    noise = race.clamp_min(torch.finfo(race.dtype).tiny).log()
    return (logits.float() / temperature - noise).argmax(dim=-1)


def _logprob_at(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at tokens (b,), float32."""
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, tokens[:, None]).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


_compiled: dict[str, object] = {}


def _fn(name: str, eager, device: torch.device):
    """The compiled version on CUDA (compiled once, dynamic in the row count)."""
    if device.type != "cuda" or _compiled.get("failed"):
        return eager
    if name not in _compiled:
        _compiled[name] = torch.compile(eager, dynamic=True, fullgraph=True)
    return _compiled[name]


def sample_rows(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (b, v) -> tokens (b,) int64 and float32 log-probs (b,); no host sync."""
    if params.top_k > 0 and params.top_k < logits.shape[-1] or params.top_p < 1.0:
        return sample(logits, params, generator)
    t = params.logprob_temperature
    try:
        return _sample(logits, params, generator, t, logits.device)
    except Exception as e:  # noqa: BLE001 - a compiler problem shows at the first call
        if logits.device.type != "cuda" or _compiled.get("failed"):
            raise
        log.warning("compiled sampling failed (%s); sampling eagerly", e)
        _compiled["failed"] = True
        return _sample(logits, params, generator, t, logits.device)


SAMPLING_KERNEL = "inverse_cdf"
"""Which kernel draws: "inverse_cdf" (:func:`kernels.sample_inverse_cdf`, one uniform per
row, 71 us at 256 rows x 151,936 on the H200) or "gumbel" (:func:`kernels.sample_gumbel`, a
Philox draw per column, exact to the last bit of its noise, 160 us). Either draws from
softmax(logits / T); each has its own random stream."""


def sampling_kernel():
    if SAMPLING_KERNEL == "inverse_cdf":
        return kernels.sample_inverse_cdf
    if SAMPLING_KERNEL != "gumbel":
        raise ValueError(f"SAMPLING_KERNEL {SAMPLING_KERNEL!r}: expected gumbel or inverse_cdf")
    return kernels.sample_gumbel


def step_seed(generator: torch.Generator | None) -> tuple[int, int]:
    """(seed, offset) for one call of the sampling kernel (:func:`sampling_kernel`), on the host.

    A CUDA generator gives its seed and current Philox offset and moves the offset on (host
    state, no sync; not allowed while capturing a CUDA graph), so each call gets a new
    counter and a re-seeded generator repeats the sequence. Another generator (CPU, or None
    for the default one) gives a 62-bit seed drawn by a CPU op, offset 0.
    """
    if generator is not None and generator.device.type == "cuda":
        offset = generator.get_offset()
        generator.set_offset(offset + 4)  # CUDA generator offsets are multiples of 4
        return generator.initial_seed(), offset
    return int(torch.randint(0, 2**62, (), generator=generator)), 0


def _sample(logits, params, generator, t, device):
    if params.greedy:
        tokens = logits.argmax(dim=-1)
    elif logits.dim() == 2 and kernels.available(device) and not _compiled.get("no_kernel"):
        try:
            return sampling_kernel()(logits, t, *step_seed(generator))
        except Exception as e:  # noqa: BLE001 - a compiler problem shows at the first call
            if device.type != "cuda":
                raise
            log.warning("the sampling kernel failed (%s); sampling in torch", e)
            _compiled["no_kernel"] = True
        return _sample(logits, params, generator, t, device)
    else:
        race = torch.empty(logits.shape, dtype=torch.float32, device=device)
        race.exponential_(1.0, generator=generator)
        tokens = _fn("race", _race_argmax, device)(logits, race, t)
    return tokens, _fn("logprob", _logprob_at, device)(logits, tokens, t)
