"""The vLLM adapter without vLLM (it cannot run here): the clear error when it is missing,
the pure mappings to and from vLLM's types (fed with stand-ins shaped like vLLM's outputs),
the worker extension's receive path over a real gloo group with a stand-in model, and the
engine's intake driven through the rollout worker with a stand-in for ``vllm.LLM`` (sleep,
wake of the weights alone, the sync in the worker, failure)."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from meshrl.config import build_config
from meshrl.ragged import Ragged
from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl.weight_sync import GroupSpec, WeightGroup, WeightManifest, plan_buckets, send_weights
from services.rollout import registry
from services.rollout import worker as worker_module
from services.rollout.engine import MemoryReleasedError
from services.rollout.types import SamplingParams
from services.rollout.vllm import mapping
from services.rollout.vllm.engine import VllmEngine, VllmNotInstalledError
from services.rollout.vllm.extension import MeshrlWorkerExtension
from services.rollout.vllm.mapping import results_from_outputs, sampling_kwargs
from services.rollout.worker import RolloutWorker, WeightSyncError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def no_vllm(monkeypatch):
    """A machine without vllm, wherever the tests run (CI has its CPU build)."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    monkeypatch.setattr(registry, "vllm_installed", lambda: False)


def test_building_without_vllm_says_what_to_do(no_vllm):
    with pytest.raises(VllmNotInstalledError, match=r"rollout.name=vllm needs the vllm package"):
        VllmEngine("/nonexistent")


def test_rollout_name_vllm_reaches_the_adapter(tmp_path, no_vllm):
    model = make_tiny_model_dir(tmp_path / "m", hidden=32, intermediate=64)
    vllm = [f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=vllm"]
    cfg = build_config({}, [*vllm, "trainer.device=cuda"])
    with pytest.raises(VllmNotInstalledError, match="pip install"):
        worker_module.build_engine(cfg)
    # A CPU run (verl's command line pasted there) generates with the native engine instead.
    assert type(worker_module.build_engine(build_config({}, vllm))).__name__ == "NativeEngine"


def test_sampling_params_map_to_vllm_keywords():
    kwargs = sampling_kwargs(
        SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_tokens=5, n=3, seed=11,
                       stop_token_ids=(2, 7))
    )  # fmt: skip
    assert kwargs == {
        "n": 3, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 5,
        "logprobs": 0, "stop_token_ids": [2, 7], "detokenize": False, "seed": 11,
    }  # fmt: skip
    with_eos = sampling_kwargs(SamplingParams(stop_token_ids=(7, 2)), eos_ids=(2, 151645))
    assert with_eos["stop_token_ids"] == [2, 7, 151645]  # vLLM without a tokenizer knows no EOS
    greedy = sampling_kwargs(SamplingParams(temperature=0, top_k=20))
    assert greedy["temperature"] == 0 and greedy["top_k"] == 20 and "seed" not in greedy


def test_each_prompt_gets_a_seed_of_its_own():
    seeded = mapping.per_prompt_kwargs(SamplingParams(seed=11, n=2), 3)
    seeds = [k["seed"] for k in seeded]
    assert len(set(seeds)) == 3 and {k["n"] for k in seeded} == {2}
    assert all(0 <= s < 2**63 for s in seeds)  # vLLM takes an int64
    # the next step's seed (12) shares no stream with this step's prompts
    after = [k["seed"] for k in mapping.per_prompt_kwargs(SamplingParams(seed=12), 3)]
    assert not set(seeds) & set(after)
    unseeded = mapping.per_prompt_kwargs(SamplingParams(), 2)
    assert len(unseeded) == 2 and all("seed" not in k for k in unseeded)


def _completion(index, ids, lps, reason):
    logprobs = [{tok: SimpleNamespace(logprob=lp)} for tok, lp in zip(ids, lps, strict=True)]
    return SimpleNamespace(index=index, token_ids=ids, logprobs=logprobs, finish_reason=reason)


