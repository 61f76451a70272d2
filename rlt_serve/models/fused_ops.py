"""Fused elementwise ops of the decoder layers: Triton kernels on CUDA, the same math in torch elsewhere.

In eager torch an Ouro layer is about 55 kernels, 40 of them elementwise (an fp32 RMSNorm is
eight, RoPE six per tensor): thousands of tiny launches per decoded token, and in prefill a full
pass over the activations each. Here a norm with its residual add and the next norm is one pass,
RoPE of q and k one launch, SiLU-and-multiply one. Each kernel rounds to the model dtype where the
torch code does (after the fp32 normalisation, after each product and each sum), so it equals the
torch path up to float reduction order. `RLT_FUSED_KERNELS=0` selects the torch path on CUDA too.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from rlt_serve.triton_jit import EXACT_ROUNDING, device_function, jit, next_pow2, pdl, triton_missing

triton: Any = None  # bound on first launch by rlt_serve.triton_jit.jit
tl: Any = None


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and os.environ.get("RLT_FUSED_KERNELS", "1") != "0" and triton_missing() is None


# -- RMSNorm with residual --------------------------------------------------------------------
def _add_norm_kernel(
    x_ptr, res_ptr, h_ptr, y_ptr, w_pre, w_post, n_cols, eps_pre, eps_post,
    stride_x, stride_r, stride_h, stride_y,
    HAS_PRE: tl.constexpr, HAS_RES: tl.constexpr, HAS_POST: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One row: t = pre(x) or x; h = res + t (stored); y = post(h) (stored). A norm is fp32
    normalise, round to the dtype, then scale by the weight and round again. With PDL the norm
    weights load before waiting for the kernels that wrote x and res."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if HAS_PRE:
        w_1 = tl.load(w_pre + cols, mask=mask, other=0.0)
    if HAS_POST:
        w_2 = tl.load(w_post + cols, mask=mask, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dt = x.dtype
    if HAS_PRE:
        xf = x.to(tl.float32)
        y = (xf * tl.math.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps_pre)).to(dt)
        x = (w_1.to(tl.float32) * y.to(tl.float32)).to(dt)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(dt)
        tl.store(h_ptr + row * stride_h + cols, x, mask=mask)
    if HAS_POST:
        xf = x.to(tl.float32)
        y = (xf * tl.math.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps_post)).to(dt)
        tl.store(y_ptr + row * stride_y + cols, (w_2.to(tl.float32) * y.to(tl.float32)).to(dt), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _add_norm_triton(x, residual, pre, post):  # fmt: skip
    x = _rows(x)
    n, cols = x.shape
    h = torch.empty_like(x) if residual is not None else x
    y = torch.empty_like(x) if post is not None else x
    res = _rows(residual) if residual is not None else x
    jit(_add_norm_kernel)[(n,)](
        x, res, h, y,
        pre.weight if pre is not None else x, post.weight if post is not None else x,
        cols, pre.eps if pre is not None else 0.0, post.eps if post is not None else 0.0,
        x.stride(0), res.stride(0), h.stride(0), y.stride(0),
        HAS_PRE=pre is not None, HAS_RES=residual is not None, HAS_POST=post is not None,
        BLOCK=next_pow2(cols), num_warps=4 if cols <= 4096 else 8, **pdl(x), **EXACT_ROUNDING,
    )  # fmt: skip
    return h, y


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, cast back, then scale: the order the official code uses."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not use_triton(x) or x.dim() != 2:
        return rms_norm_torch(x, weight, eps)
    norm = _Norm(weight, eps)
    return _add_norm_triton(x, None, None, norm)[1]


class _Norm:
    __slots__ = ("weight", "eps")

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, pre: Any | None, post: Any | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h, y): h = residual + (pre(x) if pre else x); y = post(h), or None without `post`.

    `pre`/`post` are RMSNorm modules (their `weight` and `eps`)."""
    if use_triton(x) and x.dim() == 2:
        return _add_norm_triton(x, residual, pre, post)
    t = rms_norm_torch(x, pre.weight, pre.eps) if pre is not None else x
    h = residual + t
    return h, (rms_norm_torch(h, post.weight, post.eps) if post is not None else None)


