"""Building blocks shared by the model families (norms, RoPE, MLP, paged attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlt_serve.attention.backend import AttentionBackend, AttentionMetadata
from rlt_serve.engine.kv_cache import KVCache
from rlt_serve.models import fused_ops, gemv
from rlt_serve.models.fused_ops import PendingNorm


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back, then scale: the order the official code uses."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.rms_norm(x, self.weight, self.eps)


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

    apply = staticmethod(fused_ops.rope_torch)


def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """One weight for several bias-free projections of the same input (one matmul launch instead
    of several); the modules keep views into it, so nothing is stored twice."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    offset = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[offset : offset + n], requires_grad=False)
        offset += n
    return fused


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up: torch.Tensor | None = None  # set by fuse()

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: PendingNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, MLP output) of a pending norm's input; see PendingNorm."""
        h, y = x.resolve()
        if self.gate_up is None:
            return h, self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
        return h, gemv.linear(gemv.gate_up_silu(y, self.gate_up), self.down_proj.weight)


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
        self.qkv: torch.Tensor | None = None  # set by fuse()

    def fuse(self) -> None:
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self, x: PendingNorm, cos_sin: tuple[torch.Tensor, torch.Tensor], ctx: "CoreContext"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, attention output) of a pending norm's input; see PendingNorm."""
        t = x.x.shape[0]
        done, target = False, None
        h, y = x.resolve()
        if self.qkv is None:
            q, k, v = self.q_proj(y), self.k_proj(y), self.v_proj(y)
        else:
            nq, nkv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            if gemv.qkv_epilogue() and gemv.use_gemv(y, self.qkv):
                target = ctx.backend.kv_write_target(ctx.kv, self.layer, ctx.meta)
                cos, sin = (c.reshape(t, self.head_dim) for c in cos_sin)
                epilogue = gemv.QKVEpilogue(cos, sin, self.heads, self.kv_heads, self.head_dim, target)
                qkv, done = gemv.qkv_rope(y, self.qkv, epilogue)  # done: rotated and K/V written
            else:
                qkv = gemv.linear(y, self.qkv)
            q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        q = q.view(t, self.heads, self.head_dim)
        k = k.view(t, self.kv_heads, self.head_dim)
        v = v.view(t, self.kv_heads, self.head_dim)
        if not done:
            q, k = fused_ops.rope(q, k, *cos_sin)
        if not ctx.backend.strided_qkv:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        kv_written = done and target is not None
        o = ctx.backend.forward(q, k, v, ctx.kv, self.layer, ctx.meta, self.scale, kv_written=kv_written)
        return h, gemv.linear(o.reshape(t, self.heads * self.head_dim), self.o_proj.weight)


class CoreContext:
    """Explicit per-call attention state handed down the layer stack (no globals)."""

    __slots__ = ("backend", "kv", "meta")

    def __init__(self, backend: AttentionBackend, kv: KVCache, meta: AttentionMetadata) -> None:
        self.backend, self.kv, self.meta = backend, kv, meta
