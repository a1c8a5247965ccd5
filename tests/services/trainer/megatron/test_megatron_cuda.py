"""On a GPU, in bf16 (float32 masters on both sides): the Megatron backend's actor against
the FSDP2 backend's on the same weights and batch: log-probs, the PPO loss and the gradient
norm agree within bf16's tolerance. The two compute in bf16
differently (FSDP2 casts every weight to bf16; the Megatron backend autocasts, its norms in
float32), so they agree to bf16's precision, not bit for bit: float32 agreement is
test_megatron_backend.py's, on the CPU."""

import pytest
import torch
from trainer_helpers import make_batch, trainer_config

from meshrl.ragged import Ragged
from meshrl.testing.tiny_model import make_tiny_qwen2_dir
from services.trainer.actor import ActorRole

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def cuda_world():
    from services.trainer.distributed import World, init_distributed

    init_distributed()
    return World.current("cuda")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """Qwen2.5's head size and vocabulary, 4 layers: random weights, biases included."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_qwen2_dir(
        tmp_path_factory.mktemp("qwen2"), vocab_size=151936, hidden=512, intermediate=1024,
        layers=4, max_positions=4096,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


def test_megatron_actor_loss_grad_norm_and_log_probs_equal_fsdp2_in_bf16(qwen2_dir, cuda_world):
    batch = make_batch(16, seed=1, vocab=1000)
    overrides = ["trainer.device=cuda", "actor_rollout_ref.model.dtype=bfloat16"]
    out = {}
    for strategy in ("fsdp2", "megatron"):
        cfg = trainer_config(
            qwen2_dir, [*overrides, f"actor_rollout_ref.actor.strategy={strategy}"]
        )
        actor = ActorRole.build(cfg, cuda_world)
        logprobs, _ = actor.compute_log_probs(batch)
        if strategy == "fsdp2":  # one set of targets for both: the FSDP2 actor's log-probs
            old = logprobs
            g = torch.Generator().manual_seed(0)
            advantages = Ragged(torch.randn(old.values.shape, generator=g), old.offsets)
        metrics = actor.update_policy(batch, old, advantages, None, None, 1)
        out[strategy] = (logprobs.values, metrics)
        del actor
        torch.cuda.empty_cache()
    (lp_f, m_f), (lp_m, m_m) = out["fsdp2"], out["megatron"]
    diff = (lp_m - lp_f).abs()
    print(f"log-prob |diff| mean {diff.mean():.4f} max {diff.max():.4f}; pg_loss "
          f"{m_f['actor/pg_loss']:.5f} / {m_m['actor/pg_loss']:.5f}; grad_norm "
          f"{m_f['actor/grad_norm']:.4f} / {m_m['actor/grad_norm']:.4f}")  # fmt: skip
    # bf16 keeps 8 bits of mantissa: a log-prob of about -12 is good to ~0.05
    assert diff.mean() < 0.03 and diff.max() < 0.3
    assert m_m["actor/pg_loss"] == pytest.approx(m_f["actor/pg_loss"], rel=0.05, abs=2e-3)
    assert m_m["actor/grad_norm"] == pytest.approx(m_f["actor/grad_norm"], rel=0.05)
