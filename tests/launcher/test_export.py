"""`meshrl export` on step checkpoints written here the way the trainer writes them (DCP of
the float32 masters, hf/ side files, a manifest), without servers: dtype, tied embeddings,
a critic with a model of its own, output folders that are not empty, and paths that are
not a step checkpoint. The end-to-end check against a trainer is
tests/e2e/test_export_and_reshard.py."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from peft import PeftModel
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from meshrl.config.sections import ModelConfig
from meshrl.testing.tiny_model import make_tiny_model_dir, make_tiny_qwen2_dir
from meshrl_app.cli import main
from meshrl_app.export import ExportError, export_checkpoint
from meshrl_app.export_adapter import export_adapter
from services.coordinator.recovery.checkpointing import write_manifest
from services.trainer.lora import add_lora, iter_merged_params, lora_settings
from services.trainer.model_loading import load_policy_model, load_value_model

IDS = torch.tensor([[1, 5, 6, 7, 8, 9]])


def write_step_checkpoint(
    run_dir: Path,
    actor_model: Path,
    critic_model: Path | None = None,
    lora: ModelConfig | None = None,
):
    """global_step_1 of `run_dir` as a run leaves it: actor and critic shards, hf/ side
    files of the actor's model, the run config, the manifest. With `lora`, both roles carry
    trained (non-zero) adapters and their meta.json says so, as TrainedRole.save writes it."""
    ck = run_dir / "checkpoints" / "global_step_1"
    actor = load_policy_model(str(actor_model))
    critic = load_value_model(str(critic_model or actor_model))
    with torch.no_grad():  # a trained head: not the zeros it starts from
        critic.value_head.weight.normal_()
        critic.value_head.bias.fill_(0.5)
    if lora is not None:
        add_lora(actor, lora)
        add_lora(critic.model, lora)
        with torch.no_grad():  # trained adapters: B is no longer the zeros it starts from
            for name, p in [*actor.named_parameters(), *critic.named_parameters()]:
                if ".lora_B." in name:
                    p.normal_(std=0.5)
    for name, model in (("actor", actor), ("critic", critic)):
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(ck / name), no_dist=True)
        if lora is not None:
            meta = {"role": name, "lora": lora_settings(model)}
            (ck / name / "meta.json").write_text(json.dumps(meta))
    (ck / "hf").mkdir()
    for f in actor_model.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, ck / "hf" / f.name)
    run_cfg = {
        "actor_rollout_ref": {"model": {"path": str(actor_model)}},
        "critic": {"model": {"path": str(critic_model or "")}},
    }
    (ck / "config.yaml").write_text(yaml.safe_dump(run_cfg))
    write_manifest(ck)
    return ck, actor.eval(), critic.eval()


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A Qwen2 with tied embeddings whose folder is bfloat16, as Qwen2.5's are."""
    root = tmp_path_factory.mktemp("bf16")
    model_dir = make_tiny_qwen2_dir(root / "model", tie_word_embeddings=True)
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(model_dir)
    return write_step_checkpoint(root / "run", model_dir)


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    return write_step_checkpoint(root / "run", make_tiny_model_dir(root / "model"))


def test_a_bfloat16_model_comes_back_in_bfloat16_with_the_embedding_once(bf16_checkpoint, tmp_path):
    ck, actor, _ = bf16_checkpoint
    out = export_checkpoint(ck, "actor", tmp_path / "hf")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}, "config.json says bfloat16"
    assert "lm_head.weight" not in saved, "tied: the embedding is written once"
    masters = dict(actor.named_parameters())
    for name, tensor in saved.items():
        assert torch.equal(tensor, masters[name].detach().to(torch.bfloat16)), name
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        exported, trained = model(input_ids=IDS).logits, actor.to(torch.bfloat16)(IDS).logits
    assert torch.allclose(exported, trained, atol=2e-2)  # bf16 rounding of two head paths
    assert (out / "generation_config.json").is_file() and (out / "tokenizer.json").is_file()


def test_shards_are_sized_as_written_not_as_the_float32_masters(bf16_checkpoint, tmp_path):
    ck, _, _ = bf16_checkpoint
    limit = 60_000  # the bfloat16 model is about 154 kB: 3 shards, not the 6 of float32
    out = export_checkpoint(ck, "actor", tmp_path / "hf", shard_bytes=limit)
    shards = sorted(out.glob("model-*.safetensors"))
    assert 2 <= len(shards) <= 4
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
        assert sum(sizes) <= limit or len(sizes) == 1, shard.name
    AutoModelForCausalLM.from_pretrained(out)


