"""cuda_ipc weight sync between two processes on one GPU, against a plain device copy.

The actor (this process) holds float32 master weights of the Qwen2.5-0.5B shape and
streams them, cast to bf16, through the cuda_ipc ring; the rollout (a subprocess,
``benchmarks.weight_sync.cuda_ipc_peer``) copies them into its own bf16 model. The manifest travels
as protobuf bytes through the group's store (in the mesh it travels over gRPC).
A sync is timed from the first bucket fill to the last acknowledgement.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch

from benchmarks.gpu_models import qwen05_config
from meshrl.weight_sync.buckets import plan_buckets
from meshrl.weight_sync.cuda_ipc import IpcGroup
from meshrl.weight_sync.types import WeightManifest


def ipc_bench(workdir: str, syncs: int = 6, bucket_mb: int = 256) -> dict:
    from transformers import Qwen2ForCausalLM

    with torch.device("cuda"):
        model = Qwen2ForCausalLM(qwen05_config())  # float32 masters, as the trainer holds
    params = [(n, p.detach()) for n, p in model.named_parameters()]
    store, spec = IpcGroup.open("127.0.0.1", timeout_s=120, world_size=2)
    peer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.weight_sync.cuda_ipc_peer",
            "--port",
            str(spec.master_port),
            "--group",
            spec.group_id,
            "--syncs",
            str(syncs),
        ],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        group = IpcGroup.join(spec, store)
        times, checks = [], []
        for version in range(1, syncs + 1):
            with torch.no_grad():  # new weights every sync, so a stale copy cannot pass
                for _, p in params:
                    p.add_(0.001 * version)
            buckets = plan_buckets(
                [(n, tuple(p.shape)) for n, p in params], torch.bfloat16, bucket_mb * 2**20
            )
            manifest = WeightManifest(version, buckets, spec.group_id)
            manifest.ipc_handles = group.export_ring(manifest)
            store.set(f"bench/manifest/{version}", manifest.to_proto().SerializeToString())
            torch.cuda.synchronize()
            start = time.perf_counter()
            sent, _ = group.send(iter(params), manifest)
            times.append(time.perf_counter() - start)
            store.wait([f"bench/sums/{version}"], timedelta(seconds=60))
            got = json.loads(store.get(f"bench/sums/{version}"))
            want = [p.to(torch.bfloat16).double().sum().item() for _, p in params]
            checks.append(got == want)
        peer.wait(timeout=60)
        total = sum(p.numel() for _, p in params) * 2
        ceiling_ms = copy_ms(total)
        median = statistics.median(times[1:])  # the first sync opens the handles
        return {
            "bytes": total,
            "buckets": len(buckets),
            "sync_ms": median * 1e3,
            "first_sync_ms": times[0] * 1e3,
            "all_sync_ms": [t * 1e3 for t in times],
            "gbs": total / median / 1e9,
            "copy_ms": ceiling_ms,
            "weights_equal_every_sync": all(checks),
            "peer_rc": peer.returncode,
        }
    finally:
        if peer.poll() is None:
            peer.kill()


def copy_ms(nbytes: int) -> float:
    """One device-to-device copy of the same bytes (the ceiling of any same-GPU sync)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    b.copy_(a)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 10
