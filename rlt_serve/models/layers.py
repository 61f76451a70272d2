"""Building blocks shared by the model families (norms, RoPE, MLP, paged attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlt_serve.attention.backend import AttentionBackend, AttentionMetadata
from rlt_serve.engine.kv_cache import KVCache


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back, then scale: the order the official code uses."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class RotaryEmbedding:
    """Rotate-half RoPE; inv_freq over head_dim and cos/sin in fp32, then cast to the model dtype."""

    def __init__(self, head_dim: int, theta: float) -> None:
        # Built on the CPU explicitly: models are constructed under the meta device.
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self.inv_freq = 1.0 / (theta**exponent)
        self._on_device: dict[torch.device, torch.Tensor] = {}  # no host copy per call (CUDA graphs)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._on_device.get(positions.device)
        if inv is None:
            inv = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PagedAttention(nn.Module):
    """q/k/v/o projections around the backend; the KV plane comes from the row's depth slot."""

    def __init__(self, layer: int, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], ctx: "CoreContext") -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.heads, self.head_dim)
        k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        cos, sin = cos_sin
        q = RotaryEmbedding.apply(q, cos, sin)
        k = RotaryEmbedding.apply(k, cos, sin)
        o = ctx.backend.forward(q, k, v, ctx.kv, self.layer, ctx.meta, self.scale)
        return self.o_proj(o.reshape(t, self.heads * self.head_dim))


class CoreContext:
    """Explicit per-call attention state handed down the layer stack (no globals)."""

    __slots__ = ("backend", "kv", "meta")

    def __init__(self, backend: AttentionBackend, kv: KVCache, meta: AttentionMetadata) -> None:
        self.backend, self.kv, self.meta = backend, kv, meta
