"""Multi-GPU checks for nvidia-h200-x2 (issue 9), in one call:

1. NCCL weight sync, actor on GPU 0 -> rollout on GPU 1, Qwen2.5-0.5B shape in bf16, through
   meshrl's bucketed sender/receiver, against a plain NCCL broadcast of the same bytes
   (one flat tensor) measured in the same processes.
2. The actor's PPO loss on one fixed batch with FSDP2 over 2 GPUs against 1 GPU.

    python -m benchmarks.weight_sync.nccl_x2 --out results.json      # on the 2-GPU machine
    python -m benchmarks.weight_sync.nccl_x2 --device cpu --small     # the same code on CPU (gloo)
    python -m benchmarks.weight_sync.nccl_x2 --sync-only --in-place --bucket-mb 4   # one setting
    python -m benchmarks.weight_sync.nccl_x2 --sync-only --in-place --profile-dir $OUT  # + trace

Each part runs in freshly spawned processes (torch.multiprocessing, spawn).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

QWEN05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=1e6,
)
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def build_model(small: bool, dtype: torch.dtype, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**(SMALL if small else QWEN05B))).to(
        dtype=dtype, device=device
    )


def _device(kind: str, rank: int) -> str:
    if kind == "cuda":
        torch.cuda.set_device(rank)
        return f"cuda:{rank}"
    return "cpu"


# ---------------------------------------------------------------------------------- part 1
def sync_worker(rank: int, args, port: int, queue) -> None:
    from meshrl.weight_sync.buckets import plan_buckets
    from meshrl.weight_sync.group import WeightGroup
    from meshrl.weight_sync.receiver import receive_weights, sync_header
    from meshrl.weight_sync.sender import send_weights
    from meshrl.weight_sync.types import GroupSpec, WeightManifest

    if args.waits != "meshrl":
        _use_waits(args.waits)
    device = _device(args.device, rank)
    transport = "nccl" if args.device == "cuda" else "gloo"
    model = build_model(args.small, torch.bfloat16, device)
    # Each sync sends new weights: the sender's are the built ones times 2**k at its k-th
    # sync (exact in bf16), and the receiver checks after every sync that it holds them:
    # a bucket copied out before it arrived would leave the previous sync's values.
    ref = build_model(args.small, torch.bfloat16, device) if rank == 1 else None
    syncs_done = 0
    mismatches = 0
    named = list(model.named_parameters())
    by_name = dict(named)
    bucket_bytes = args.bucket_mb * 1024 * 1024
    manifest = WeightManifest(
        1,
        plan_buckets([(n, tuple(p.shape)) for n, p in named], torch.bfloat16, bucket_bytes),
        group_id="x2",
    )
    spec = GroupSpec(transport, "127.0.0.1", port, 2, rank, 120.0, "x2")
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False)
    group = WeightGroup.join(spec, store)
    if args.depth:
        group.pipeline_depth = args.depth
    total = sum(p.numel() for _, p in named)
    flat = torch.empty(total, dtype=torch.bfloat16, device=device)

    def sync_once() -> float:
        start = time.perf_counter()
        if rank == 0:
            send_weights(group, ((n, p.detach()) for n, p in named), manifest)
        else:
            targets = {n: p.data for n, p in named} if args.in_place else None
            for name, tensor in receive_weights(group, manifest, device=device, targets=targets):
                by_name[name].data.copy_(tensor)  # nothing to copy where it landed in place
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def raw_once() -> float:
        start = time.perf_counter()
        group.broadcast(flat, src=0)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    # Where a sync's time goes beyond the raw broadcast: the same bytes in the manifest's
    # buckets (all in flight at once, no packing), and the header's round trip alone.
    bucket_flats = [torch.empty(b.numel, dtype=b.dtype, device=device) for b in manifest.buckets]

    def raw_buckets_once() -> float:
        start = time.perf_counter()
        for pending in [group.broadcast_async(t, src=0) for t in bucket_flats]:
            pending.wait()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def header_once() -> float:
        start = time.perf_counter()
        header = sync_header(manifest.version if rank == 0 else -1, group.device)
        group.broadcast(header, src=0)
        int(header[0])  # the receiver reads it on the host before it touches its model
        return time.perf_counter() - start

    tick = torch.zeros(1, device=device)

    def checked_sync() -> float:
        nonlocal syncs_done, mismatches
        syncs_done += 1
        if rank == 0:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(2)
        if args.device == "cuda":
            torch.cuda.synchronize()
        group.broadcast(tick, src=0)  # both ranks start the timed sync together
        seconds = sync_once()
        if rank == 1:
            scale = 2.0**syncs_done
            pairs = zip(model.parameters(), ref.parameters(), strict=True)
            mismatches += not all(torch.equal(p, q * scale) for p, q in pairs)
        return seconds

    calls = {"sync": checked_sync, "raw": raw_once, "raw_buckets": raw_buckets_once,
             "header": header_once}  # fmt: skip
    for _ in range(2):  # warm-up: NCCL communicators, allocator
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.reps):  # interleaved, so drift hits all alike
        for name, call in calls.items():
            times[name].append(call())
    syncs, raws = times["sync"], times["raw"]
    if args.profile_dir:  # one more sync under the profiler, each rank its own trace
        raw_once()  # both ranks leave this together: the traces start aligned
        _profiled(checked_sync, args.device, Path(args.profile_dir) / f"sync_rank{rank}.json")
    if rank == 1:
        queue.put(
            {
                "bytes": total * 2,
                "sync_s": statistics.median(syncs),
                "raw_broadcast_s": statistics.median(raws),
                "raw_bucketed_broadcasts_s": statistics.median(times["raw_buckets"]),
                "header_s": statistics.median(times["header"]),
                "weights_equal": mismatches == 0,
                "syncs_checked": syncs_done,
                "params": total,
                "buckets": len(manifest.buckets),
                "bucket_mb": args.bucket_mb,
                "in_place": args.in_place,
                "pipeline_depth": group.pipeline_depth,
                "waits": args.waits,
            }
        )
    group.close()


def _use_waits(kind: str) -> None:
    """Swaps meshrl's bucket waits (ProcessGroupNCCL's blocking wait with a timeout, which
    polls completion in 1 ms sleeps) for an A/B of two alternatives that were measured and
    not adopted (docs/benchmarks.md, "Tried and dropped"):

    - "polled": still blocking, but polling completion from 20 us up;
    - "stream": never blocking the host, only ordering the current stream after the
      broadcast (the benchmark's final synchronize waits for it all). meshrl does not do
      this: every bucket would then be posted at once, so the NCCL timeout would bound the
      whole sync, and a failed bucket would be copied into the model as garbage.
    """
    from datetime import timedelta

    from meshrl.weight_sync import group as group_module

    def polled(self):
        deadline = time.monotonic() + self._group.spec.timeout_s
        delay = 2e-5
        while not self._work.is_completed() and time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        self._work.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        return self.tensor

    def stream(self):
        self._work.wait()  # no timeout: the current stream waits, the host goes on
        return self.tensor

    group_module.PendingBroadcast.wait = polled if kind == "polled" else stream


def _profiled(call, device: str, path: Path) -> None:
    """Runs ``call`` once under torch.profiler; writes its Chrome trace, gzipped, to
    ``path``.gz (host ops and, on CUDA, kernels and copies with their streams)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        call()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    with open(path, "rb") as raw, gzip.open(f"{path}.gz", "wb") as packed:
        packed.write(raw.read())
    path.unlink()


# ---------------------------------------------------------------------------------- part 2
def loss_worker(rank: int, world: int, args, port: int, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from meshrl.algorithms.policy_loss import ppo_policy_loss
    from services.trainer.fsdp.sharding import shard_model

    device = _device(args.device, rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world
    )
    model = build_model(args.small, torch.float32, device)
    mesh = init_device_mesh(args.device, (world,))
    if args.device == "cuda":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        shard_model(
            model,
            mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
    else:
        shard_model(model, mesh)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    b, t = (16, 1024) if not args.small else (8, 32)
    ids = torch.randint(0, vocab, (b, t), generator=g).to(device)
    adv = torch.randn(b, t - 1, generator=g).to(device)
    share = b // world  # data parallel: each rank its slice; global counts over the batch
    rows = slice(rank * share, (rank + 1) * share)
    logits = model(input_ids=ids[rows]).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[rows, 1:, None])[..., 0]
    mask = torch.ones_like(logp)
    out = ppo_policy_loss(
        logp, logp.detach() - 0.01, adv[rows], mask, global_token_count=b * (t - 1)
    )
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)  # sum of the ranks' shares = the whole batch's token-mean loss
    out.loss.backward()
    if rank == 0:
        queue.put({"world": world, "loss": float(loss)})
    dist.destroy_process_group()


def _spawn(fn, nprocs: int, *args) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    from meshrl.launcher.ports import free_port

    port = free_port()
    procs = [ctx.Process(target=fn, args=(r, *args, port, queue)) for r in range(nprocs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"{fn.__name__} rank failed with exit code {p.exitcode}")
    out = []
    while not queue.empty():
        out.append(queue.get())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="a tiny model (CPU check)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="receive single-parameter buckets into the model's tensors, as the rollout "
        "server does (WeightReceiver targets)",
    )
    parser.add_argument(
        "--depth", type=int, default=0, help="staging buffers in flight (0: the group's own)"
    )
    parser.add_argument(
        "--waits",
        default="meshrl",
        choices=["meshrl", "polled", "stream"],
        help="bucket waits: meshrl's, or one of two alternatives for an A/B (see _use_waits)",
    )
    parser.add_argument("--sync-only", action="store_true", help="skip the FSDP2 loss check")
    parser.add_argument(
        "--profile-dir",
        default=None,
        help="after the timed syncs, profile one more on each rank: sync_rank<r>.json.gz",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result: dict = {"device": args.device, "small": args.small}
    if args.device == "cuda":
        result["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    sync = _spawn(sync_worker, 2, args)[0]
    sync["gbps"] = sync["bytes"] / sync["sync_s"] / 1e9
    sync["raw_gbps"] = sync["bytes"] / sync["raw_broadcast_s"] / 1e9
    sync["ratio_to_raw"] = sync["sync_s"] / sync["raw_broadcast_s"]
    result["weight_sync"] = sync
    if not args.sync_only:
        one = _spawn(loss_worker, 1, 1, args)[0]
        two = _spawn(loss_worker, 2, 2, args)[0]
        result["fsdp_loss"] = {
            "one_gpu": one["loss"],
            "two_gpus": two["loss"],
            "abs_diff": abs(one["loss"] - two["loss"]),
        }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
