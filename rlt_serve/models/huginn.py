"""Huginn-0125 (RavenForCausalLM) as stages over the shared row mechanism.

prelude: scaled embedding, then the prelude sandwich blocks (once per token); its output is both
the re-injected input `e` and, through `initial_state`, the source of the random initial state.
core: `adapter(cat[state, e])` then the recurrent sandwich blocks, once per depth (MODELS.md §3.2);
it returns the raw state, which is what the next step and the latent exit criteria read.
coda: `ln_f`, the coda blocks, `ln_f` again (the official "ln_f used twice"), once per exit.
KV layer indices are prelude, core, coda in that order; only core layers have a slot per depth.
The module tree is named like the official state dict, so a checkpoint loads as it is; its
`freqs_cis` buffer and stored tied `lm_head.weight` are left unused (RoPE is recomputed in fp32).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlt_serve.config import ModelConfig
from rlt_serve.host_copy import to_device
from rlt_serve.models import gemv
from rlt_serve.models.base import CoreOutput, LoopedModel, PreludeOutput
from rlt_serve.models.layers import CoreContext, RMSNorm

_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, position: int) -> int:
    """A generator seed for one token's initial state: splitmix64 of (request seed, position), so
    a token's noise is fixed by who it is, not by when or with whom it is computed."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class InterleavedRotary:
    """RoPE on (x[2i], x[2i+1]) pairs with fp32 angles, as the official `freqs_cis` table holds them."""

    def __init__(self, head_dim: int, base: float) -> None:
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        self.inv_freq = 1.0 / (base**exponent)
        self._on_device: dict[torch.device, torch.Tensor] = {}  # no host copy per call (CUDA graphs)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._on_device.get(positions.device)
        if inv is None:
            inv = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        angles = positions.float()[:, None] * inv[None, :]
        return angles.cos()[:, None, :], angles.sin()[:, None, :]  # [T, 1, head_dim / 2] fp32

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        pairs = x.float().unflatten(-1, (-1, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        return torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2).to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Fused q|k|v projection, learned q/k bias added before RoPE, paged attention, output proj."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.layer, self.heads, self.head_dim = layer, cfg.num_attention_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.Wqkv = nn.Linear(h, 3 * h, bias=False)
        if cfg.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.heads, self.head_dim))
        self.proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: CoreContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = gemv.linear(x, self.Wqkv.weight).view(t, 3, self.heads, self.head_dim).unbind(1)
        if hasattr(self, "qk_bias"):
            q, k = q + self.qk_bias[0, 0], k + self.qk_bias[1, 0]
        q, k = InterleavedRotary.apply(q, *rope), InterleavedRotary.apply(k, *rope)
        o = ctx.backend.forward(q, k, v.contiguous(), ctx.kv, self.layer, ctx.meta, self.scale)
        return gemv.linear(o.reshape(t, self.heads * self.head_dim), self.proj.weight)


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # rows: gate | up
        self.proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # rows: gate | up, as gemv.gate_up_silu takes them
            return gemv.linear(gemv.gate_up_silu(x, self.fc.weight), self.proj.weight)
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class SandwichBlock(nn.Module):
    """Post-norm on each residual sum: x = norm_2(attn(norm_1 x) + x); x = norm_4(mlp(norm_3 x) + x)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_1, self.norm_2 = RMSNorm(h, eps), RMSNorm(h, eps)
        self.attn = CausalSelfAttention(cfg, layer)
        self.norm_3, self.norm_4 = RMSNorm(h, eps), RMSNorm(h, eps)
        self.mlp = GatedMLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: CoreContext) -> torch.Tensor:
        x = self.norm_2(self.attn(self.norm_1(x), rope, ctx) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)


class HuginnForCausalLM(LoopedModel):
    # Official stops (`_get_stops`): <|begin_text|> 65504, <|end_text|> 65505, <|end_turn|> 65508.
    extra_stop_tokens = ("<|begin_text|>", "<|end_text|>", "<|end_turn|>")
    prelude_attention = True
    coda_attention = True
    injects_prelude = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        p, r = cfg.num_prelude_layers, cfg.num_hidden_layers
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                prelude=nn.ModuleList(SandwichBlock(cfg, i) for i in range(p)),
                adapter=nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False),  # input: [state, e]
                core_block=nn.ModuleList(SandwichBlock(cfg, p + j) for j in range(r)),
                coda=nn.ModuleList(SandwichBlock(cfg, p + r + c) for c in range(cfg.num_coda_layers)),
                ln_f=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            )
        )
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = InterleavedRotary(cfg.head_dim, cfg.rope_theta)

    def kv_slots_per_layer(self, max_loops: int) -> list[int]:
        cfg = self.config
        return [1] * cfg.num_prelude_layers + [max_loops] * cfg.num_hidden_layers + [1] * cfg.num_coda_layers

    def prelude(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx: CoreContext | None) -> PreludeOutput:
        tr = self.transformer
        e = tr.wte(token_ids) * self.config.embed_scale
        rope = self.rotary.cos_sin(positions)
        for block in tr.prelude:
            e = block(e, rope, ctx)
        return PreludeOutput(hidden=torch.zeros_like(e), injected=e)

    def initial_state(self, pre: PreludeOutput, seeds: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Truncated normal at ±3σ, σ = init_std·init_scale, times the embedding scale ("like-init");
        each token's draw comes from a generator seeded by (request seed, position)."""
        cfg = self.config
        std = cfg.init_std * cfg.init_scale
        if std == 0.0:
            return pre.hidden
        rows = torch.empty(len(seeds), cfg.hidden_size, dtype=torch.float32)
        for i, (seed, pos) in enumerate(zip(seeds, positions.tolist())):
            gen = torch.Generator().manual_seed(noise_seed(seed, pos))
            nn.init.trunc_normal_(rows[i], 0.0, std, -3 * std, 3 * std, generator=gen)
        return to_device(rows * cfg.embed_scale, pre.hidden.dtype, pre.hidden.device)  # no host wait

    def prepare_sequence(self, seq: Any) -> None:
        if self.config.init_scale > 0:  # prefix pages hold K/V of this request's own random states
            seq.cache_salt = f"|huginn-seed={seq.generator.initial_seed()}".encode()
        if seq.params.exit_criterion is not None:
            seq.exit_depths = []

    def core(
        self, hidden: torch.Tensor, injected: torch.Tensor | None, positions: torch.Tensor, ctx: CoreContext
    ) -> CoreOutput:
        tr = self.transformer
        rope = self.rotary.cos_sin(positions)
        x = gemv.linear(torch.cat([hidden, injected], dim=-1), tr.adapter.weight)
        for block in tr.core_block:
            x = block(x, rope, ctx)
        return CoreOutput(x)

    def coda(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: CoreContext | None) -> torch.Tensor:
        tr = self.transformer
        rope = self.rotary.cos_sin(positions)
        x = tr.ln_f(hidden)
        for block in tr.coda:
            x = block(x, rope, ctx)
        return tr.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
