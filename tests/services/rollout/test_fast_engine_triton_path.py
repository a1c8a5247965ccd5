"""The fast engine end to end on its Triton path (packed prefill, rope + cache write,
flash-decoding, SiLU, one-pass sampling), run on CPU by Triton's interpreter: greedy tokens
and log-probs equal the plain engine's, the right-padded prefill's and those of whole (not
split) o/down projections, seeded sampling repeats and its log-probs match scoring, and a model
whose head size the kernels cannot tile takes the torch attention path.

The interpreter must be on before triton first launches a kernel, so the engine runs in a
child process with ``TRITON_INTERPRET=1``.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]

CHILD = r"""
import sys
import torch
from meshrl.ragged import Ragged
from meshrl.testing.tiny_model import make_tiny_model_dir, make_tiny_qwen2_dir
from services.rollout.types import SamplingParams
from services.rollout.fast.engine import FastEngine
from services.rollout.native.engine import NativeEngine

root = sys.argv[1]
g = torch.Generator().manual_seed(0)
prompts = Ragged.from_lists(
    [[1] + torch.randint(4, 22, (int(n),), generator=g).tolist() for n in (3, 9, 0, 14, 6)]
)
greedy = SamplingParams(temperature=0, max_tokens=6, n=2)

# Qwen2 shape: 4 query heads over 2 kv heads of 16 dims; 3 slots for 10 sequences (refills).
path = make_tiny_qwen2_dir(f"{root}/qwen2")
fast = FastEngine(str(path), max_num_seqs=3, check_every=3)
assert fast.decoder.attention == "triton" and fast.decoder.triton_mlp, fast.decoder.attention
want = NativeEngine(str(path)).generate(prompts, greedy)
got = fast.generate(prompts, greedy)
assert got.responses.tolist() == want.responses.tolist(), "greedy tokens differ"
torch.testing.assert_close(got.logprobs.values, want.logprobs.values, atol=1e-5, rtol=0)

# Prompts prefilled packed (above: the kernel stores each prompt in its n slots) = right-
# padded through SDPA = packed in chunks of at most 16 tokens. Two tokens each: the prefill
# is what differs.
assert fast.decoder.packed_prefill


def first_tokens(result, k):
    return [r[:k] for r in result.responses.tolist()], sum([r[:k] for r in result.logprobs.tolist()], [])


short = SamplingParams(temperature=0, max_tokens=2, n=2)
fast.decoder.pack_prompts = False
padded = fast.generate(prompts, short)
fast.decoder.pack_prompts, fast.max_prefill_tokens = True, 16
chunked = fast.generate(prompts, short)
fast.max_prefill_tokens = 16384
# Rope and the cache write as a kernel of their own before the attention (the default has
# them inside it), then the decode projections as Triton GEMMs (gate/up with SiLU x up
# fused): the same tokens (a decode step after the prefill's).
assert fast.decoder.rope_in_attention
fast.decoder.rope_in_attention = False
two_kernels = fast.generate(prompts, short)
fast.decoder.rope_in_attention, fast.decoder.linear_kernels = True, True
gemms = fast.generate(prompts, short)
fast.decoder.linear_kernels = False
# o_proj and down_proj whole, and the compiled add + norm after them, instead of split over
# K with the partials summed by the add + norm (the default).
assert fast.decoder.split_projections
fast.decoder.split_projections = False
whole = fast.generate(prompts, short)
fast.decoder.split_projections = True
for other, k in ((padded, 2), (chunked, 2), (two_kernels, 2), (gemms, 2), (whole, 2)):
    tokens, logprobs = first_tokens(other, k)
    want_tokens, want_logprobs = first_tokens(got, k)
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-5, rtol=0)

sampled = SamplingParams(temperature=0.8, max_tokens=3, n=2, seed=3)
first, again = fast.generate(prompts, sampled), fast.generate(prompts, sampled)
assert first.responses.tolist() == again.responses.tolist(), "a seed must repeat"
repeated = prompts.select([i for i in range(len(prompts)) for _ in range(2)])
scores = fast.score(repeated, first.responses, 0.8, with_entropy=False)
torch.testing.assert_close(scores.logprobs.values, first.logprobs.values, atol=1e-4, rtol=0)

# Head size 24: not a power of two, so the torch attention path, with the same answers.
path = make_tiny_model_dir(f"{root}/llama24", hidden=48)
fast = FastEngine(str(path), max_num_seqs=4)
assert fast.decoder.head_dim == 24 and fast.decoder.attention == "matmul"
want = NativeEngine(str(path)).generate(prompts, greedy)
assert fast.generate(prompts, greedy).responses.tolist() == want.responses.tolist()
print("ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (its interpreter runs the kernels on CPU)",
)
def test_triton_path_equals_plain_engine_in_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0 and child.stdout.strip().endswith("ok"), child.stderr[-4000:]
