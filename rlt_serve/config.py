"""Model and engine configuration.

`ModelConfig` normalises the families' differently named `config.json` fields into one
vocabulary (a looped decoder: layers, heads, loops), so nothing downstream reads raw dicts.
`EngineConfig` holds the serving knobs (pages, budgets, backends) and validates combinations
once, at construction, so an unsupported one never runs.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("ouro", "nanbeige", "huginn_raven")
HUGINN = "huginn_raven"

# Huginn's config can name block, norm and injection variants of the research code base; only the
# released model's choices are implemented, so anything else is rejected instead of run wrong.
_HUGINN_REQUIRED_CHOICES = {
    "block_class_name": "SandwichBlock",
    "norm_class_name": "RMSNorm_llama",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "injection_type": "linear",
    "state_init": "like-init",
}

# Nanbeige's config class can switch on features the released checkpoints do not use. We do not
# implement them, so a checkpoint that enables one is rejected instead of run silently wrong.
_NANBEIGE_UNSUPPORTED_FLAGS = (
    "enable_double_loop_split",
    "enable_hyper_connection",
    "enable_mhc",
    "enable_depth_attention",
    "qk_layernorm",
    "attention_bias",
    "mlp_bias",
    "loop_share_kv",
    "skip_loop_final_norm",
)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


class ConfigError(ValueError):
    """A checkpoint's config.json or an engine argument that cannot be served."""


def parse_dtype(dtype: str | torch.dtype | None, default: str = "float32") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    name = default if dtype in (None, "auto") else str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
    return _DTYPES[name]


