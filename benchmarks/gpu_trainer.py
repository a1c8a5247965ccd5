"""The actor update on the GPU: MFU of one PPO mini-batch of 16 x 1024 tokens (512 prompt
+ 512 response) of the Qwen2.5-0.5B shape, through the real ActorRole (FSDP2 with bf16
compute over float32 masters, fused AdamW, chunked LM head), eager and with compiled
decoder layers. First, the chunked head is checked against full logits."""

from __future__ import annotations

import os
import time

import torch

from benchmarks.gpu_models import make_model_dir, qwen05_config
from meshrl.ragged import Ragged


def check_chunked_head() -> dict:
    """bf16 model: log-probs and gradients through the chunked head vs plain logits."""
    from transformers import Qwen2ForCausalLM

    from services.trainer.chunked_head import install_chunked_head

    torch.manual_seed(0)
    with torch.device("cuda"):
        plain = Qwen2ForCausalLM(qwen05_config(layers=4)).to(torch.bfloat16)
        fused = Qwen2ForCausalLM(qwen05_config(layers=4)).to(torch.bfloat16)
    fused.load_state_dict(plain.state_dict())
    head = install_chunked_head(fused, chunk_rows=1000)
    ids = torch.randint(10, 151936, (4, 512), device="cuda")
    labels = torch.cat([ids[:, 1:], ids.new_zeros(4, 1)], dim=1)
    logits = plain(input_ids=ids).logits.float()
    lp_plain = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)[:, :-1]
    head.expect(labels, 1.0, True)
    scores = fused(input_ids=ids).logits
    lp_fused = scores[..., 0][:, :-1]
    lp_plain.sum().backward()
    lp_fused.sum().backward()

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    return {
        "logprob_max_abs": float((lp_fused - lp_plain).abs().max()),
        "grad_rel_err_embed": rel(
            fused.model.embed_tokens.weight.grad, plain.model.embed_tokens.weight.grad
        ),
        "grad_rel_err_layer0_q": rel(
            fused.model.layers[0].self_attn.q_proj.weight.grad,
            plain.model.layers[0].self_attn.q_proj.weight.grad,
        ),
    }


def actor_update(
    model_dir: str,
    compile_layers: bool,
    checkpointing: bool,
    updates: int = 3,
    device: str = "cuda",
    vocab: int = 151936,
    tokens: int = 512,
    profile_path: str | None = None,
) -> dict:
    from meshrl.config import build_config
    from services.trainer.actor import ActorRole
    from services.trainer.distributed import World, init_distributed
    from services.trainer.sequences import SequenceBatch

    os.environ["MESHRL_COMPILE_LAYERS"] = "1" if compile_layers else "0"
    init_distributed()
    tree = {
        "data": {"train_batch_size": 16, "max_prompt_length": 512, "max_response_length": 512},
        "trainer": {"device": device},
        "actor_rollout_ref": {
            "model": {
                "path": model_dir,
                "dtype": "bfloat16",
                "enable_gradient_checkpointing": checkpointing,
            },
            "actor": {
                "ppo_mini_batch_size": 16,
                "ppo_micro_batch_size_per_gpu": 16,
                "optim": {"lr": 1e-6},
            },
            "rollout": {"n": 1, "temperature": 1.0, "log_prob_micro_batch_size_per_gpu": 16},
        },
    }
    cfg = build_config(tree, [])
    actor = ActorRole.build(cfg, World.current(device))
    cuda = device == "cuda"
    g = torch.Generator().manual_seed(3)
    prompts = Ragged.from_tensors(
        [torch.randint(10, vocab, (tokens,), generator=g) for _ in range(16)]
    )
    responses = Ragged.from_tensors(
        [torch.randint(10, vocab, (tokens,), generator=g) for _ in range(16)]
    )
    batch = SequenceBatch(prompts, responses)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    old, _ = actor.compute_log_probs(batch)
    _sync(cuda)
    first_logprob_s = time.perf_counter() - start
    start = time.perf_counter()
    old, _ = actor.compute_log_probs(batch)
    _sync(cuda)
    logprob_s = time.perf_counter() - start
    adv = old.with_values(torch.randn(old.values.numel(), generator=g))
    runs = []
    for step in range(1, updates + 1):
        m = actor.update_policy(batch, old, adv, None, None, global_step=step)
        runs.append(
            {
                k: v
                for k, v in m.items()
                if k.startswith("perf/")
                or k in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl")
            }
        )
    if profile_path:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            actor.update_policy(batch, old, adv, None, None, global_step=updates + 1)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        with open(profile_path, "w") as f:
            f.write(table)
    out = {
        "mfu": runs[-1]["perf/mfu/actor"],
        "mfu_each": [r["perf/mfu/actor"] for r in runs],
        "tokens_per_s": runs[-1]["perf/throughput/actor"],
        "step_s": 16 * 1024 / runs[-1]["perf/throughput/actor"],
        "old_logprob_s": logprob_s,
        "first_logprob_s": first_logprob_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "last": runs[-1],
    }
    del actor
    if cuda:
        torch.cuda.empty_cache()
    return out


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def trainer_bench(
    deadline: float, workdir: str = "/tmp/meshrl_gpu", out_dir: str = "", quick: bool = False
) -> dict:
    path = make_model_dir(f"{workdir}/qwen05_fp32", dtype=torch.float32)
    out = {}
    try:
        out["chunked_head_check"] = check_chunked_head()
    except Exception as e:  # noqa: BLE001
        out["chunked_head_check"] = {"error": f"{type(e).__name__}: {e}"}
    for name, compile_layers, ckpt in (
        ("eager", False, False),
        ("compiled", True, False),
        ("eager_checkpointing", False, True),
    ):
        if time.monotonic() > deadline - 90 or (quick and ckpt):
            out[name] = {"skipped": "out of time"}
            continue
        try:
            prof = f"{out_dir}/trainer_profile.txt" if name == "eager" and out_dir else None
            out[name] = actor_update(path, compile_layers, ckpt, profile_path=prof)
        except Exception as e:  # noqa: BLE001
            import traceback

            out[name] = {
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc()[-2000:],
            }
        print(f"[trainer/{name}] {out[name]}", flush=True)
    out["mfu"] = max((v.get("mfu", 0) for v in out.values() if isinstance(v, dict)), default=0)
    return out
