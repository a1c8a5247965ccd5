"""The actor update as a PPO step runs it, on the GPU: the old-log-prob pass, then the
update of 16 x (512 + 512) mini-batches; MFU of the update alone (``perf/mfu/actor``).

Only the trainer's public calls are used (``ActorRole.build``, ``compute_log_probs``,
``update_policy``) and ``trainer/update.py``'s ``_actor_tree``, so the same file times an
older checkout too: copy ``benchmarks/`` into that checkout and run it there. Processes of
the two checkouts, alternated in one device call, compare them on one machine state.

    python3 -m benchmarks.trainer.actor_update --label new --out $OUT
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics

import torch

from benchmarks.gpu_models import make_model_dir
from benchmarks.system.host_timeline import Timeline, timed_ranges, wait_for_quiet_children
from benchmarks.trainer.update import _actor_tree


def ppo_order_updates(
    model_dir: str,
    mini_batches: int,
    updates: int,
    tokens: int = 512,
    device: str = "cuda",
    timeline: bool = False,
) -> dict:
    """``updates`` PPO-ordered actor updates of ``mini_batches`` mini-batches of 16 rows,
    timed after two warm-up updates and a quiet host (torch.compile's workers idle).
    ``timeline``: one more update timed point by point without the profiler
    (``host_timeline``), under "timeline"."""
    from meshrl.config import build_config
    from meshrl.ragged import Ragged
    from services.trainer.actor import ActorRole
    from services.trainer.distributed import World, init_distributed
    from services.trainer.types import SequenceBatch

    init_distributed()
    rows = 16 * mini_batches
    # _actor_tree's first five arguments are the same in older checkouts.
    tree = _actor_tree(model_dir, device, rows, tokens, tokens, compile_layers=True)
    tree["actor_rollout_ref"]["actor"].update(
        ppo_mini_batch_size=16, ppo_micro_batch_size_per_gpu=16
    )
    tree["actor_rollout_ref"]["rollout"]["log_prob_micro_batch_size_per_gpu"] = 16
    actor = ActorRole.build(build_config(tree, []), World.current(device))
    vocab = actor.model.config.vocab_size
    g = torch.Generator().manual_seed(3)

    def ids() -> Ragged:
        return Ragged.from_tensors(
            [torch.randint(10, vocab, (tokens,), generator=g) for _ in range(rows)]
        )

    batch = SequenceBatch(ids(), ids())
    advantages = torch.randn(rows * tokens, generator=g)

    def ppo_update(step: int) -> dict:
        old, _ = actor.compute_log_probs(batch)
        adv = old.with_values(advantages)
        return actor.update_policy(batch, old, adv, None, None, global_step=step)

    first = ppo_update(1)
    ppo_update(2)
    quiet_s = wait_for_quiet_children()
    runs = [ppo_update(step) for step in range(3, 3 + updates)]
    mfu = [r["perf/mfu/actor"] for r in runs]
    out = {
        "mfu": statistics.median(mfu),
        "mfu_each": mfu,
        "update_ms": statistics.median(
            rows * 2 * tokens / r["perf/throughput/actor"] * 1e3 for r in runs
        ),
        "first_pg_loss": first["actor/pg_loss"],
        "first_grad_norm": first["actor/grad_norm"],
        "waited_for_quiet_host_s": quiet_s,
    }
    if timeline:
        out["timeline"] = _update_timeline(actor, batch, advantages, 3 + updates)
    return out


def _update_timeline(actor, batch, advantages: torch.Tensor, step: int) -> list[dict]:
    """Where the host and the GPU are at each named range of one update (after its
    old-log-prob pass, which is not timed)."""
    from services.trainer import actor as actor_module
    from services.trainer import optim, update_loop

    old, _ = actor.compute_log_probs(batch)
    adv = old.with_values(advantages)
    model = actor.model
    points = Timeline()
    hooked = {"model": model, "layers": model.model, "head": model.lm_head}
    with timed_ranges(points, [actor_module, update_loop, optim], hooked):
        points.mark("start")
        actor.update_policy(batch, old, adv, None, None, global_step=step)
        points.mark("end")
    return points.report()


def gathered_ab(
    model_dir: str,
    updates: int = 6,
    mini_batches: tuple[int, ...] = (1, 4),
    tokens: int = 512,
    device: str = "cuda",
) -> dict:
    """One rank: weights kept gathered (``fsdp.KEEP_GATHERED_ON_ONE_RANK``, the default)
    vs gathered by FSDP2 at every forward, in one process, for updates of each count of
    mini-batches; each with its timeline. Kept, the old-log-prob pass's gathered weights
    serve the update's first mini-batch and a foreach copy from the stepped masters the
    later ones; else every forward gathers again. The first update's loss and gradient
    norm are compared (GPU atomics make them differ in the last digits)."""
    from services.trainer.fsdp import sharding as fsdp

    out: dict = {}
    for count in mini_batches:
        for keep in (True, False):
            tag = f"{count}_mini_batches_{'kept' if keep else 'gathered_again'}"
            fsdp.KEEP_GATHERED_ON_ONE_RANK = keep
            try:
                out[tag] = ppo_order_updates(
                    model_dir, count, updates, tokens, device, timeline=True
                )
            finally:
                fsdp.KEEP_GATHERED_ON_ONE_RANK = True
            print(f"[gathered_ab/{tag}] { {k: v for k, v in out[tag].items() if k != 'timeline'} }")
            torch.cuda.empty_cache()
        kept = out[f"{count}_mini_batches_kept"]
        again = out[f"{count}_mini_batches_gathered_again"]
        out[f"{count}_mini_batches_first_update_rel_diff"] = {
            k: abs(kept[k] - again[k]) / max(abs(again[k]), 1e-12)
            for k in ("first_pg_loss", "first_grad_norm")
        }
        out[f"{count}_mini_batches_speedup"] = again["update_ms"] / kept["update_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="names the output file")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--workdir", default="/tmp/meshrl_gpu")
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--mini-batches", default="1,4", help="comma-separated counts")
    parser.add_argument(
        "--gathered-ab",
        action="store_true",
        help="instead: weights kept gathered vs gathered again, in one process (gathered_ab)",
    )
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="then once more with gc.freeze() (the collector skips the objects made so far)",
    )
    args = parser.parse_args()
    os.environ.setdefault("MESHRL_FSDP_UNITS", "model")
    path = make_model_dir(f"{args.workdir}/qwen05_fp32", dtype=torch.float32)
    os.makedirs(args.out, exist_ok=True)
    counts = [int(c) for c in args.mini_batches.split(",")]
    if args.gathered_ab:
        with open(f"{args.out}/trainer_gathered_ab_{args.label}.json", "w") as f:
            json.dump(gathered_ab(path, args.updates, tuple(counts)), f, indent=1)
        return
    out = {}
    for count in counts:
        out[f"{count}_mini_batches"] = ppo_order_updates(path, count, args.updates)
        print(f"[{args.label}] {count} mini-batches: {out[f'{count}_mini_batches']}", flush=True)
        torch.cuda.empty_cache()
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
        out[f"{counts[0]}_mini_batches_gc_frozen"] = ppo_order_updates(
            path, counts[0], args.updates
        )
        print(f"[{args.label}] gc frozen: {out[f'{counts[0]}_mini_batches_gc_frozen']}")
    with open(f"{args.out}/trainer_actor_update_{args.label}.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
