"""Checkpoint I/O: single vs sharded files, dtype conversion, meta-device loading, clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from rlt_serve.config import ConfigError
from rlt_serve.loader import (
    CheckpointError,
    checkpoint_files,
    load_generation_config,
    load_into_module,
    load_state_dict,
    save_checkpoint,
)
from rlt_serve.reference import ReferenceModel

INV_FREQ = "model.layers.0.self_attn.rotary_emb.inv_freq"


def _module_like(state: dict[str, torch.Tensor], device: str = "meta") -> nn.Module:
    """A module whose state_dict names and shapes equal `state`'s, built without rlt_serve.models."""
    with torch.device(device):
        root = nn.Module()
        for key, t in state.items():
            *path, leaf = key.split(".")
            mod = root
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, nn.Parameter(torch.empty(t.shape, dtype=torch.float32), requires_grad=False))
    return root


def test_single_and_sharded_load_identically(tmp_checkpoint):
    single = tmp_checkpoint("nanbeige", seed=3)
    sharded = tmp_checkpoint("nanbeige", seed=3, max_shard_bytes=60_000)
    assert os.path.isfile(f"{single}/model.safetensors")
    assert not os.path.exists(f"{sharded}/model.safetensors")
    index = json.load(open(f"{sharded}/model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    a, b = load_state_dict(single), load_state_dict(sharded)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())
    assert set(checkpoint_files(sharded).values()) == {os.path.abspath(f"{sharded}/{s}") for s in shards}

    m1, m2 = _module_like(a), _module_like(b)
    assert load_into_module(m1, single, torch.float32, "cpu") == []
    assert load_into_module(m2, sharded, torch.float32, "cpu") == []
    for (k, p), (_, q) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert p.device.type == "cpu" and torch.equal(p, q) and torch.equal(p, a[k]), k
    # The references on both load the same model.
    ids = [5, 9, 17, 3]
    assert torch.equal(ReferenceModel.from_pretrained(single).forward(ids).logits,
                       ReferenceModel.from_pretrained(sharded).forward(ids).logits)


def test_requested_keys_only(tmp_checkpoint):
    path = tmp_checkpoint("ouro", max_shard_bytes=50_000)
    keys = ["model.norm.weight", "model.early_exit_gate.bias"]
    assert list(load_state_dict(path, keys=keys)) == keys


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_conversion(tmp_checkpoint, dtype):
    path = tmp_checkpoint("ouro", seed=1)
    fp32 = load_state_dict(path)
    low = load_state_dict(path, dtype=dtype)
    assert all(t.dtype == dtype and torch.equal(t, fp32[k].to(dtype)) for k, t in low.items())
    module = _module_like(fp32)
    load_into_module(module, path, dtype, "cpu")
    for k, t in module.state_dict().items():
        assert t.dtype == dtype and torch.equal(t, fp32[k].to(dtype)), k
    # A checkpoint stored in low precision loads back up-cast exactly.
    stored = tmp_checkpoint("ouro", seed=1, dtype=str(dtype).replace("torch.", ""))
    assert json.load(open(f"{stored}/config.json"))["torch_dtype"] == str(dtype).replace("torch.", "")
    back = load_state_dict(stored, dtype=torch.float32)
    assert all(torch.equal(back[k], fp32[k].to(dtype).float()) for k in fp32)
    assert ReferenceModel.from_pretrained(stored, dtype=dtype).forward([4, 5, 6]).logits.dtype == torch.float32


def test_unused_inv_freq_is_ignored(tmp_checkpoint):
    path = tmp_checkpoint("nanbeige")
    weights = load_state_dict(path)
    save_checkpoint(path, {**weights, INV_FREQ: torch.ones(16)}, max_shard_bytes=100_000)
    module = _module_like(weights)
    assert load_into_module(module, path, torch.float32, "cpu") == [INV_FREQ]
    ReferenceModel.from_pretrained(path).forward([3, 4])


def test_buffers_and_tied_weights(tmp_checkpoint):
    """Persistent buffers load; a weight tied in the module is filled from whichever name is stored."""
    path = tmp_checkpoint("ouro", tie_word_embeddings=True)
    weights = load_state_dict(path)
    assert "lm_head.weight" not in weights
    module = _module_like({k: v for k, v in weights.items() if k != "model.norm.weight"})
    with torch.device("meta"):
        module.model.register_buffer("norm_weight_copy", torch.empty(64))
        module.lm_head = nn.Module()
    module.lm_head.weight = module.model.embed_tokens.weight  # tied
    save_checkpoint(path, {**weights, "model.norm_weight_copy": weights["model.norm.weight"].clone()})
    ignored = load_into_module(module, path, torch.float32, "cpu")
    assert ignored == ["model.norm.weight"]
    assert torch.equal(module.model.norm_weight_copy, weights["model.norm.weight"])
    assert torch.equal(module.lm_head.weight, weights["model.embed_tokens.weight"])
    ref = ReferenceModel.from_pretrained(tmp_checkpoint("ouro", tie_word_embeddings=True))
    assert ref.weights["lm_head.weight"] is ref.weights["model.embed_tokens.weight"]


def test_generation_config(tmp_checkpoint):
    assert load_generation_config(tmp_checkpoint("ouro")) == {}
    path = tmp_checkpoint("ouro", generation_config={"eos_token_id": [0, 2], "temperature": 0.6})
    assert load_generation_config(path) == {"eos_token_id": [0, 2], "temperature": 0.6}
    with open(f"{path}/generation_config.json", "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match="generation_config.json"):
        load_generation_config(path)


# ---- errors name the file and the key -------------------------------------------------------


def test_missing_config_json(tmp_checkpoint):
    path = tmp_checkpoint("ouro")
    os.remove(f"{path}/config.json")
    with pytest.raises(ConfigError, match="config.json"):
        ReferenceModel.from_pretrained(path)


def test_unknown_model_type(tmp_checkpoint):
    path = tmp_checkpoint("ouro", model_type="gpt2")
    with pytest.raises(ConfigError, match="gpt2"):
        ReferenceModel.from_pretrained(path)


def test_missing_directory_and_weights(tmp_path, tmp_checkpoint):
    with pytest.raises(CheckpointError, match="nowhere"):
        checkpoint_files(str(tmp_path / "nowhere"))
    path = tmp_checkpoint("ouro")
    os.remove(f"{path}/model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_state_dict(path)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        ReferenceModel.from_pretrained(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_safetensors(tmp_checkpoint, damage):
    path = tmp_checkpoint("nanbeige", max_shard_bytes=100_000)
    name = sorted(set(json.load(open(f"{path}/model.safetensors.index.json"))["weight_map"].values()))[1]
    shard = f"{path}/{name}"
    data = open(shard, "rb").read()
    new = {"garbage": b"\x13" * 64, "truncated": data[: len(data) // 2], "empty": b""}[damage]
    with open(shard, "wb") as f:
        f.write(new)
    with pytest.raises(CheckpointError, match=name):
        load_state_dict(path)
    with pytest.raises(CheckpointError, match=name):
        load_into_module(_module_like(load_state_dict(tmp_checkpoint("nanbeige"))), path, torch.float32, "cpu")


def test_bad_index(tmp_checkpoint):
    path = tmp_checkpoint("ouro", max_shard_bytes=50_000)
    with open(f"{path}/model.safetensors.index.json", "w") as f:
        f.write("[1, 2")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        checkpoint_files(path)


def test_index_names_missing_shard(tmp_checkpoint):
    path = tmp_checkpoint("ouro", max_shard_bytes=50_000)
    index = json.load(open(f"{path}/model.safetensors.index.json"))
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    json.dump(index, open(f"{path}/model.safetensors.index.json", "w"))
    with pytest.raises(CheckpointError, match="model-00009-of-00009.safetensors") as e:
        checkpoint_files(path)
    assert "model.safetensors.index.json" in str(e.value)


def test_index_key_absent_from_its_shard(tmp_checkpoint):
    path = tmp_checkpoint("ouro", max_shard_bytes=50_000)
    index = json.load(open(f"{path}/model.safetensors.index.json"))
    index["weight_map"]["model.extra.weight"] = "model-00001-of-" + sorted(index["weight_map"].values())[-1][15:]
    json.dump(index, open(f"{path}/model.safetensors.index.json", "w"))
    with pytest.raises(CheckpointError, match=r"model-00001-of-\d+\.safetensors.*model\.extra\.weight"):
        load_state_dict(path, keys=["model.extra.weight"])


def test_missing_key(tmp_checkpoint):
    path = tmp_checkpoint("ouro")
    weights = load_state_dict(path)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.7\.mlp\.up_proj\.weight'.*model\.safetensors"):
        load_state_dict(path, keys=["model.layers.7.mlp.up_proj.weight"])
    del weights["model.layers.1.input_layernorm_2.weight"]
    save_checkpoint(path, weights)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.input_layernorm_2\.weight'.*model\.safetensors"):
        ReferenceModel.from_pretrained(path)
    full = load_state_dict(tmp_checkpoint("ouro"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.input_layernorm_2\.weight'.*model\.safetensors"):
        load_into_module(_module_like(full), path, torch.float32, "cpu")


def test_wrong_shape(tmp_checkpoint):
    path = tmp_checkpoint("nanbeige", max_shard_bytes=100_000)
    key = "model.layers.1.self_attn.q_proj.weight"
    expected = {**load_state_dict(path), key: torch.empty(96, 64)}
    with pytest.raises(CheckpointError) as e:
        load_into_module(_module_like(expected), path, torch.float32, "cpu")
    msg = str(e.value)
    shard = os.path.basename(checkpoint_files(path)[key])
    assert key in msg and shard in msg
    assert "[128, 64]" in msg and "[96, 64]" in msg  # actual and expected shapes
