"""Generation throughput of the rollout pool on CPU, before and after a replica is added.

    .venv/bin/python -m benchmarks.rollout.pool_add_replica [--batch 64] [--rounds 5]

Starts two rollout servers (`python -m services.rollout.server`, one thread each) on a
random-init tiny Llama (hidden 128, 2 layers), initializes both, and drives them through a
:class:`~services.coordinator.generation.rollout_pool.RolloutPool` as a run does: ``--rounds``
generations of ``--batch`` prompts with only the first replica in the pool, then as many
after the second is added (``pool.add``, as a replica joins at a step boundary), the
requests ``--per-request`` prompts each, up to ``--max-tokens`` tokens a response. Each
request is seeded by its place in the batch, so every round, before and after, samples the
very same tokens: the same work. Prints tokens/s before and after and each replica's share,
and writes ``benchmarks/results/rollout_pool_add_replica_cpu.json``. Two replicas need two
free cores to double the rate: the figure says as much about the machine's load as about
the pool.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parents[1] / "results" / "rollout_pool_add_replica_cpu.json"


def start_server(port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "services.rollout.server", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip


def measure(pool, prompts, sampling, rounds: int) -> dict:
    """tokens/s of each round, and the pool's per-replica metrics over all of them."""
    pool.metrics()  # start afresh
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = pool.generate(prompts, sampling)
        rates.append(int(out.responses.lengths.sum()) / (time.perf_counter() - start))
    return {"tokens_per_s": statistics.median(rates), "rounds": rates, "pool": pool.metrics()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--per-request", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    from meshrl.config import build_config, config_to_yaml
    from meshrl.launcher.ports import free_port
    from meshrl.ragged import Ragged
    from meshrl.rpc.client import wait_for_health
    from meshrl.testing.tiny_model import make_tiny_model_dir
    from services.coordinator.generation.rollout_pool import RolloutPool
    from services.rollout.client import RolloutClient
    from services.rollout.types import SamplingParams

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_model_dir(root / "model", seed=0, hidden=128, intermediate=256)
        cfg = build_config({}, [f"actor_rollout_ref.model.path={model}"])
        ports = [free_port(), free_port()]
        procs = [start_server(port, root / f"rollout{i}.log") for i, port in enumerate(ports)]
        try:
            clients = []
            for port in ports:
                wait_for_health(f"127.0.0.1:{port}", timeout_s=120)
                client = RolloutClient(f"127.0.0.1:{port}", 300)
                client.initialize(config_to_yaml(cfg), str(root))
                clients.append(client)
            prompts = Ragged.from_lists([[3 + i % 15, 5, 7 + i % 11] for i in range(args.batch)])
            sampling = SamplingParams(max_tokens=args.max_tokens, seed=1)
            pool = RolloutPool({"rollout0": clients[0]}, 2, args.per_request)
            pool.generate(prompts, sampling)  # warm-up
            before = measure(pool, prompts, sampling, args.rounds)
            pool.add("rollout1", clients[1])
            clients[1].generate(prompts.select(range(1)), sampling)  # its warm-up
            after = measure(pool, prompts, sampling, args.rounds)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(30)
    result = {
        "command": "python -m benchmarks.rollout.pool_add_replica "
        f"--batch {args.batch} --per-request {args.per_request} "
        f"--max-tokens {args.max_tokens} --rounds {args.rounds}",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} ({os.cpu_count()} cores)",
        "load_average_before": load_before,
        "one_replica": before,
        "two_replicas": after,
        "speedup": after["tokens_per_s"] / before["tokens_per_s"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"one replica:  {before['tokens_per_s']:8.0f} tokens/s")
    share = {k: v for k, v in after["pool"].items() if k.endswith("/requests")}
    print(
        f"two replicas: {after['tokens_per_s']:8.0f} tokens/s ({result['speedup']:.2f}x); {share}"
    )
    return result


if __name__ == "__main__":
    main()