def test_outputs_become_rows_sample_j_of_prompt_i_at_i_times_n_plus_j():
    outputs = [
        SimpleNamespace(outputs=[_completion(1, [5, 2], [-0.5, -0.1], "stop"),
                                 _completion(0, [4], [-1.0], "length")]),
        SimpleNamespace(outputs=[_completion(0, [9, 9, 9], [-2.0, -2.5, -3.0], "length"),
                                 _completion(1, [2], [-0.01], "stop")]),
    ]  # fmt: skip
    tokens, logprobs, reasons = results_from_outputs(outputs, n=2)
    assert tokens == [[4], [5, 2], [9, 9, 9], [2]]
    assert logprobs == [[-1.0], [-0.5, -0.1], [-2.0, -2.5, -3.0], [-0.01]]
    assert reasons == ["length", "stop", "length", "stop"]
    aborted = [SimpleNamespace(outputs=[_completion(0, [4], [-1.0], "abort")])]
    with pytest.raises(RuntimeError, match="abort"):
        results_from_outputs(aborted, n=1)


def test_eos_ids_are_read_from_the_model_folders(tmp_path):
    from transformers import GenerationConfig

    from services.rollout.eos import folder_eos_token_ids

    model = make_tiny_model_dir(tmp_path / "m", hidden=32, intermediate=64)
    GenerationConfig(eos_token_id=[2, 9]).save_pretrained(model)
    assert set(folder_eos_token_ids(str(model), str(model))) >= {2, 9}


def test_prompt_logprobs_give_the_response_tokens():
    ids = [1, 4, 5, 6, 2]
    per_position = [None] + [{t: SimpleNamespace(logprob=-0.1 * t)} for t in ids[1:]]
    assert mapping.response_logprobs(per_position, ids, 2) == pytest.approx([-0.6, -0.2])


def test_spec_and_manifest_travel_as_json():
    spec = GroupSpec("nccl", "10.0.0.1", 4321, 3, 2, 30.0, "g")
    assert mapping.spec_from_json(mapping.spec_to_json(spec)) == spec
    manifest = WeightManifest(4, plan_buckets([("w", (2, 3)), ("b", (3,))], torch.bfloat16, 8), "g")
    back = mapping.manifest_from_json(mapping.manifest_to_json(manifest))
    assert back == manifest