def test_a_float32_critic_exports_its_value_head_as_score(llama_checkpoint, tmp_path):
    ck, _, critic = llama_checkpoint
    out = export_checkpoint(ck, "critic", tmp_path / "hf")
    assert not (out / "generation_config.json").exists()
    model = AutoModelForTokenClassification.from_pretrained(out)
    with torch.no_grad():
        # Another module computing the same function: equal up to float summation order.
        torch.testing.assert_close(
            model(input_ids=IDS).logits[..., 0], critic(IDS), atol=1e-5, rtol=0
        )


def test_a_critic_started_from_its_own_model_gets_that_models_config(tmp_path):
    actor_model = make_tiny_model_dir(tmp_path / "actor_model")
    critic_model = make_tiny_model_dir(tmp_path / "critic_model", hidden=32, intermediate=64)
    ck, _, critic = write_step_checkpoint(tmp_path / "run", actor_model, critic_model)
    out = export_checkpoint(ck, "critic", tmp_path / "hf")
    model = AutoModelForTokenClassification.from_pretrained(out)
    assert model.config.hidden_size == 32
    with torch.no_grad():
        # Another module computing the same function: equal up to float summation order.
        torch.testing.assert_close(
            model(input_ids=IDS).logits[..., 0], critic(IDS), atol=1e-5, rtol=0
        )

    # the same shards described by the actor's config: refused, naming a tensor
    run_cfg = yaml.safe_load((ck / "config.yaml").read_text())
    run_cfg["critic"]["model"]["path"] = ""
    (ck / "config.yaml").write_text(yaml.safe_dump(run_cfg))
    write_manifest(ck)
    with pytest.raises(ExportError, match=r"do not fit its config.json .*model\..*\(32"):
        export_checkpoint(ck, "critic", tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()


def test_lora_adapters_are_merged_into_the_exported_weights(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "model")
    lora = ModelConfig(lora_rank=4, lora_alpha=8)
    ck, actor, critic = write_step_checkpoint(tmp_path / "run", model_dir, lora=lora)
    # Small shards: a layer's adapter factors are read wherever its base weight lands.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = export_checkpoint(ck, "actor", tmp_path / "hf", shard_bytes=20_000)
    # torch's "torch.distributed is disabled ..." on each shard read says nothing to a user
    assert not [w for w in caught if "torch.distributed" in str(w.message)]
    assert len(list(out.glob("model-*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(out)
    merged = dict(iter_merged_params(actor))
    assert set(model.state_dict()) == set(merged)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, actor(IDS).logits)

    critic_out = export_checkpoint(ck, "critic", tmp_path / "hf_critic")
    scorer = AutoModelForTokenClassification.from_pretrained(critic_out)
    with torch.no_grad():
        torch.testing.assert_close(scorer(input_ids=IDS).logits[..., 0], critic(IDS))

    # The adapters alone, as peft loads them onto the base model: the same function.
    with warnings.catch_warnings(record=True) as said:  # torch's own, which means nothing here
        warnings.simplefilter("always")
        assert main(["export", str(ck), "--adapter", "--to", str(tmp_path / "adapter")]) == 0
    assert not [w for w in said if "torch.distributed is disabled" in str(w.message)]
    adapter = tmp_path / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=IDS).logits, model(input_ids=IDS).logits)
    assert (
        main(["export", str(ck), "--adapter", "--role", "critic", "--to", str(tmp_path / "c")]) == 2
    )

    (ck / "actor" / "meta.json").unlink()  # the adapters' scale is no longer known
    write_manifest(ck)
    with pytest.raises(ExportError, match="LoRA layer's base weight.*adapters' settings"):
        export_checkpoint(ck, "actor", tmp_path / "hf2")


@pytest.mark.parametrize("already", ["an earlier export", "a file"])
def test_an_output_folder_that_is_not_empty_is_refused_and_left_alone(
    llama_checkpoint, tmp_path, already
):
    ck, _, _ = llama_checkpoint
    out = tmp_path / "hf"
    if already == "a file":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    else:
        export_checkpoint(ck, "actor", out, shard_bytes=100_000)  # several shards + index
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with pytest.raises(ExportError, match="already exists and is not empty"):
        export_checkpoint(ck, "critic", out)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"], "no temporary folder left"


def test_an_empty_output_folder_is_used(llama_checkpoint, tmp_path):
    ck, _, _ = llama_checkpoint
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / ".partial-export").mkdir()  # left by an export that was killed
    inode = (tmp_path / "hf").stat().st_ino
    out = export_checkpoint(ck, "actor", tmp_path / "hf", shard_bytes=100_000)
    # written inside, not renamed over: the folder may be a mount point (docker run -v)
    assert out.stat().st_ino == inode and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert not (out / ".partial-export").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in out.glob("model-*.safetensors")}
    AutoModelForCausalLM.from_pretrained(out)


