"""Reward service under load: many concurrent clients on loopback against a real server.

    python -m benchmarks.reward.load [--clients 64] [--seconds 60] [--items 8] [--workers 2]
        [--max-calls 8]

Starts `python -m services.reward.server` as a subprocess, then `--clients` clients (each its
own gRPC channel, spread over `--procs` client processes) score batches of `--items` GSM8k
responses back to back for `--seconds`. Every answer is checked against the expected score;
an RPC error or a wrong score counts as an error. Prints one JSON line and writes
benchmarks/results/reward_load_cpu.json. Exits 1 if there was any error.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: `benchmarks.` and `services.` import from here
    sys.path.insert(0, str(REPO))
RESULTS = Path(__file__).parents[1] / "results" / "reward_load_cpu.json"
CALL_TIMEOUT_S = 60.0


# --- the server ------------------------------------------------------------------------
class RewardServerProcess:
    """`python -m services.reward.server` on a free loopback port, in its own process group
    (its scorer workers are stopped with it)."""

    def __init__(
        self,
        num_workers: int = 2,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 10.0,
        max_calls: int = 8,
    ):
        from meshrl.launcher.ports import free_port
        from meshrl.rpc.client import wait_for_health
        from services.reward.server import SERVICE_NAME

        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.reward.server",
                "--port",
                str(self.port),
                "--num-workers",
                str(num_workers),
                "--timeout-s",
                str(timeout_s),
                "--max-calls",
                str(max_calls),
                "--log-level",
                "WARNING",
            ],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for_health(self.address, SERVICE_NAME, 120, alive=lambda: self.proc.poll() is None)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
            try:
                os.killpg(self.proc.pid, sig)  # our own group only, by its id
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
                if sig == signal.SIGTERM:
                    os.killpg(self.proc.pid, signal.SIGKILL)  # any worker left behind
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        self.proc.wait()
        if hasattr(self._log, "close"):
            self._log.close()

    def __enter__(self) -> RewardServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# --- the clients ---------------------------------------------------------------------------
def gsm8k_batch(rng: random.Random, n: int) -> tuple[list, list[float]]:
    """n GSM8k responses (reasoning, then `#### answer`, about half right) and their scores."""
    from benchmarks.reward.throughput import gsm8k_items

    items = gsm8k_items(n, rng)
    expected = [
        1.0 if it.response.endswith(f"#### {int(it.ground_truth):,}") else 0.0 for it in items
    ]
    return items, expected


@dataclass
class ClientStats:
    latencies_s: list[float] = field(default_factory=list)
    items: int = 0
    errors: list[str] = field(default_factory=list)
    last_end: float = 0.0  # wall-clock time the last answer came back


def _client(
    address: str, seed: int, items_per_call: int, start_at: float, stop_at: float, out: ClientStats
) -> None:
    from services.reward.client import RewardClient

    rng = random.Random(seed)
    batches = [gsm8k_batch(rng, items_per_call) for _ in range(16)]
    with RewardClient(address, timeout_s=CALL_TIMEOUT_S) as client:
        time.sleep(max(0.0, start_at - time.time()))
        i = 0
        while time.time() < stop_at:
            items, expected = batches[i % len(batches)]
            i += 1
            t0 = time.perf_counter()
            try:
                got = client.score(items)
            except Exception as e:  # noqa: BLE001 - every failure is counted, none stops the run
                details = e.details() if hasattr(e, "details") else str(e)
                out.errors.append(f"{type(e).__name__}: {details}")
                continue
            out.latencies_s.append(time.perf_counter() - t0)
            out.last_end = time.time()
            out.items += len(items)
            scores = [o.score for o in got]
            if scores != expected or not all(o.ok for o in got):
                out.errors.append(f"wrong scores {scores} != {expected}")


def run_clients(
    address: str,
    clients: int,
    first_seed: int,
    items_per_call: int,
    start_at: float,
    stop_at: float,
) -> dict:
    """`clients` client threads in this process; their stats merged."""
    stats = [ClientStats() for _ in range(clients)]
    threads = [
        threading.Thread(
            target=_client,
            args=(address, first_seed + i, items_per_call, start_at, stop_at, stats[i]),
            daemon=True,
        )
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(stop_at - time.time() + CALL_TIMEOUT_S + 30)
    hung = sum(t.is_alive() for t in threads)
    merged = ClientStats(errors=[f"{hung} client(s) never returned"] if hung else [])
    for s in stats:
        merged.latencies_s += s.latencies_s
        merged.items += s.items
        merged.errors += s.errors
        merged.last_end = max(merged.last_end, s.last_end)
    return asdict(merged)


def run_load(
    address: str,
    clients: int = 64,
    seconds: float = 60.0,
    items_per_call: int = 8,
    procs: int = 2,
    warmup_s: float = 5.0,
) -> dict:
    """Runs the load and returns the summary (latencies in ms, throughput per second)."""
    procs = max(1, min(procs, clients))
    start_at = time.time() + warmup_s  # every client connected and its items made by then
    stop_at = start_at + seconds
    shares = [clients // procs + (i < clients % procs) for i in range(procs)]
    seeds = [sum(shares[:i]) for i in range(procs)]
    if procs == 1:
        parts = [run_clients(address, clients, 0, items_per_call, start_at, stop_at)]
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(procs, mp_context=ctx) as pool:
            futures = [
                pool.submit(run_clients, address, n, seed, items_per_call, start_at, stop_at)
                for n, seed in zip(shares, seeds, strict=True)
            ]
            parts = [f.result() for f in futures]
    # up to the last answer: calls started before stop_at count, and so does their time
    elapsed = max([stop_at] + [p["last_end"] for p in parts]) - start_at
    latencies = sorted(x for p in parts for x in p["latencies_s"])
    errors = [e for p in parts for e in p["errors"]]
    return summarize(
        latencies,
        sum(p["items"] for p in parts),
        errors,
        elapsed,
        clients=clients,
        seconds=seconds,
        items_per_call=items_per_call,
        procs=procs,
    )


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


def summarize(
    latencies: list[float], items: int, errors: list[str], elapsed_s: float, **setup
) -> dict:
    ms = [1000 * x for x in latencies]
    return {
        **setup,
        "requests": len(latencies),
        "items_scored": items,
        "errors": len(errors),
        "first_errors": errors[:5],
        "elapsed_s": round(elapsed_s, 2),
        "requests_per_s": round(len(latencies) / elapsed_s, 1),
        "items_per_s": round(items / elapsed_s, 1),
        "latency_ms": {
            "p50": round(_pct(ms, 0.50), 2),
            "p90": round(_pct(ms, 0.90), 2),
            "p99": round(_pct(ms, 0.99), 2),
            "max": round(max(ms), 2) if ms else None,
            "mean": round(statistics.fmean(ms), 2) if ms else None,
        },
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--items", type=int, default=8, help="GSM8k responses per Score call")
    p.add_argument("--workers", type=int, default=2, help="the server's scorer workers")
    p.add_argument("--procs", type=int, default=2, help="client processes the clients share")
    p.add_argument("--max-calls", type=int, default=8, help="the server's concurrent Score calls")
    p.add_argument("--no-save", action="store_true", help="do not write the results file")
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    with RewardServerProcess(args.workers, max_calls=args.max_calls) as server:
        startup = time.perf_counter() - t0
        summary = run_load(server.address, args.clients, args.seconds, args.items, args.procs)
    result = {
        "benchmark": "reward_load",
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "server_workers": args.workers,
        "server_max_calls": args.max_calls,
        "server_startup_s": round(startup, 2),
        "cpu_cores": os.cpu_count(),
        # other jobs on the machine, then with this benchmark's own processes running
        "load_avg_1m_before": round(load_before, 2),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        **summary,
    }
    print(json.dumps(result))
    if not args.no_save:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
