"""Weight sync over gloo between two processes, against a raw broadcast of the same bytes.

    python -m benchmarks.weight_sync.gloo [--dtype float32] [--bucket-mb 1,4,32,256] [--reps 9]

The sender is an actor in miniature: a Llama of about 110M parameters (hidden 768, 12
layers, intermediate 2048, vocabulary 32000, tied embeddings; random init from a config,
fp32 master weights) sharded with FSDP2 on a world of one, its full parameters gathered one
at a time (``full_tensor()``) and streamed through ``send_weights`` in flat buckets of the
wire dtype. The receiver is a rollout in miniature: ``receive_weights`` into the same
architecture in the wire dtype, as the rollout worker drives the native engine: a bucket
holding one parameter lands straight in that parameter (``weight_targets``), the tensors
of packed buckets are copied in (``load_weights``).

Ceilings, measured in the same run and the same group: ``raw`` is one ``broadcast`` of a
flat uint8 tensor holding the same number of bytes (buffers allocated once); ``raw_bucketed``
moves the same bytes as raw slices in the sync's bucket sizes (what bucketing costs alone,
with no gathering, packing or loading).

For each bucket size, each rep times the three back to back (rotating which goes first); a
measurement starts with a one-element broadcast so both sides start together, and its time
is the slower side's. Figures are medians over reps; ``median_paired_ratio`` (the median of
each rep's sync/raw) is steadier on a shared, loaded machine. The first bucket size given
is the headline. Prints JSON and writes ``benchmarks/results/weight_sync_gloo_cpu.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parents[1] / "results" / "weight_sync_gloo_cpu.json"
MODEL = dict(vocab=32000, hidden=768, layers=12, heads=12, intermediate=2048)


def _model(seed: int, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=MODEL["vocab"],
        hidden_size=MODEL["hidden"],
        intermediate_size=MODEL["intermediate"],
        num_hidden_layers=MODEL["layers"],
        num_attention_heads=MODEL["heads"],
        num_key_value_heads=MODEL["heads"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype)


def _full_params(model):
    """The actor's stream: one gathered parameter at a time (as ActorRole.iter_full_params)."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        with torch.no_grad():
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        yield name, full


KINDS = ("raw", "raw_bucketed", "sync")


def _order(rep: int) -> tuple[str, ...]:
    """The three measurements of a rep, rotated so that none always comes first."""
    k = rep % len(KINDS)
    return KINDS[k:] + KINDS[:k]


def _raw_bucketed(group, flat: torch.Tensor, manifest) -> None:
    """The same bytes in the same bucket sizes, as raw slices of one buffer, as many in
    flight as the sync keeps: what bucketing costs alone, with no gathering, packing or
    loading."""
    start, in_flight = 0, []
    for bucket in manifest.buckets:
        in_flight.append(group.broadcast_async(flat[start : start + bucket.nbytes], src=0))
        start += bucket.nbytes
        if len(in_flight) >= group.pipeline_depth:
            in_flight.pop(0).wait()
    for pending in in_flight:
        pending.wait()


def _start(group) -> tuple[float, float]:
    group.broadcast(torch.zeros(1), src=0)  # both sides leave this together (within a hop)
    return time.perf_counter(), time.process_time()