def test_paths_that_are_not_a_step_checkpoint_say_what_to_pass(llama_checkpoint, tmp_path):
    ck, _, _ = llama_checkpoint
    with pytest.raises(ExportError, match=rf"pass its step folder, {ck}, with --role actor"):
        export_checkpoint(ck / "actor", "actor", tmp_path / "a")  # verl's merger takes this
    with pytest.raises(ExportError, match=rf"e\.g\. the latest, {ck}"):
        export_checkpoint(ck.parents[1], "actor", tmp_path / "b")  # the run folder
    with pytest.raises(ExportError, match="no such folder"):
        export_checkpoint(tmp_path / "nope", "actor", tmp_path / "c")


def test_partial_and_corrupt_checkpoints_are_named_by_the_cli(llama_checkpoint, tmp_path, capsys):
    ck, _, _ = llama_checkpoint
    partial = tmp_path / "global_step_2"
    shutil.copytree(ck, partial)
    (partial / "MANIFEST.json").unlink()
    assert main(["export", str(partial), "--to", str(tmp_path / "a")]) == 2
    assert (
        "global_step_2: no MANIFEST.json (an unfinished save, or no checkpoint)"
        in capsys.readouterr().err
    )

    corrupt = tmp_path / "global_step_3"
    shutil.copytree(ck, corrupt)
    shard = next((corrupt / "actor").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte
    shard.write_bytes(bytes(data))
    assert main(["export", str(corrupt), "--to", str(tmp_path / "b")]) == 2
    assert "does not match its checksum" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_checkpoint_without_any_model_config_is_refused(llama_checkpoint, tmp_path):
    ck, _, _ = llama_checkpoint
    old = tmp_path / "global_step_1"
    shutil.copytree(ck, old)
    shutil.rmtree(old / "hf")  # older checkpoints had no hf/; and the model folder is gone
    (old / "config.yaml").write_text(
        yaml.safe_dump({"actor_rollout_ref": {"model": {"path": str(tmp_path / "gone")}}})
    )
    write_manifest(old)
    with pytest.raises(ExportError, match=r"actor_rollout_ref\.model\.path"):
        export_checkpoint(old, "actor", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_run_without_a_critic_says_so(llama_checkpoint, tmp_path):
    ck, _, _ = llama_checkpoint
    grpo = tmp_path / "global_step_1"
    shutil.copytree(ck, grpo)
    shutil.rmtree(grpo / "critic")
    write_manifest(grpo)
    with pytest.raises(ExportError, match="holds no critic/ folder"):
        export_checkpoint(grpo, "critic", tmp_path / "hf")


def test_a_separate_tokenizer_folder_gives_its_tokenizer_files_only(tmp_path):
    """`model.tokenizer_path` names another folder: its tokenizer joins the model's config,
    and its own config.json (often another model's) does not replace the model's."""
    from meshrl.model_files import copy_model_files

    model, tokenizer, dest = tmp_path / "model", tmp_path / "tok", tmp_path / "hf"
    model.mkdir(), tokenizer.mkdir()
    (model / "config.json").write_text('{"model": "the policy"}')
    (tokenizer / "config.json").write_text('{"model": "another"}')
    (tokenizer / "tokenizer.json").write_text("{}")
    copy_model_files(model, tokenizer, dest)
    assert (dest / "config.json").read_text() == '{"model": "the policy"}'
    assert (dest / "tokenizer.json").is_file()


def test_adapter_export_of_a_full_fine_tune_says_to_export_the_model(llama_checkpoint, tmp_path):
    ck, _, _ = llama_checkpoint
    with pytest.raises(ExportError, match="trained without LoRA adapters.*without --adapter"):
        export_adapter(ck, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
