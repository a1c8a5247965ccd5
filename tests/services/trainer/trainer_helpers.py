"""Shared by the trainer tests: configs, hand-made batches, and trainer server processes."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from meshrl.api.v1 import common_pb2, trainer_pb2_grpc
from meshrl.config import RunConfig, build_config, config_to_yaml
from meshrl.launcher.ports import free_port
from meshrl.ragged import Ragged
from meshrl.rpc.client import open_channel, wait_for_health
from meshrl.weight_sync import GroupSpec, WeightGroup
from meshrl.wire import ragged_to_proto
from services.trainer.types import SequenceBatch

REPO = Path(__file__).resolve().parents[3]


def trainer_config(model_dir: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """A tiny run: 2 responses per prompt, mini-batches of 2 prompts (4 rows)."""
    tree = {
        "data": {"train_batch_size": 4, "max_response_length": 8},
        "actor_rollout_ref": {
            "model": {"path": str(model_dir)},
            "actor": {
                "ppo_mini_batch_size": 2,
                "ppo_micro_batch_size_per_gpu": 1,
                "optim": {"lr": 1e-3, "weight_decay": 0.0},
            },
            "rollout": {"n": 2, "temperature": 0.8, "log_prob_micro_batch_size_per_gpu": 3},
            "ref": {"log_prob_micro_batch_size_per_gpu": 2},
        },
        "critic": {
            "ppo_mini_batch_size": 2,
            "ppo_micro_batch_size_per_gpu": 2,
            "optim": {"lr": 1e-2, "weight_decay": 0.0},
        },
    }
    return build_config(tree, overrides or [])


def make_batch(rows: int, seed: int = 0, vocab: int = 22) -> SequenceBatch:
    """Random prompts (1-5 tokens) and responses (1-7 tokens) of ids in [4, vocab)."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(rows):
        p = int(torch.randint(1, 6, (1,), generator=g))
        r = int(torch.randint(1, 8, (1,), generator=g))
        prompts.append(torch.randint(4, vocab, (p,), generator=g))
        responses.append(torch.randint(4, vocab, (r,), generator=g))
    return SequenceBatch(Ragged.from_tensors(prompts), Ragged.from_tensors(responses))


def batch_to_proto(batch: SequenceBatch) -> common_pb2.SequenceBatch:
    return common_pb2.SequenceBatch(
        prompts=ragged_to_proto(batch.prompts), responses=ragged_to_proto(batch.responses)
    )


class TrainerProcess:
    """A trainer server started as a real process group (plain, or torchrun with N ranks)."""

    def __init__(self, role: str, nproc: int, log_path: Path):
        self.role = role
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        server = ["-m", "services.trainer.server", "--role", role, "--port", str(self.port)]
        if nproc > 1:
            launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
            cmd = [sys.executable, *launcher, *server]
        else:
            cmd = [sys.executable, *server, "--host", "127.0.0.1"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        # A session of its own: teardown kills torchrun *and* every rank it started.
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.channel = None
        self.stub = None

    def wait_ready(self, timeout_s: float = 120.0) -> TrainerProcess:
        try:
            wait_for_health(self.address, "", timeout_s, alive=lambda: self.proc.poll() is None)
        except Exception as e:
            raise RuntimeError(f"{e}\n--- server log ---\n{self.log()}") from None
        self.channel = open_channel(self.address)
        self.stub = trainer_pb2_grpc.TrainerServiceStub(self.channel)
        return self

    def initialize(self, cfg: RunConfig, timeout_s: float = 120.0):
        request = common_pb2.InitializeRequest(config_yaml=config_to_yaml(cfg))
        return self.stub.Initialize(request, timeout=timeout_s)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        # Ranks that outlived their launcher would still be in the session: make sure.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()


@contextmanager
def initialized_actors(
    logs: Path, servers: list[tuple[str, int, RunConfig]]
) -> Iterator[list[TrainerProcess]]:
    """Actor servers, one per ``(log name, ranks, config)``, started and initialized
    concurrently; stopped (last first) on exit."""
    procs: list[TrainerProcess] = []
    try:
        for name, ranks, _ in servers:
            procs.append(TrainerProcess("actor", ranks, logs / f"{name}.log"))
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda pc: pc[0].wait_ready().initialize(pc[1]),
                          zip(procs, [cfg for _, _, cfg in servers], strict=True)))  # fmt: skip
        yield procs
    finally:
        for proc in reversed(procs):
            proc.stop()


def plain_log_probs(model, batch: SequenceBatch, temperature: float):
    """(log-probs, entropies) of every response token, row by row with no padding, from a
    Hugging Face model or its folder: what the trainer's batched paths must equal."""
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(model)
    model.eval()
    logprobs, entropies = [], []
    with torch.no_grad():
        for i in range(len(batch)):
            prompt, response = batch.prompts.row(i), batch.responses.row(i)
            ids = torch.cat([prompt, response]).long().unsqueeze(0)
            logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature  # (r, V)
            logp = torch.log_softmax(logits, dim=-1)
            logprobs.append(logp.gather(-1, response.long().unsqueeze(-1)).squeeze(-1))
            entropies.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(logprobs), torch.cat(entropies)


def join_in_background(spec: GroupSpec, rank: int):
    """Joins a weight group as ``rank`` in a thread (the test process playing rollout):
    (thread, box), where box gets "group" or "error"."""
    box = {}

    def join():
        try:
            box["group"] = WeightGroup.join(dataclasses.replace(spec, rank=rank))
        except Exception as e:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = e

    thread = threading.Thread(target=join)
    thread.start()
    return thread, box