class _StandInModel(torch.nn.Module):
    """What the extension needs of vLLM's model: parameters and ``load_weights(weights=...)``."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(6, 4))
        self.b = torch.nn.Parameter(torch.zeros(4))

    @torch.no_grad()
    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].copy_(tensor)


def _gloo_pair(worker):
    """A gloo group of two: the returned sender (rank 0) and ``worker`` joined as rank 1."""
    store, spec = WeightGroup.open("127.0.0.1", timeout_s=10, world_size=2)
    member = mapping.spec_to_json(GroupSpec(**{**spec.__dict__, "rank": 1}))
    with ThreadPoolExecutor(2) as pool:
        joined = pool.submit(worker.meshrl_join_weight_group, member)
        sender = WeightGroup.join(spec, store)
        assert joined.result() == spec.group_id
    return sender, spec


def _stand_in_worker():
    worker = MeshrlWorkerExtension()  # as vLLM mixes it into its worker: these attributes exist
    worker.model_runner = SimpleNamespace(model=_StandInModel())
    worker.device = torch.device("cpu")
    return worker


def test_worker_extension_joins_receives_and_loads_over_gloo():
    worker = _stand_in_worker()
    assert worker.meshrl_num_parameters() == 28
    sender, spec = _gloo_pair(worker)
    params = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    named = [(n, tuple(t.shape)) for n, t in params.items()]
    manifest = WeightManifest(3, plan_buckets(named, torch.float32, 32), spec.group_id)
    received = {}
    thread = threading.Thread(
        target=lambda: received.update(
            n=worker.meshrl_receive_weights(mapping.manifest_to_json(manifest))
        )
    )
    thread.start()
    send_weights(sender, iter(params.items()), manifest)
    thread.join(20)
    assert received["n"] == [2, 4 * 28]
    assert torch.equal(worker.model_runner.model.w, params["w"])
    assert torch.equal(worker.model_runner.model.b, params["b"])
    assert worker.meshrl_weight_checksum('["b"]') == [pytest.approx(float(params["b"].sum()))]
    worker.meshrl_close_weight_group()
    sender.close()


def test_the_reload_path_hands_vllms_reload_copies_of_the_staging_buffers():
    """vLLM >= 0.32: the tensors go through ``model_runner.reload_weights``, which keeps a
    layer's tensors until the layer is complete, so each is a copy, not a view of a staging
    buffer the next bucket overwrites."""
    worker = _stand_in_worker()
    reloaded: list[tuple[str, torch.Tensor]] = []

    def reload_weights(weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        reloaded.extend(weights_iterator)  # kept, as vLLM's layerwise reload keeps them

    worker.model_runner.reload_weights = reload_weights
    sender, spec = _gloo_pair(worker)
    params = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    named = [(n, tuple(t.shape)) for n, t in params.items()]
    manifest = WeightManifest(3, plan_buckets(named, torch.float32, 32), spec.group_id)
    received = {}
    thread = threading.Thread(
        target=lambda: received.update(
            n=worker.meshrl_receive_weights(mapping.manifest_to_json(manifest), "reload_weights")
        )
    )
    thread.start()
    send_weights(sender, iter(params.items()), manifest)
    thread.join(20)
    assert received["n"] == [2, 4 * 28]
    assert [n for n, _ in reloaded] == ["w", "b"]
    for name, tensor in reloaded:  # intact after every bucket landed
        assert torch.equal(tensor, params[name])
    assert not torch.equal(worker.model_runner.model.w, params["w"])  # not loaded directly
    worker.meshrl_close_weight_group()
    sender.close()


def test_the_vllm_versions_known_and_an_unknown_one_refused_in_one_line():
    assert mapping.vllm_support("0.24.0").weight_load == "load_weights"
    assert mapping.vllm_support("0.32.0").weight_load == "reload_weights"
    assert mapping.vllm_support("0.32.1+cpu").version == "0.32"
    with pytest.raises(mapping.UnsupportedVllmError) as refused:
        mapping.vllm_support("0.33.0")
    assert str(refused.value) == (
        "vLLM 0.33.0 is installed, but meshrl's vLLM engine knows only 0.24.x, 0.32.x "
        "(services/rollout/vllm/mapping.py, SUPPORTED_VLLM): install one of them"
    )


def test_cpu_settings_of_the_engine(tmp_path):
    from meshrl.testing.tiny_model import make_tiny_qwen2_dir

    small = make_tiny_qwen2_dir(tmp_path / "small")  # hidden 64 over 4 heads: head size 16
    with pytest.raises(ValueError, match="head size of at least 32, and .* has 16: use rollout"):
        mapping.check_cpu_head_size(str(small))
    model = make_tiny_qwen2_dir(tmp_path / "m", hidden=128, intermediate=256)
    mapping.check_cpu_head_size(str(model))
    # 2 layers x K and V x 2 KV heads x 32 x float32 = 1 KiB a token
    assert mapping.cpu_kv_cache_bytes(str(model), 64, 1024) == 64 << 20
    assert mapping.cpu_kv_cache_bytes(str(model), 1, 100) == 32 << 20  # at least
    assert mapping.cpu_kv_cache_bytes(str(model), 4096, 4096) == 256 << 20  # at most
    cpu = mapping.llm_device_kwargs("cpu", str(model), 64, 1024, enforce_eager=False)
    assert cpu == {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20}  # no sleep mode
    gpu = mapping.llm_device_kwargs("cuda", str(model), 64, 1024, enforce_eager=False)
    assert gpu == {"enforce_eager": False, "enable_sleep_mode": True}
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model)
    assert mapping.folder_num_parameters(str(model)) == hf.num_parameters()


def test_worker_extension_takes_delta_syncs_as_full_tensors():
    """Delta syncs into vLLM's worker: the receiver applies the changes to its own copy and
    hands full tensors to the model's load_weights; a refused delta closes the group."""
    worker = _stand_in_worker()
    sender, spec = _gloo_pair(worker)
    torch.manual_seed(0)
    params = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    named = [(n, tuple(t.shape)) for n, t in params.items()]

    def sync(version: int):
        manifest = WeightManifest(version, plan_buckets(named, torch.bfloat16, 32), spec.group_id)
        manifest.delta = True
        if sender.delta_state is not None:
            manifest.base_version = sender.delta_state.base_for(manifest)
        out: dict = {}

        def receive():
            try:
                out["n"] = worker.meshrl_receive_weights(mapping.manifest_to_json(manifest))
            except Exception as e:  # noqa: BLE001 - handed to the test
                out["error"] = e

        thread = threading.Thread(target=receive)
        thread.start()
        stats: dict[str, int] = {}
        send_weights(sender, iter(params.items()), manifest, stats)
        thread.join(20)
        return manifest, stats, out

    model = worker.model_runner.model
    for version in (1, 2, 3):
        if version > 1:
            params["w"][version, :2] += 1.0  # two elements change
        manifest, stats, out = sync(version)
        assert out["n"][0] == 2, out  # every tensor, whole, through load_weights
        assert manifest.base_version == (-1 if version == 1 else version - 1)
        assert stats["changed"] == (28 if version == 1 else 2)
        for name, want in params.items():
            assert torch.equal(getattr(model, name).data, want.to(torch.bfloat16).float()), name

    worker._meshrl_group.delta_state.buffers[0][0] += 1  # its copy goes bad
    params["b"] += 1.0
    _, _, out = sync(4)
    assert "checksum" in str(out.get("error")), out
    assert worker._meshrl_group is None  # closed: the next sync forms a new group, in full
    sender.close()


