"""Tiny random checkpoints in the real on-disk format, for tests and the demo.

They go through the same `config.json` + safetensors path as a released checkpoint, so a test
exercises the loader and config parsing too. The init follows the golden README (std-0.02
matrices, norms near 1, a wide Ouro exit gate) and the parameter order of the official models,
so `write_random_checkpoint(dir, "nanbeige", seed=2, max_position_embeddings=256)` reproduces
the golden `nanbeige_s` weights exactly (Ouro differs only by the golden gate-bias calibration).
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import save_file

from rlt_serve.config import ConfigError, parse_dtype
from rlt_serve.loader import GENERATION_CONFIG_FILE, INDEX_FILE, SINGLE_FILE, save_checkpoint

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


# RavenConfig as the golden `huginn_s` config.json writes it (MODELS.md §3.1, tiny shape).
_HUGINN: dict[str, Any] = {
    "architectures": ["RavenForCausalLM"],
    "auto_map": {
        "AutoConfig": "raven_config_minimal.RavenConfig",
        "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
    },
    "model_type": "huginn_raven",
    "bias": False,
    "block_class_name": "SandwichBlock",
    "block_size": 256,
    "bos_token_id": 352,
    "eos_token_id": 353,
    "pad_token_id": 357,
    "injection_type": "linear",
    "intermediate_size": 128,
    "mean_recurrence": 4,
    "mlp_class_name": "GatedMLP",
    "n_embd": 64,
    "n_heads": 4,
    "n_layers_in_coda": 2,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 2,
    "nonlin_name": "SiLU",
    "norm_class_name": "RMSNorm_llama",
    "norm_eps": 1e-6,
    "qk_bias": True,
    "rope_base": 50000,
    "state_init": "like-init",
    "test_time_noise": 0,
    "tie_embeddings": True,
    "vocab_size": 384,
}


def _huginn_config(overrides: dict[str, Any]) -> dict[str, Any]:
    """Fields the official config class derives from the others, as it writes them."""
    cfg = {**_HUGINN, **overrides}
    e = cfg["n_embd"]
    layers = cfg["n_layers_in_prelude"] + cfg["n_layers_in_recurrent_block"] + cfg["n_layers_in_coda"]
    cfg.update(n_layers=layers, head_dim=e // cfg["n_heads"], num_key_value_heads=cfg["n_heads"],
               padded_vocab_size=cfg["vocab_size"], init_values={"std": math.sqrt(2 / (5 * e)), "embed_scale": math.sqrt(e)})
    return cfg


def _huginn_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """RavenForCausalLM.state_dict() keys in named_parameters() order, then the stored tied copy
    and the `freqs_cis` buffer (not drawn from the RNG)."""
    e, i, v, heads = cfg["n_embd"], cfg["intermediate_size"], cfg["vocab_size"], cfg["n_heads"]
    d = e // heads

    def block(p: str) -> list[tuple[str, tuple[int, ...], str]]:
        # A module's own parameters come before its children's: qk_bias before Wqkv.
        return [(p + "norm_1.weight", (e,), "norm"), (p + "attn.qk_bias", (2, 1, heads, d), "matrix"),
                (p + "attn.Wqkv.weight", (3 * e, e), "matrix"), (p + "attn.proj.weight", (e, e), "matrix"),
                (p + "norm_2.weight", (e,), "norm"), (p + "mlp.fc.weight", (2 * i, e), "matrix"),
                (p + "mlp.proj.weight", (e, i), "matrix"), (p + "norm_3.weight", (e,), "norm"),
                (p + "norm_4.weight", (e,), "norm")]  # fmt: skip

    specs = [("transformer.wte.weight", (v, e), "matrix")]
    for j in range(cfg["n_layers_in_prelude"]):
        specs += block(f"transformer.prelude.{j}.")
    specs.append(("transformer.adapter.weight", (e, 2 * e), "matrix"))
    for j in range(cfg["n_layers_in_recurrent_block"]):
        specs += block(f"transformer.core_block.{j}.")
    for j in range(cfg["n_layers_in_coda"]):
        specs += block(f"transformer.coda.{j}.")
    specs.append(("transformer.ln_f.weight", (e,), "norm"))
    specs.append(("lm_head.weight", (v, e), "tied_copy" if cfg["tie_embeddings"] else "matrix"))
    return specs + [("freqs_cis", (1, cfg["block_size"], 1, d // 2, 2), "rope_table")]


def _derived(kind: str, shape: tuple[int, ...], cfg: dict[str, Any], first: torch.Tensor) -> torch.Tensor:
    """Tensors a checkpoint stores that are not random draws: the tied copy of the embedding
    (`first`), and Huginn's fp32 (cos, sin) RoPE table."""
    if kind == "tied_copy":
        return first.clone()
    half = shape[3]
    inv = 1.0 / cfg["rope_base"] ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half))
    angles = torch.outer(torch.arange(shape[1], dtype=torch.float32), inv)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)[None, :, None]


