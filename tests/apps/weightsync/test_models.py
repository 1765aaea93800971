"""The weight-sync job's models: transformers' Qwen2 presets, and safetensors checkpoints with the index rules."""

import json

import pytest
import torch
from safetensors.torch import save_file

from hal.apps.weightsync import models

pytest.importorskip("transformers")


def _sharded(tmp_path, shards=3):
    """A checkpoint of 6 tensors in ``shards`` files with a Hugging Face index."""
    tensors = {f"layers.{i}.weight": torch.full((2, 3), float(i)) for i in range(6)}
    weight_map = {}
    for i, (name, _t) in enumerate(tensors.items()):
        shard = f"model-{i % shards + 1:05d}-of-{shards:05d}.safetensors"
        weight_map[name] = shard
    for shard in sorted(set(weight_map.values())):
        save_file({n: t for n, t in tensors.items() if weight_map[n] == shard}, str(tmp_path / shard))
    (tmp_path / models.INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 144}, "weight_map": weight_map}))
    return tensors, weight_map


def test_an_index_is_honoured_exactly(tmp_path):
    tensors, weight_map = _sharded(tmp_path)
    save_file({"stray": torch.zeros(4)}, str(tmp_path / "consolidated.safetensors"))  # not in the index
    files = models.safetensors_files(tmp_path)
    assert [f.name for f in files] == list(dict.fromkeys(weight_map.values()))
    loaded = models.load_checkpoint(tmp_path)
    assert sorted(loaded) == sorted(tensors)  # the stray file is not loaded
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    assert sorted(models.serving_model(str(tmp_path)).state_dict()) == sorted(tensors)


def test_a_shard_the_index_lists_but_the_directory_lacks_is_an_error_naming_it(tmp_path):
    _sharded(tmp_path)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="lists shard 'model-00002-of-00003.safetensors'"):
        models.safetensors_files(tmp_path)


def test_a_directory_without_an_index_loads_every_safetensors_file(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "one.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "two.safetensors"))
    assert sorted(models.load_checkpoint(tmp_path)) == ["a", "b"]


def test_the_default_preset_is_transformers_qwen2_with_the_published_configuration():
    config = models.qwen2_config("qwen2.5-0.5b")
    assert type(config).__name__ == "Qwen2Config"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == \
        (896, 24, 14, 2, 4864, 151936, True)


def test_trainer_weights_are_fp32_and_a_rollout_serves_bf16():
    module, loss_fn = models.build("qwen2.5-tiny")
    assert type(module).__name__ == "Qwen2ForCausalLM"
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert module.lm_head.weight is module.model.embed_tokens.weight
    loss = loss_fn(module)
    assert loss.ndim == 0 and 7.0 < float(loss.detach()) < 10.0  # about ln(4096) for a random model
    served = models.serving_model("qwen2.5-tiny")
    assert {p.dtype for p in served.parameters()} == {torch.bfloat16}
    # the same seed gives the same weights: the trainer's init is reproducible
    again, _ = models.build("qwen2.5-tiny")
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), again.parameters()))


def test_a_preset_matches_in_any_letter_case_unless_a_path_of_that_name_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert models.resolve_model("qwen2.5-0.5b") == "qwen2.5-0.5b"
    assert models.resolve_model("Qwen2.5-0.5B") == "qwen2.5-0.5b" and models.resolve_model("QWEN2.5-TINY") == "qwen2.5-tiny"
    with pytest.raises(FileNotFoundError, match="'Qwen2.5-7B': no such safetensors file.*presets: qwen2.5-0.5b"):
        models.resolve_model("Qwen2.5-7B")
    (tmp_path / "Qwen2.5-tiny").mkdir()  # a checkpoint directory named like a preset is that checkpoint
    save_file({"w": torch.ones(2)}, str(tmp_path / "Qwen2.5-tiny" / "model.safetensors"))
    assert models.resolve_model("Qwen2.5-tiny") == "Qwen2.5-tiny"


def test_hal_sync_runs_and_reports_the_preset_by_its_key(monkeypatch):
    from hal.apps.cli import sync
    from hal.apps.weightsync import launchers
    from hal.apps.weightsync.loop import JobResult

    seen = []

    def launch(options, hooks):
        seen.append((options.model, options.engine, hooks))
        return JobResult({}, [])

    monkeypatch.setattr(launchers, "launch", launch)
    result = sync.execute(sync.Sync(device="cpu", model="Qwen2.5-Tiny", engine="colocated", steps=1))
    assert seen == [("qwen2.5-tiny", "colocated", [])] and result["model"] == "qwen2.5-tiny"
    assert result["verified"] is False  # no row for its one step