class _StandInLLM:
    """What VllmEngine uses of ``vllm.LLM``: ``collective_rpc`` runs the extension's method on
    a stand-in worker in this process; sleep, wake-up and cache resets are recorded."""

    def __init__(self, worker):
        self.worker = worker
        self.calls: list[str] = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def sleep(self, level=1):
        self.calls.append(f"sleep:{level}")

    def wake_up(self, tags=None):
        self.calls.append(f"wake:{','.join(tags)}")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


def _engine_on(llm) -> VllmEngine:
    engine = object.__new__(VllmEngine)  # VllmEngine without vllm: its LLM is the stand-in
    engine.llm, engine.weight_version, engine.asleep = llm, 0, set()
    engine._device = torch.device("cuda")  # as on a GPU: sleep mode, weights woken alone
    engine.support = mapping.vllm_support("0.24.0")  # the model's own load_weights
    return engine


@pytest.mark.parametrize("fail", [False, True])
def test_rollout_worker_syncs_vllm_through_its_intake(monkeypatch, fail):
    """Asleep for the trainers, the engine wakes its weights alone for the sync (the KV
    cache stays released until the next generation); a sync that fails in vLLM's worker
    leaves version -1 and closes the group there."""
    stand_in = _stand_in_worker()
    llm = _StandInLLM(stand_in)
    engine = _engine_on(llm)
    monkeypatch.setattr(worker_module, "build_engine", lambda cfg: engine)
    worker = RolloutWorker()
    worker.initialize(build_config({}))
    worker.set_memory(release=True)
    params = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    named = [(n, tuple(t.shape)) for n, t in params.items()]

    store, spec = WeightGroup.open("127.0.0.1", timeout_s=5, world_size=2)
    with ThreadPoolExecutor(2) as pool:
        joined = pool.submit(worker.join_group, GroupSpec(**{**spec.__dict__, "rank": 1}))
        sender = WeightGroup.join(spec, store)
        assert joined.result() == spec.group_id
    manifest = WeightManifest(7, plan_buckets(named, torch.float32, 32), spec.group_id)
    with ThreadPoolExecutor(1) as pool:
        synced = pool.submit(worker.receive, manifest)
        if fail:  # the actor dies before sending: the worker's receive times out
            sender.close()
            with pytest.raises(WeightSyncError, match="in vLLM's worker .*weight version now -1"):
                synced.result(30)
            assert engine.weight_version == -1 and worker._group is None
            assert llm.calls[-1] == "meshrl_close_weight_group"
            return
        send_weights(sender, iter(params.items()), manifest)
        stats = synced.result(30)
    assert stats.version == 7 and stats.bytes == 4 * 28 and engine.weight_version == 7
    assert torch.equal(stand_in.model_runner.model.w, params["w"])
    assert llm.calls == [
        "sleep:1", "meshrl_join_weight_group", "wake:weights", "meshrl_receive_weights",
        "reset_prefix_cache",
    ]  # fmt: skip
    assert engine.asleep == {"kv_cache"}
    with pytest.raises(MemoryReleasedError):
        worker.generate(Ragged.from_lists([[1, 2]]), SamplingParams())
    worker.set_memory(release=False)
    assert llm.calls[-1] == "wake:kv_cache" and not engine.asleep
    sender.close()
    worker.close()
