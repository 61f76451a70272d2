"""Tiny random checkpoints in the real on-disk format, for tests and the demo.

They go through the same `config.json` + safetensors path as a released checkpoint, so a test
exercises the loader and config parsing too. The init follows the golden README (std-0.02
matrices, norms near 1, a wide Ouro exit gate) and the parameter order of the official models,
so `write_random_checkpoint(dir, "nanbeige", seed=2, max_position_embeddings=256)` reproduces
the golden `nanbeige_s` weights exactly (Ouro differs only by the golden gate-bias calibration).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from rlt_serve.config import ConfigError, parse_dtype
from rlt_serve.loader import GENERATION_CONFIG_FILE, save_checkpoint

_COMMON: dict[str, Any] = {
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 384,
}

_OURO: dict[str, Any] = {
    "architectures": ["OuroForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_ouro.OuroConfig",
        "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
    },
    "model_type": "ouro",
    "bos_token_id": 0,
    "eos_token_id": 0,
    "early_exit_threshold": 1.0,
    "max_window_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "total_ut_steps": 4,
    "use_sliding_window": False,
}

_NANBEIGE: dict[str, Any] = {
    "architectures": ["NanbeigeForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_nanbeige.NanbeigeConfig",
        "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM",
    },
    "model_type": "nanbeige",
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "enable_depth_attention": False,
    "enable_double_loop_split": False,
    "enable_hyper_connection": False,
    "enable_mhc": False,
    "emb_neighbor_num": None,
    "head_dim": 32,
    "insert_ngram_layer_idx": [],
    "loop_loss_weights": [],
    "loop_share_kv": False,
    "mlp_bias": False,
    "num_key_value_heads": 2,
    "num_loops": 2,
    "pretraining_tp": 1,
    "qk_layernorm": False,
    "rms_norm_eps": 1e-5,
    "rope_theta": 70000000.0,
    "skip_loop_final_norm": False,
}


def _config(family: str, dtype: str, overrides: dict[str, Any]) -> dict[str, Any]:
    if family not in ("ouro", "nanbeige"):
        raise ConfigError(f"unknown family {family!r}; use 'ouro' or 'nanbeige'")
    cfg = {**_COMMON, **(_OURO if family == "ouro" else _NANBEIGE), **overrides}
    if family == "ouro" and "num_key_value_heads" not in overrides:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]  # Ouro is MHA unless told otherwise
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    return dict(sorted(cfg.items()))


def _param_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(key, shape, init kind) in the official models' named_parameters() order."""
    ouro = cfg["model_type"] == "ouro"
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    norms = ["input_layernorm", "post_attention_layernorm"]
    if ouro:
        norms = ["input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"]
    specs = [("model.embed_tokens.weight", (v, h), "matrix")]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        specs += [
            (p + "self_attn.q_proj.weight", (heads * d, h), "matrix"),
            (p + "self_attn.k_proj.weight", (kv * d, h), "matrix"),
            (p + "self_attn.v_proj.weight", (kv * d, h), "matrix"),
            (p + "self_attn.o_proj.weight", (h, heads * d), "matrix"),
            (p + "mlp.gate_proj.weight", (i, h), "matrix"),
            (p + "mlp.up_proj.weight", (i, h), "matrix"),
            (p + "mlp.down_proj.weight", (h, i), "matrix"),
        ]
        specs += [(p + f"{n}.weight", (h,), "norm") for n in norms]
    specs.append(("model.norm.weight", (h,), "norm"))
    if ouro:
        specs += [
            ("model.early_exit_gate.weight", (1, h), "gate_weight"),
            ("model.early_exit_gate.bias", (1,), "gate_bias"),
        ]
    if not cfg.get("tie_word_embeddings"):
        specs.append(("lm_head.weight", (v, h), "matrix"))
    return specs


_STD = {"matrix": 0.02, "gate_weight": 0.25, "gate_bias": 1.0}


def random_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 weights for a config dict, deterministic per seed (a private generator, so the
    global torch RNG of the calling test is left alone)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for key, shape, kind in _param_specs(cfg):
        noise = torch.randn(shape, generator=gen)
        out[key] = 1.0 + 0.1 * noise if kind == "norm" else noise * _STD[kind]
    return out


def write_random_checkpoint(
    model_dir: str,
    family: str,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_bytes: int | None = None,
    generation_config: dict[str, Any] | None = None,
    **config_overrides: Any,
) -> str:
    """Write config.json, weights (optionally sharded) and generation_config.json; return the dir.

    `config_overrides` are config.json fields (e.g. num_hidden_layers=3, head_dim=24,
    total_ut_steps=3, tie_word_embeddings=True).
    """
    torch_dtype = parse_dtype(dtype)
    name = str(torch_dtype).replace("torch.", "")
    cfg = _config(family, name, config_overrides)
    weights = {k: t.to(torch_dtype) for k, t in random_weights(cfg, seed).items()}
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    save_checkpoint(model_dir, weights, max_shard_bytes=max_shard_bytes)
    gen_path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
    if generation_config is not None:
        with open(gen_path, "w", encoding="utf-8") as f:
            json.dump(generation_config, f, indent=2)
            f.write("\n")
    elif os.path.exists(gen_path):
        os.remove(gen_path)
    return model_dir