def _config(family: str, dtype: str, overrides: dict[str, Any]) -> dict[str, Any]:
    if family not in ("ouro", "nanbeige", "huginn"):
        raise ConfigError(f"unknown family {family!r}; use 'ouro', 'nanbeige' or 'huginn'")
    if family == "huginn":
        cfg = _huginn_config(overrides)
        cfg["torch_dtype"] = cfg["dtype"] = dtype
        return dict(sorted(cfg.items()))
    cfg = {**_COMMON, **(_OURO if family == "ouro" else _NANBEIGE), **overrides}
    if family == "ouro" and "num_key_value_heads" not in overrides:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]  # Ouro is MHA unless told otherwise
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    return dict(sorted(cfg.items()))


def _param_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(key, shape, init kind) in the official models' named_parameters() order."""
    if cfg["model_type"] == "huginn_raven":
        return _huginn_specs(cfg)
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


# Tensors that scale what one layer adds to the residual stream, so scaling them by S scales every
# loop's update: Ouro's post-sublayer ("sandwich") norms, Nanbeige's output projections. Huginn has
# none (its blocks normalise the residual sum itself), so it gets no update scale.
_UPDATE_SUFFIXES = {
    "ouro": ("input_layernorm_2.weight", "post_attention_layernorm_2.weight"),
    "nanbeige": ("self_attn.o_proj.weight", "mlp.down_proj.weight"),
}


def update_keys(model_type: str, keys: list[str]) -> list[str]:
    """The keys an update scale multiplies (see `_UPDATE_SUFFIXES`)."""
    if model_type not in _UPDATE_SUFFIXES:
        raise ConfigError(f"update_scale: {model_type} has no per-loop update weights to scale (Ouro and Nanbeige do)")
    return [k for k in keys if k.startswith("model.layers.") and k.endswith(_UPDATE_SUFFIXES[model_type])]