# vLLM's --kv-cache-dtype names. fp8 K/V is stored with a scale of 1.0 (vLLM's default when a
# checkpoint carries no calibrated k/v scales): e4m3 keeps |x| <= 448 (saturating) with 3 mantissa bits.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's storage dtype: the model dtype for `auto`, else the named 8-bit float."""
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype={name!r} is not supported; choose from {tuple(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or model_dtype


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass
class ModelConfig:
    """One looped decoder: `num_hidden_layers` shared layers applied `num_loops` times."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_loops: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    sandwich_norm: bool = False
    exit_gate: bool = False
    early_exit_threshold: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    checkpoint_dtype: str = "float32"
    # Huginn: blocks before and after the looped core (`num_hidden_layers` is the core's count),
    # the learned q/k bias, the embedding scale and the random initial state's std and scale.
    num_prelude_layers: int = 0
    num_coda_layers: int = 0
    qk_bias: bool = False
    embed_scale: float = 1.0
    init_std: float = 0.0
    init_scale: float = 1.0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def variable_depth(self) -> bool:
        """Ouro and Huginn may run any loop count per request; Nanbeige's semantics fix it."""
        return self.model_type in ("ouro", HUGINN)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def need(key: str) -> Any:
            if key not in d:
                raise ConfigError(f"{source}: missing required field {key!r} for model_type {model_type!r}")
            return d[key]

        if model_type == HUGINN:
            return cls._huginn(d, source, need)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        if d.get("rope_scaling"):
            raise ConfigError(f"{source}: rope_scaling {d['rope_scaling']!r} is not supported")
        if d.get("use_sliding_window"):
            raise ConfigError(f"{source}: sliding-window attention is not supported")
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        common = dict(
            model_type=model_type,
            hidden_size=hidden,
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_ids(d.get("eos_token_id")),
            pad_token_id=d.get("pad_token_id"),
            checkpoint_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            raw=dict(d),
        )
        if common["num_attention_heads"] % common["num_key_value_heads"]:
            raise ConfigError(f"{source}: num_attention_heads must be a multiple of num_key_value_heads")
        if model_type == "ouro":
            return cls(
                **common,
                num_loops=int(d.get("total_ut_steps", 4)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                sandwich_norm=True,
                exit_gate=True,
                early_exit_threshold=float(d.get("early_exit_threshold", 1.0)),
            )
        for flag in _NANBEIGE_UNSUPPORTED_FLAGS:
            if d.get(flag):
                raise ConfigError(f"{source}: Nanbeige option {flag}={d[flag]!r} is not supported")
        for key in ("emb_neighbor_num", "insert_ngram_layer_idx"):
            if d.get(key):
                raise ConfigError(f"{source}: Nanbeige n-gram embeddings ({key}) are not supported")
        if int(d.get("pretraining_tp", 1)) != 1:
            raise ConfigError(f"{source}: pretraining_tp != 1 is not supported")
        loop_weights = d.get("loop_loss_weights") or []
        loops = len(loop_weights) + 1 if loop_weights else int(d.get("num_loops", 1))
        return cls(**common, num_loops=loops, rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)))

    @classmethod
    def _huginn(cls, d: dict[str, Any], source: str, need: Callable[[str], Any]) -> "ModelConfig":
        """RavenConfig's names (MODELS.md §3.1): n_embd, n_heads, n_layers_in_{prelude,recurrent_block,coda},
        mean_recurrence (the default r), rope_base, block_size; `init_scale` (0 = zero state) comes
        from hf_overrides, as the official forward takes it as an argument."""
        for key, want in _HUGINN_REQUIRED_CHOICES.items():
            if d.get(key, want) != want:
                raise ConfigError(f"{source}: Huginn {key}={d[key]!r} is not supported (only {want!r})")
        if d.get("bias"):
            raise ConfigError(f"{source}: Huginn bias=true is not supported (the released model has none)")
        if d.get("test_time_noise"):
            raise ConfigError(f"{source}: Huginn test_time_noise={d['test_time_noise']!r} is not supported")
        hidden, heads = int(need("n_embd")), int(need("n_heads"))
        if hidden % heads:
            raise ConfigError(f"{source}: n_embd={hidden} is not a multiple of n_heads={heads}")
        head_dim = hidden // heads
        if d.get("head_dim") not in (None, head_dim):
            raise ConfigError(f"{source}: head_dim={d['head_dim']} disagrees with n_embd / n_heads = {head_dim}")
        if int(d.get("num_key_value_heads") or heads) != heads:
            raise ConfigError(f"{source}: Huginn is multi-head attention; num_key_value_heads must equal n_heads")
        prelude, core, coda = (int(need(f"n_layers_in_{k}")) for k in ("prelude", "recurrent_block", "coda"))
        if core < 1:
            raise ConfigError(f"{source}: n_layers_in_recurrent_block must be >= 1")
        if d.get("n_layers") not in (None, prelude + core + coda):
            raise ConfigError(f"{source}: n_layers={d['n_layers']} is not prelude + recurrent + coda layers")
        init_scale = float(d.get("init_scale", 1.0))
        if init_scale < 0:
            raise ConfigError(f"{source}: init_scale must be >= 0, got {init_scale}")
        return cls(
            model_type=HUGINN,
            hidden_size=hidden,
            num_hidden_layers=core,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=head_dim,
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(d.get("padded_vocab_size") or need("vocab_size")),
            num_loops=int(d.get("mean_recurrence", 32)),
            rope_theta=float(d.get("rope_base", 50000.0)),
            rms_norm_eps=float(d.get("norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("block_size", 4096)),
            tie_word_embeddings=bool(d.get("tie_embeddings", True)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_ids(d.get("eos_token_id")),
            pad_token_id=d.get("pad_token_id"),
            checkpoint_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            num_prelude_layers=prelude,
            num_coda_layers=coda,
            qk_bias=bool(d.get("qk_bias", True)),
            embed_scale=math.sqrt(hidden),
            # "like-init": the initial state has the std the weights were initialised with.
            init_std=float((d.get("init_values") or {}).get("std", math.sqrt(2 / (5 * hidden)))),
            init_scale=init_scale,
            raw=dict(d),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str, overrides: dict[str, Any] | None = None) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: not found (a model directory needs config.json)")
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        if overrides:
            d = {**d, **overrides}
        return cls.from_dict(d, source=path)


KV_LAYOUTS = ("separate", "last_exited", "shared")
# Huginn's own cache strategies (MODELS.md §3.3); compress-s{k} is a ring of k core block-call slots.
HUGINN_CACHES = ("full", "latest-m4", "compress-s{k}")
_COMPRESS_RE = re.compile(r"compress-s([1-9][0-9]*)")


def compress_ring(huginn_cache: str | None) -> int | None:
    """k of `compress-s{k}`, else None."""
    m = _COMPRESS_RE.fullmatch(huginn_cache or "")
    return int(m.group(1)) if m else None

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")  # availability: attention.get_attention_backend


@dataclass
class EngineConfig:
    """Serving knobs. Names follow vLLM's engine args where one exists."""

    page_size: int = 16
    num_kv_pages: int | None = None  # None: derived from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 256 << 20  # CPU pool size when num_kv_pages is None
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory the engine may use
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # token budget of one core call
    long_prefill_token_threshold: int = 256  # chunk size: longest prompt span started at once
    max_model_len: int | None = None
    max_loops: int | None = None  # depth slots reserved per core layer; default: checkpoint loops
    kv_layout: str = "separate"
    huginn_cache: str | None = None  # Huginn only: "full" (default), "latest-m4" or "compress-s{k}"
    enable_prefix_caching: bool = True
    enable_wavefront_prefill: bool = True  # WCPB: chunks of one prompt climb depths together
    enable_mixed_batching: bool = True  # decode rows and prompt rows share core calls
    swap_space_bytes: int = 1 << 30  # host memory for snapshots of preempted requests
    # Early-exit readback. async_exit: the exact policy, decisions read back one call later without
    # a blocking read (depths, states and tokens equal the synchronous policy's; a finished row may
    # run one masked loop). delayed_exit: a different policy, each Q-exit decision applied one loop
    # later (the token runs that loop for real and takes its logits from it); reads back likewise.
    async_exit: bool = False
    delayed_exit: bool = False
    num_speculative_tokens: int = 0  # self-speculation: drafts per round (0: off)
    speculative_draft_depth: int = 1  # loops a draft token runs before it is sampled
    speculative_adaptive: bool = False  # choose K (<= num_speculative_tokens) and depth online
    attention_backend: str = "auto"
    # K/V storage: "auto" (the model dtype) or fp8 ("fp8" = "fp8_e4m3", "fp8_e5m2"): half the KV
    # bytes to read per decode step and twice the tokens per pool, at 8-bit precision of K and V.
    kv_cache_dtype: str = "auto"
    # A fixed-depth decode token runs every loop in one step: no other row needs it mid-depth, and
    # a whole token is one CUDA graph replay and one host read instead of one per loop.
    fuse_decode_loops: bool = True
    enforce_eager: bool = False  # vLLM's name: never capture CUDA graphs
    # Schedule and launch step N+1 before reading step N's tokens (rlt_serve.engine.async_step):
    # the host's share of a step overlaps the device's. Outputs arrive one step later.
    async_scheduling: bool = False
    cuda_graph_sizes: list[int] | None = None  # decode batch sizes captured; None: 1, 2, 4, 8, then every 8 to max_num_seqs
    # Prompt-chunk token counts whose core loops are captured too (rows padded up to one of them);
    # None: 16, 24, 32, 48, ... up to the chunk size and 2048 tokens; []: prompts run eagerly.
    prefill_graph_sizes: list[int] | None = None
    max_logprobs: int = 20
    seed: int = 0

    def validate(self) -> None:
        if self.kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"kv_layout={self.kv_layout!r} is not supported; choose from {KV_LAYOUTS}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend={self.attention_backend!r} is not available; choose from {ATTENTION_BACKENDS}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose from {tuple(KV_CACHE_DTYPES)}"
            )
        if self.kv_layout == "shared":
            # One slot per core layer, overwritten each loop: a token reads earlier tokens at their
            # final depth. That is only well defined token by token, so prompts run one token per
            # span, and wavefront prefill (earlier chunks still mid-depth) cannot be valid.
            if self.long_prefill_token_threshold != 1:
                raise ConfigError(
                    "kv_layout='shared' needs long_prefill_token_threshold=1 (token-by-token semantics); "
                    f"got {self.long_prefill_token_threshold}"
                )
            if self.enable_wavefront_prefill:
                raise ConfigError("kv_layout='shared' cannot be combined with enable_wavefront_prefill=True")
        if self.huginn_cache is not None:
            self._validate_huginn_cache()
        if self.long_prefill_token_threshold > self.max_num_batched_tokens:
            raise ConfigError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} exceeds "
                f"max_num_batched_tokens={self.max_num_batched_tokens}: a chunk must fit one core call"
            )
        if self.async_exit and self.delayed_exit:
            raise ConfigError("async_exit and delayed_exit are two exit policies; choose one (delayed_exit "
                              "already reads its decisions back asynchronously)")
        if self.num_speculative_tokens < 0:
            raise ConfigError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.num_speculative_tokens and self.speculative_draft_depth < 1:
            raise ConfigError(f"speculative_draft_depth must be >= 1, got {self.speculative_draft_depth}")
        if self.num_speculative_tokens > self.max_num_batched_tokens:
            raise ConfigError("num_speculative_tokens must fit one core call (max_num_batched_tokens)")
        if self.swap_space_bytes < 0:
            raise ConfigError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cuda_graph_sizes is not None and (
            not self.cuda_graph_sizes or any(not isinstance(b, int) or b < 1 for b in self.cuda_graph_sizes)
        ):
            raise ConfigError(f"cuda_graph_sizes must be a non-empty list of positive ints, got {self.cuda_graph_sizes}")
        if self.prefill_graph_sizes is not None and any(
            not isinstance(q, int) or q < 1 for q in self.prefill_graph_sizes
        ):
            raise ConfigError(f"prefill_graph_sizes must be positive ints (or [] for none), got {self.prefill_graph_sizes}")
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            raise ConfigError(f"num_kv_pages must be >= 1, got {self.num_kv_pages}")

    def _validate_huginn_cache(self) -> None:
        name = self.huginn_cache
        if name not in ("full", "latest-m4") and compress_ring(name) is None:
            raise ConfigError(f"huginn_cache={name!r} is not supported; choose from {HUGINN_CACHES}")
        if self.kv_layout != "separate":
            raise ConfigError(
                f"huginn_cache={name!r} replaces kv_layout for Huginn; leave kv_layout='separate' "
                f"(got {self.kv_layout!r})"
            )
        if compress_ring(name) is not None:
            # Like kv_layout='shared': a ring slot is overwritten by later steps, so which step of an
            # earlier token a query reads is only well defined token by token.
            if self.long_prefill_token_threshold != 1:
                raise ConfigError(
                    f"huginn_cache={name!r} needs long_prefill_token_threshold=1 (token-by-token semantics); "
                    f"got {self.long_prefill_token_threshold}"
                )
            if self.enable_wavefront_prefill:
                raise ConfigError(f"huginn_cache={name!r} cannot be combined with enable_wavefront_prefill=True")


def check_model_engine(model: ModelConfig, engine: EngineConfig) -> None:
    """Combinations that depend on the checkpoint: Huginn's cache strategies apply to Huginn only,
    and a compress ring must hold whole recurrence steps (k a multiple of the core's layers)."""
    if model.model_type != HUGINN:
        if engine.huginn_cache is not None:
            raise ConfigError(f"huginn_cache is a Huginn option; {model.model_type} uses kv_layout")
        return
    if engine.kv_layout != "separate":
        raise ConfigError(
            f"kv_layout={engine.kv_layout!r}: Huginn's KV strategies are chosen with huginn_cache "
            f"(one of {HUGINN_CACHES})"
        )
    k, r = compress_ring(engine.huginn_cache), model.num_hidden_layers
    if k is not None and k % r:
        # Official compress-s{k} hashes block call 4s+j to slot (4s+j) % k; unless k is a multiple
        # of the core's r layers that mixes different layers' K/V in one slot.
        raise ConfigError(
            f"huginn_cache={engine.huginn_cache!r}: k must be a multiple of the {r} recurrent layers "
            "(otherwise one ring slot would hold K/V of different layers)"
        )


def core_ring_slots(model: ModelConfig, engine: EngineConfig) -> int | None:
    """Depth slots per core layer when they form a ring (a core row at depth d uses slot d % ring);
    None when every depth has its own slot."""
    if engine.kv_layout == "shared":
        return 1
    k = compress_ring(engine.huginn_cache)
    return None if k is None else k // model.num_hidden_layers
