"""A calculator-using policy against a tool-free one, on three-digit additions, on CPU.

    .venv/bin/python -m benchmarks.learning.tool_use [--steps 30] [--warm-start 250]
        [--seeds 1 2 3] [--out DIR]

Both arms start from the same tiny model (2 layers, hidden 64, a character tokenizer of
the printable ASCII set), get the same supervised warm start (``--warm-start`` iterations
of 64 problems, drawn from the training split only), then the same PPO run through the
mesh (the demo's GAE config, the actor's learning rate 1e-4, ``--steps`` steps). They
differ in what the warm start imitates and how PPO samples:

- no tool: ``123+456=579 #### 579``, one turn (as the demo's answers);
- tool: a Hermes call ``<tool_call>{"name": "calculator", "arguments": {"expression":
  "123+456"}}</tool_call>``, the calculator's answer (not imitated: masked out of the warm
  start's loss as it is out of PPO's), then ``#### 579``; PPO runs multi-turn episodes
  against the env server (``multi_turn.environment=calculator``).

Held-out greedy accuracy (``val-core/openai/gsm8k/acc/mean@1`` on 128 problems never
trained on; the tool arm's validation episodes use the calculator too) at step 0 and at
the last step is printed and written to ``benchmarks/results/learning_cpu_tool_use.json``
(docs/multi_turn.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.testing.char_tokenizer import PRINTABLE_CHARS
from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl_app.demo.arithmetic import prompt_text, read_problems, write_arithmetic_parquet
from meshrl_app.demo.run import demo_config, held_out_accuracy
from services.env.environment import wrap_tool_response

RESULTS = Path(__file__).parents[1] / "results" / "learning_cpu_tool_use.json"
DIGITS = 3


def tool_call_text(a: int, b: int) -> str:
    args = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}+{b}"}})
    return f"<tool_call>{args}</tool_call>"


def pieces(arm: str, a: int, b: int) -> list[tuple[str, bool]]:
    """The warm start's target after the prompt: (text, imitated) pieces."""
    if arm == "no_tool":
        return [(f"{a}+{b}={a + b} #### {a + b}", True)]
    return [
        (tool_call_text(a, b), True),
        (wrap_tool_response(str(a + b)), False),  # the environment's: not imitated
        (f"#### {a + b}", True),
    ]


def encode(tokenizer, arm: str, a: int, b: int) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 where nothing is imitated) of one warm-start example."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt_text(a, b)}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    labels = [-100] * len(ids)
    for text, imitated in pieces(arm, a, b):
        part = tokenizer(text, add_special_tokens=False).input_ids
        ids += part
        labels += part if imitated else [-100] * len(part)
    ids.append(tokenizer.eos_token_id)
    labels.append(tokenizer.eos_token_id)
    return ids, labels


def warm_start(model_dir: Path, arm: str, train: list, iterations: int, seed: int) -> float:
    """Supervised iterations of 64 training problems; returns the last loss."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(iterations):
        batch = [encode(tokenizer, arm, *rng.choice(train)) for _ in range(64)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for i, (ids, lab) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
        logits = model(input_ids=input_ids).logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.save_pretrained(model_dir)
    return float(loss.detach())


def run_arm(arm: str, seed: int, out: Path, data: dict, train: list, args) -> dict:
    from meshrl_app.run_local import run_local
    from services.coordinator.metrics.sinks import read_jsonl

    root = out / f"{arm}_seed{seed}"
    model_dir = make_tiny_model_dir(root / "model", seed=seed, chars=PRINTABLE_CHARS)
    t0 = time.perf_counter()
    loss = warm_start(model_dir, arm, train, args.warm_start, seed)
    warm_s = time.perf_counter() - t0
    overrides = [
        f"data.val_files=[{data['test']}]",
        f"data.train_files=[{data['train']}]",
        "data.max_prompt_length=16",
        "data.max_response_length=160",
        f"data.train_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch // 2}",
        f"critic.ppo_mini_batch_size={args.batch // 2}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}",
        f"trainer.save_freq={args.steps}",
        f"trainer.seed={seed}",
        f"data.seed={seed}",
        f"actor_rollout_ref.actor.optim.lr={args.actor_lr}",
        "trainer.plot=false",
    ]
    if arm == "tool":
        overrides += [
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.environment=calculator",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
            "actor_rollout_ref.rollout.multi_turn.max_turn_tokens=100",
        ]
    cfg = demo_config(root, overrides)
    t0 = time.perf_counter()
    run_local(cfg)
    ppo_s = time.perf_counter() - t0
    val = held_out_accuracy(read_jsonl(root / "run" / "metrics.jsonl"))
    (_, a0), (s1, a1) = val[0], val[-1]
    return {
        "arm": arm,
        "seed": seed,
        "warm_start_iterations": args.warm_start,
        "warm_start_final_loss": round(loss, 4),
        "warm_start_s": round(warm_s, 1),
        "acc_step0": a0,
        "acc_final": a1,
        "final_step": s1,
        "acc_by_step": dict(val),
        "ppo_wall_s": round(ppo_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warm-start", type=int, default=250)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--test-freq", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--actor-lr", type=float, default=1e-4, help="the demo's is 3e-4")
    ap.add_argument("--arms", nargs="+", default=["no_tool", "tool"])
    ap.add_argument("--out", type=Path, default=Path("tool_use_out"))
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    data = write_arithmetic_parquet(args.out / "data", n_train=4096, n_val=128, digits=DIGITS)
    train = sorted(read_problems(data["train"]))
    runs = []
    for seed in args.seeds:
        for arm in args.arms:
            runs.append(run_arm(arm, seed, args.out, data, train, args))
            r = runs[-1]
            print(
                f"{arm}, seed {seed}: held-out greedy accuracy {r['acc_step0']:.3f} -> "
                f"{r['acc_final']:.3f} (warm start {r['warm_start_s']:.0f}s, "
                f"PPO {r['ppo_wall_s']:.0f}s)",
                flush=True,
            )
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "task": f"{DIGITS}-digit addition, 4096 training / 128 held-out problems",
        "command": "python -m benchmarks.learning.tool_use "
        f"--steps {args.steps} --warm-start {args.warm_start} --batch {args.batch} "
        f"--seeds {' '.join(map(str, args.seeds))} --actor-lr {args.actor_lr}",
        "runs": runs,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