def iter_random_weights(
    cfg: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32, update_scale: float | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, weight) one tensor at a time, so a full-size checkpoint never sits in memory whole.
    Deterministic per seed (a private generator leaves the caller's global RNG alone).

    `update_scale` S multiplies every layer's residual update (`update_keys`): with S small a loop
    barely moves the state, so shallow and deep predictions agree, which is what self-speculation
    and early exit are measured against (random weights alone make every loop a new random map).
    The draws are the same for any S, so S is the only difference between two such checkpoints."""
    gen = torch.Generator().manual_seed(seed)
    scaled = set()
    if update_scale is not None:
        scaled = set(update_keys(cfg["model_type"], [key for key, _, _ in _param_specs(cfg)]))
    first: torch.Tensor | None = None
    for key, shape, kind in _param_specs(cfg):
        if kind in ("tied_copy", "rope_table"):
            t = _derived(kind, shape, cfg, first)
            yield key, t if kind == "rope_table" else t.to(dtype)
            continue
        noise = torch.randn(shape, generator=gen)
        w = noise.mul_(0.1).add_(1.0) if kind == "norm" else noise.mul_(_STD[kind])
        if key in scaled:
            w.mul_(update_scale)
        first = w if first is None else first
        yield key, w.to(dtype)


def random_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 weights for a config dict, deterministic per seed."""
    return dict(iter_random_weights(cfg, seed))


# Full-size shapes (config.json overrides) of the released checkpoints, from MODELS.md §1.2, §2.2
# and §3.1: random weights in these shapes measure serving speed without downloading anything.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": ("ouro", {}),
    "ouro-1.4b": ("ouro", {
        "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "head_dim": 128, "intermediate_size": 5632, "vocab_size": 49152, "max_position_embeddings": 65536,
        "total_ut_steps": 4,
    }),
    "ouro-2.6b": ("ouro", {
        "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 16,
        "head_dim": 128, "intermediate_size": 5632, "vocab_size": 49152, "max_position_embeddings": 65536,
        "total_ut_steps": 4,
    }),
    "nanbeige4.2-3b": ("nanbeige", {
        "hidden_size": 3072, "num_hidden_layers": 22, "num_attention_heads": 48, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 10752, "vocab_size": 166144, "max_position_embeddings": 262144,
        "num_loops": 2, "bos_token_id": 166100, "eos_token_id": 166101, "pad_token_id": 0,
    }),
    "huginn-0125": ("huginn", {  # MODELS.md §3.1: 3.56B parameters, 32 recurrence steps by default
        "n_embd": 5280, "n_heads": 55, "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4,
        "n_layers_in_coda": 2, "intermediate_size": 17920, "vocab_size": 65536, "block_size": 4096,
        "mean_recurrence": 32, "rope_base": 50000,
    }),
}  # fmt: skip