def _elapsed(start: tuple[float, float]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all its threads: gloo's included)."""
    return time.perf_counter() - start[0], time.process_time() - start[1]


def _time_reps(group, raw: torch.Tensor, manifest, reps: int, sync) -> list[float]:
    """This side's part of ``reps`` rounds of the three measurements of one bucket size, in
    ``_order``; ``sync(manifest)`` is this side's part of a weight sync (send or receive).

    Returns (wall, CPU) seconds of every measurement, flattened in the order they ran: both
    sides run the same schedule, so the sender pairs its list with the receiver's.
    """
    times = []
    for rep in range(reps):
        for kind in _order(rep):
            start = _start(group)
            if kind == "raw":
                group.broadcast(raw, src=0)
            elif kind == "raw_bucketed":
                _raw_bucketed(group, raw, manifest)
            else:
                sync(manifest)
            times.extend(_elapsed(start))
    return times


def _checksum(model) -> float:
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


def receiver(conn, threads: int) -> None:
    """Rank 1: joins the group, then follows the sender's schedule of raw and sync reps."""
    from meshrl.api.v1 import common_pb2
    from meshrl.weight_sync import GroupSpec, WeightGroup, WeightManifest, receive_weights

    torch.set_num_threads(threads)
    spec_bytes, manifests_bytes, reps, dtype_name, cpu = conn.recv()
    _pin(cpu)
    spec = GroupSpec.from_proto(common_pb2.WeightGroupSpec.FromString(spec_bytes))
    manifests = [
        WeightManifest.from_proto(common_pb2.WeightManifest.FromString(b)) for b in manifests_bytes
    ]
    model = _model(seed=1, dtype=getattr(torch, dtype_name))
    targets = dict(model.named_parameters())
    inplace = {name: p.detach() for name, p in targets.items()}  # NativeEngine.weight_targets
    group = WeightGroup.join(spec)
    raw = torch.zeros(manifests[0].nbytes, dtype=torch.uint8)

    def sync(manifest) -> None:
        with torch.no_grad():  # as the rollout worker + native engine do
            for name, tensor in receive_weights(group, manifest, targets=inplace):
                targets[name].copy_(tensor)  # nothing to copy if received in place

    times, checksums = [], []
    for manifest in manifests:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # each configuration must bring every weight itself
        times.extend(_time_reps(group, raw, manifest, reps, sync))
        checksums.append(_checksum(model))
    group.broadcast(torch.tensor(times, dtype=torch.float64), src=1)
    group.broadcast(torch.tensor(checksums, dtype=torch.float64), src=1)
    group.close()


def _pin(cpu: int | None) -> None:
    """Sender and receiver on a core each (``--pin``), as on separate machines."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def run(dtype_name: str, bucket_mbs: list[float], reps: int, threads: int, pin: bool) -> dict:
    from meshrl.weight_sync import WeightGroup, WeightManifest, plan_buckets, send_weights
    from services.trainer.distributed import World, init_distributed
    from services.trainer.fsdp.sharding import shard_model

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    load_before = os.getloadavg()[0]
    init_distributed()  # a world of one, as a plainly started trainer forms it
    model = shard_model(_model(seed=0, dtype=torch.float32), World.current("cpu").mesh)
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    store, spec = WeightGroup.open("127.0.0.1", timeout_s=120, world_size=2)
    manifests = [
        WeightManifest(1, plan_buckets(named, dtype, int(mb * 2**20)), spec.group_id)
        for mb in bucket_mbs
    ]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=receiver, args=(child, threads))
    peer.start()
    member = spec.to_proto()
    member.rank = 1
    payload = [m.to_proto().SerializeToString() for m in manifests]
    cpus = sorted(os.sched_getaffinity(0))
    parent.send((member.SerializeToString(), payload, reps, dtype_name, cpus[-1] if pin else None))
    _pin(cpus[0] if pin else None)
    try:
        group = WeightGroup.join(spec, store)
        raw = torch.ones(manifests[0].nbytes, dtype=torch.uint8)

        def send(manifest) -> None:
            send_weights(group, _full_params(model), manifest)

        mine = []
        for manifest in manifests:
            mine.extend(_time_reps(group, raw, manifest, reps, send))
        theirs = torch.zeros(len(mine), dtype=torch.float64)
        group.broadcast(theirs, src=1)
        checksums = torch.zeros(len(manifests), dtype=torch.float64)
        group.broadcast(checksums, src=1)
        group.close()
        peer.join(60)
    finally:
        if peer.is_alive():
            peer.kill()
            peer.join()
    expected = float(sum(t.to(dtype).double().sum() for _, t in _full_params(model)))
    pairs = iter(zip(mine, theirs.tolist(), strict=True))  # (wall, cpu) per measurement
    sweep = []
    for manifest, mb, got in zip(manifests, bucket_mbs, checksums.tolist(), strict=True):
        times = {kind: [] for kind in KINDS}
        cpu = {kind: [] for kind in KINDS}
        for rep in range(reps):
            for kind in _order(rep):
                times[kind].append(max(next(pairs)))  # the slower side
                cpu[kind].append(sum(next(pairs)))  # both sides together
        match = abs(got - expected) <= 1e-6 * max(1.0, abs(expected))
        sweep.append(_config_result(manifest, mb, times, cpu, match))
    return _report(dtype_name, reps, threads, pin, load_before, model, manifests[0], sweep)


def _config_result(manifest, bucket_mb: float, times: dict, cpu: dict, weights_match: bool) -> dict:
    raw_s, sync_s = statistics.median(times["raw"]), statistics.median(times["sync"])
    bucketed_s = statistics.median(times["raw_bucketed"])
    gb = manifest.nbytes / 1e9
    ratios = [s / r for s, r in zip(times["sync"], times["raw"], strict=True)]
    return {
        "bucket_mb": bucket_mb,
        "buckets": len(manifest.buckets),
        "packed_buckets": sum(len(b.params) > 1 for b in manifest.buckets),
        "raw_broadcast_s": round(raw_s, 4),
        "sync_s": round(sync_s, 4),
        "raw_gbps": round(gb / raw_s, 3),
        "sync_gbps": round(gb / sync_s, 3),
        "sync_over_raw": round(sync_s / raw_s, 3),
        "median_paired_ratio": round(statistics.median(ratios), 3),
        # CPU seconds of both processes: the work each path costs, whatever else the
        # machine runs; on two cores the wall-clock ratio cannot beat this one for long.
        "raw_cpu_s": round(statistics.median(cpu["raw"]), 4),
        "sync_cpu_s": round(statistics.median(cpu["sync"]), 4),
        "cpu_ratio": round(statistics.median(cpu["sync"]) / statistics.median(cpu["raw"]), 3),
        "raw_bucketed_s": round(bucketed_s, 4),
        "sync_over_raw_bucketed": round(sync_s / bucketed_s, 3),
        "best_raw_s": round(min(times["raw"]), 4),
        "best_sync_s": round(min(times["sync"]), 4),
        "all_raw_s": [round(t, 4) for t in times["raw"]],
        "all_sync_s": [round(t, 4) for t in times["sync"]],
        "all_raw_bucketed_s": [round(t, 4) for t in times["raw_bucketed"]],
        "weights_match": weights_match,
    }


def _report(dtype_name, reps, threads, pin, load_before, model, manifest, sweep) -> dict:
    head = sweep[0]
    return {
        "benchmark": "weight_sync_gloo",
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core CPU ({platform.machine()}), no GPU",
        "load_avg_1m_before": round(load_before, 2),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "model": {
            **MODEL,
            "parameters": sum(p.numel() for p in model.parameters()),
            "tensors": len(manifest.param_names),
            "actor_dtype": "float32",
        },
        "wire_dtype": dtype_name,
        "bytes": manifest.nbytes,
        "reps": reps,
        "threads_per_process": threads,
        "pinned_cores": pin,
        "goal_sync_over_raw": 1.5,
        **{
            k: head[k]
            for k in (
                "bucket_mb",
                "raw_broadcast_s",
                "sync_s",
                "raw_gbps",
                "sync_gbps",
                "sync_over_raw",
                "median_paired_ratio",
                "raw_bucketed_s",
                "sync_over_raw_bucketed",
                "cpu_ratio",
            )
        },  # fmt: skip
        "sweep": sweep,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--bucket-mb", default="1,4,32,256", help="comma-separated; first = headline"
    )
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--pin", action="store_true", help="sender and receiver on a core each")
    parser.add_argument("--out", default=str(RESULTS), help="'' to skip writing")
    args = parser.parse_args()
    bucket_mbs = [float(x) for x in args.bucket_mb.split(",")]
    result = run(args.dtype, bucket_mbs, args.reps, args.threads, args.pin)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
