"""What a response that spans a weight swap must carry, recomputed by teacher forcing.

A response whose first ``k`` tokens were sampled under weights A and the rest under B:

- tokens ``[0, k)``: their log-probs are A's, as a full forward of prompt + response under A
  (the engine's scoring) gives them;
- tokens ``[k, len)``, ``recompute``: B's, as a full forward under B gives them (the cache
  was rebuilt under B before token k was sampled);
- tokens ``[k, len)``, ``keep``: a forward under B over a KV cache of A. The cache held the
  keys/values of the prompt and tokens ``[0, k-1)`` computed under A (token ``k-1`` was
  sampled but not fed yet); B then fed tokens ``k-1, k, ...``, so the log-prob of token
  ``j >= k`` is B's over A's keys/values for positions before ``prompt + k - 1`` and B's own
  after. That is what :func:`keep_logprobs` computes.
"""

from __future__ import annotations

import torch

from services.rollout.native.engine import NativeEngine


def response_rows(result) -> list[tuple[list[int], list[int], list[float]]]:
    """Each response of a GenerationResult with token versions: (ids, versions, log-probs)."""
    assert result.token_versions is not None
    return list(
        zip(
            result.responses.tolist(),
            result.token_versions.tolist(),
            result.logprobs.tolist(),
            strict=True,
        )
    )


def split_point(versions: list[int], old: int, new: int) -> int:
    """The index of the first token of ``new``; asserts the versions switch at most once,
    from ``old`` to ``new``, at a token boundary (no token of any other version)."""
    k = sum(1 for v in versions if v == old)
    assert versions == [old] * k + [new] * (len(versions) - k), versions
    return k


def full_forward_logprobs(
    engine: NativeEngine, prompt: list[int], response: list[int], temperature: float
) -> torch.Tensor:
    """(len(response),) log-probs of the response under the engine's weights, one forward."""
    from meshrl.ragged import Ragged

    scores = engine.score(
        Ragged.from_lists([prompt]), Ragged.from_lists([response]), temperature, False
    )
    return scores.logprobs.values


@torch.inference_mode()
def keep_logprobs(
    old: NativeEngine,
    new: NativeEngine,
    prompt: list[int],
    response: list[int],
    k: int,
    temperature: float,
) -> torch.Tensor:
    """(len(response) - k,) log-probs of tokens ``[k, len)`` under ``new`` over the KV cache
    ``old`` made of the prompt and tokens ``[0, k-1)``; k >= 1."""
    assert 1 <= k < len(response)
    ids = torch.tensor([prompt + response], dtype=torch.int64)  # (1, t)
    past = len(prompt) + k - 1  # positions whose keys/values are the old weights'
    cache = old.runner.new_cache()
    _forward(old, ids[:, :past], 0, cache)
    logits = _forward(new, ids[:, past:-1], past, cache)  # (1, len - k, v)
    scaled = logits[0].float() / temperature
    labels = ids[0, past + 1 :]
    return torch.log_softmax(scaled, dim=-1).gather(1, labels[:, None])[:, 0]


def _forward(engine: NativeEngine, ids: torch.Tensor, start: int, cache) -> torch.Tensor:
    """Feeds ids (1, m) at positions ``start..start+m-1`` over ``cache``; logits (1, m, v)."""
    runner = engine.runner
    m = ids.shape[1]
    out = runner.model(
        input_ids=ids,
        attention_mask=torch.ones(1, start + m, dtype=torch.int64),
        position_ids=torch.arange(start, start + m)[None],
        use_cache=True,
        **{runner._cache_kwarg: cache},
    )
    return out.logits