def _write_streamed(
    model_dir: str, cfg: dict[str, Any], seed: int, dtype: torch.dtype, max_shard_bytes: int,
    update_scale: float | None = None,
) -> None:
    """Shard layout and index exactly as `save_checkpoint` writes them, but each shard is
    generated, written and freed in turn: memory peaks at about one shard."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    plan: list[list[str]] = [[]]
    size = total = 0
    for key, shape, _ in _param_specs(cfg):
        nbytes = math.prod(shape) * itemsize
        if plan[-1] and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(key)
        size += nbytes
        total += nbytes
    weights = iter_random_weights(cfg, seed, dtype, update_scale)
    if len(plan) == 1:
        save_checkpoint(model_dir, dict(weights))
        return
    for name in os.listdir(model_dir):  # never leave two disagreeing checkpoints behind
        if name in (SINGLE_FILE, INDEX_FILE) or (name.startswith("model-") and name.endswith(".safetensors")):
            os.remove(os.path.join(model_dir, name))
    weight_map: dict[str, str] = {}
    for i, keys in enumerate(plan, start=1):
        name = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        shard = dict(next(weights) for _ in keys)
        save_file(shard, os.path.join(model_dir, name), metadata={"format": "pt"})
        weight_map.update({key: name for key in keys})
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(model_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
        f.write("\n")


def write_random_checkpoint(
    model_dir: str,
    family: str,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_bytes: int | None = None,
    generation_config: dict[str, Any] | None = None,
    update_scale: float | None = None,
    **config_overrides: Any,
) -> str:
    """Write config.json, weights (optionally sharded) and generation_config.json; return the dir.

    `config_overrides` are config.json fields (e.g. num_hidden_layers=3, head_dim=24,
    total_ut_steps=3, tie_word_embeddings=True). `update_scale`: see `iter_random_weights`.
    """
    torch_dtype = parse_dtype(dtype)
    name = str(torch_dtype).replace("torch.", "")
    cfg = _config(family, name, config_overrides)
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    if max_shard_bytes is None:
        save_checkpoint(model_dir, dict(iter_random_weights(cfg, seed, torch_dtype, update_scale)))
    else:
        _write_streamed(model_dir, cfg, seed, torch_dtype, max_shard_bytes, update_scale)
    gen_path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
    if generation_config is not None:
        with open(gen_path, "w", encoding="utf-8") as f:
            json.dump(generation_config, f, indent=2)
            f.write("\n")
    elif os.path.exists(gen_path):
        os.remove(gen_path)
    return model_dir


def derive_update_scaled(src_dir: str, dst_dir: str, scale: float) -> str:
    """A checkpoint equal to `src_dir` but with every residual update (`update_keys`) multiplied
    by `scale`, written without copying the bulk: the other shards are symlinked and only the
    (small) update tensors go to a new shard named in a rewritten index. Needs a sharded source
    (`max_shard_bytes`), since a single file cannot be partly replaced. Returns `dst_dir`."""
    from safetensors import safe_open

    index_path = os.path.join(src_dir, INDEX_FILE)
    if not os.path.isfile(index_path):
        raise ConfigError(f"{src_dir}: deriving an update-scaled copy needs a sharded checkpoint ({INDEX_FILE}); "
                          "write it with max_shard_bytes")
    with open(os.path.join(src_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    weight_map: dict[str, str] = index["weight_map"]
    keys = update_keys(cfg["model_type"], list(weight_map))
    os.makedirs(dst_dir, exist_ok=True)
    scaled: dict[str, torch.Tensor] = {}
    for key in keys:
        with safe_open(os.path.join(src_dir, weight_map[key]), framework="pt") as f:
            scaled[key] = f.get_tensor(key) * scale
    shard = "model-update-scaled.safetensors"
    save_file(scaled, os.path.join(dst_dir, shard), metadata={"format": "pt"})
    for name in set(weight_map.values()):
        link = os.path.join(dst_dir, name)
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(os.path.abspath(os.path.join(src_dir, name)), link)
    for name in os.listdir(src_dir):  # config, generation config, tokenizer files
        if name.endswith(".json") and name != INDEX_FILE or name.startswith("tokenizer"):
            with open(os.path.join(src_dir, name), "rb") as f, open(os.path.join(dst_dir, name), "wb") as g:
                g.write(f.read())
    index["weight_map"] = {k: shard if k in scaled else v for k, v in weight_map.items()}
    with open(os.path.join(dst_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return dst_dir


def random_attention_call(
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    spans: list[tuple[int, int]],
    seed: int = 0,
    masked: bool = False,
    num_pages: int | None = None,
    depth_slots: int = 3,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kv_dtype: torch.dtype | None = None,
):
    """One core call's attention inputs for comparing backends: two identical KV pools of
    `kv_dtype` (default `dtype`) with random contents (layer 1 has `depth_slots` planes), rows
    (num_query, start) at random depths over shuffled pages, q/k/v and, if `masked`, a random
    write mask. Returns (pools, rows, qkv, mask)."""
    from rlt_serve.attention.backend import RowSpec
    from rlt_serve.engine.kv_cache import KVCache

    device = torch.device(device)
    rng, gen = random.Random(seed), torch.Generator(device=device).manual_seed(seed)
    if num_pages is None:
        num_pages = sum(-(-(s + n) // page_size) for n, s in spans) + 8
    kv_dtype = kv_dtype or dtype
    pools = [KVCache([1, depth_slots, 1], num_pages, page_size, kv_heads, head_dim, kv_dtype, device) for _ in range(2)]
    for t in (pools[0].k, pools[0].v):  # normal_ has no float8 kernel: float8 draws in fp32, then rounds
        if kv_dtype.itemsize == 1:
            t.copy_(torch.randn(t.shape, generator=gen, device=device).to(kv_dtype))
        else:
            t.normal_(generator=gen)
    pools[1].k.copy_(pools[0].k)
    pools[1].v.copy_(pools[0].v)
    free = list(range(num_pages))
    rng.shuffle(free)
    rows = [RowSpec(n, s, rng.randrange(depth_slots), [free.pop() for _ in range(-(-(s + n) // page_size))])
            for n, s in spans]  # fmt: skip
    t = sum(n for n, _ in spans)
    q, k, v = (torch.randn(t, h, head_dim, generator=gen, device=device, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    mask = torch.rand(t, generator=gen, device=device) > 0.3 if masked else None
    return pools, rows, (q, k, v), mask
