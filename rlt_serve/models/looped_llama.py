"""The looped Llama-style decoder that Ouro and Nanbeige4.2 share.

Both apply `num_hidden_layers` shared layers `num_loops` times, with `model.norm` after every
loop feeding the next; they differ only in Ouro's sandwich norms and exit gate. Expressed as
stages: prelude (embedding, once per token), core (one loop of the layer stack at each row's
own depth) and coda (lm_head, once per exit).
"""

from __future__ import annotations

import torch
from torch import nn

from rlt_serve.config import ModelConfig
from rlt_serve.models.base import CoreOutput, LoopedModel, PreludeOutput
from rlt_serve.models.fused_ops import PendingNorm
from rlt_serve.models.layers import CoreContext, PagedAttention, RMSNorm, RotaryEmbedding, SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = PagedAttention(layer, h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.mlp = SwiGLU(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:  # Ouro: a second norm on each sublayer's output before the residual add
            self.input_layernorm_2 = RMSNorm(h, eps)
            self.post_attention_layernorm_2 = RMSNorm(h, eps)

    def forward(
        self, x: PendingNorm, cos_sin: tuple[torch.Tensor, torch.Tensor], ctx: CoreContext, next_norm: RMSNorm
    ) -> PendingNorm:
        """The layer's input and output are pending norms (residual stream, sublayer output and the
        norms between them), so each add and the norms around it run in one launch."""
        h, a = self.self_attn(x, cos_sin, ctx)
        pre = self.input_layernorm_2 if self.sandwich else None
        h, m = self.mlp(PendingNorm(a, h, pre, self.post_attention_layernorm))
        return PendingNorm(m, h, self.post_attention_layernorm_2 if self.sandwich else None, next_norm)


class LoopedBody(nn.Module):
    """Module tree named like the checkpoints (`model.*`) so keys load as they are."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.exit_gate:
            self.early_exit_gate = nn.Linear(cfg.hidden_size, 1, bias=True)


class LoopedLlamaForCausalLM(LoopedModel):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.model = LoopedBody(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def fuse_weights(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def kv_slots_per_layer(self, max_loops: int) -> list[int]:
        """Depth slots of each attention layer: every shared layer keeps one per loop."""
        return [max_loops] * self.config.num_hidden_layers

    def prelude(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx: CoreContext | None) -> PreludeOutput:
        return PreludeOutput(self.model.embed_tokens(token_ids))

    def core(
        self, hidden: torch.Tensor, injected: torch.Tensor | None, positions: torch.Tensor, ctx: CoreContext
    ) -> CoreOutput:
        cos_sin = self.rotary.cos_sin(positions, hidden.dtype)
        layers = self.model.layers
        x = PendingNorm(hidden, None, None, layers[0].input_layernorm)
        for i, layer in enumerate(layers):  # the last layer's next norm is the per-loop model.norm
            x = layer(x, cos_sin, ctx, layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm)
        h = x.resolve()[1]
        gate = None
        if self.config.exit_gate:
            gate = self.model.early_exit_gate(h).squeeze(-1).float()
        return CoreOutput(h, gate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()