class PendingNorm(NamedTuple):
    """post(residual + pre(x)) not yet computed: h = residual + pre(x) (x itself without a residual)
    is the next residual stream and y = post(h) the next projection's input. `pre` needs a
    residual; norms are RMSNorm modules (`weight`, `eps`). Deferred so that a sublayer's output
    norm, the residual add and the next sublayer's input norm run as one add_rms_norm launch,
    across layer boundaries too."""

    x: torch.Tensor
    residual: torch.Tensor | None
    pre: Any | None
    post: Any

    def resolve(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.residual is None:
            return self.x, rms_norm(self.x, self.post.weight, self.post.eps)
        h, y = add_rms_norm(self.x, self.residual, self.pre, self.post)
        assert y is not None
        return h, y


# -- RoPE (rotate-half) on q and k in one launch ------------------------------------------------
@device_function
def rope_pair(x1, x2, c1, c2, s1, s2, dt: tl.constexpr):
    """Both halves of rotate-half RoPE from fp32 values (x holding dtype values): x1*c1 - x2*s1
    and x2*c2 + x1*s2, each product and the sum rounded to `dt` as the official code rounds."""
    y1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    y2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    return y1, y2


def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, n_q_heads, n_k_heads, q_blocks,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    HALF: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (token, block of `HEADS` heads of q, then of k): x*cos + rotate_half(x)*sin in
    place, rounding each product and the sum. A block of heads per program loads cos/sin once
    and keeps prompts from launching a one-warp program per 128 values (8x slower at 2048 tokens)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    hs = tl.arange(0, HEADS)
    if blk < q_blocks:
        h = blk * HEADS + hs
        rows = q_ptr + t * stride_qt + h.to(tl.int64)[:, None] * stride_qh
        hm = h < n_q_heads
    else:
        h = (blk - q_blocks) * HEADS + hs
        rows = k_ptr + t * stride_kt + h.to(tl.int64)[:, None] * stride_kh
        hm = h < n_k_heads
    d = tl.arange(0, BLOCK)
    dm = d < HALF
    m = hm[:, None] & dm[None, :]
    x1 = tl.load(rows + d[None, :], mask=m, other=0.0)
    x2 = tl.load(rows + HALF + d[None, :], mask=m, other=0.0)
    dt = x1.dtype
    c1 = tl.load(cos_ptr + t * stride_c + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_c + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_c + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_c + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    y1, y2 = rope_pair(x1.to(tl.float32), x2.to(tl.float32), c1, c2, s1, s2, dt)
    tl.store(rows + d[None, :], y1, mask=m)
    tl.store(rows + HALF + d[None, :], y2, mask=m)


ROPE_TILE = 1024  # (heads x half-dim) values a RoPE program rotates; a power of two
ROPE_WARPS = 4  # at most; a warp per 256 values
ROPE_MIN_PROGRAMS = 128  # fewer tokens than fill this many programs take fewer heads a program


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hk, D] by cos/sin [T, 1, D]; in place on CUDA."""
    if not use_triton(q) or q.stride(-1) != 1 or k.stride(-1) != 1:
        return rope_torch(q, cos, sin), rope_torch(k, cos, sin)
    return _rope_triton(q, k, cos, sin)


def _rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t, heads, dim = q.shape
    k_heads = k.shape[1]
    cos2, sin2 = cos.reshape(t, dim), sin.reshape(t, dim)
    block = next_pow2(dim // 2)
    hb = min(next_pow2(max(heads, k_heads)), max(1, ROPE_TILE // block))
    while hb > 1 and t * (-(-heads // hb) + -(-k_heads // hb)) < ROPE_MIN_PROGRAMS:
        hb //= 2  # few tokens (decode): more, smaller programs
    q_blocks = -(-heads // hb)
    if t:
        jit(_rope_kernel)[(t, q_blocks + -(-k_heads // hb))](
            q, k, cos2, sin2, heads, k_heads, q_blocks,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos2.stride(0),
            HALF=dim // 2, BLOCK=block, HEADS=hb, num_warps=max(1, min(ROPE_WARPS, hb * block // 256)),
            **pdl(q), **EXACT_ROUNDING,
        )  # fmt: skip
    return q, k


# -- SiLU(gate) * up ----------------------------------------------------------------------------
def _silu_mul_kernel(gu_ptr, out_ptr, n, stride_gu, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * stride_out + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a fused [T, 2I] projection (rows: gate | up) -> [T, I]."""
    n = gate_up.shape[-1] // 2
    if not use_triton(gate_up) or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        gate, up = gate_up.split(n, dim=-1)
        return F.silu(gate) * up
    return _silu_mul_triton(gate_up)


def _silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    n = gate_up.shape[-1] // 2
    t = gate_up.shape[0]
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_pow2(n))
    if t:
        jit(_silu_mul_kernel)[(t, -(-n // block))](
            gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4, **pdl(gate_up),
            **EXACT_ROUNDING,
        )
    return out
