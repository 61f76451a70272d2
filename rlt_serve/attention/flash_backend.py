"""FlashAttention backend: one varlen FlashAttention call per layer for every row of a core call.

Planes become ordinary pages: K/V viewed as `[num_planes * num_pages, page_size, kv_heads,
head_dim]` make page p of plane P the page `P * num_pages + p`, so a row at depth slot s of a
layer with base b reads through its own page table shifted by `(b + s) * num_pages`. Rows at
different depths then share one call, and the kernel never learns about depth.

Two kernels, picked once at construction:
- the `flash-attn` package (`flash_attn_varlen_func`), reading the paged planes in place through
  `block_table` when the page size is a multiple of 256 (the package's FA2 paged-KV constraint);
- otherwise torch's own FlashAttention (`torch.nn.attention.varlen.varlen_attn`), or the package
  with a small page size, over K/V gathered contiguously per row for the call. The gather
  copies each row's context once per layer: fine for prefill, bandwidth-heavy for long decode,
  which is why `auto` prefers the Triton backend (see `backend.get_attention_backend`).
FlashAttention's causal mask is aligned bottom-right (the last query sees every key), which is
exactly "cached prefix plus the span itself, causal". It runs fp16/bf16 only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlt_serve.attention.backend import AttentionBackend, AttentionMetadata
from rlt_serve.engine.kv_cache import KVCache

PAGED_PAGE_MULTIPLE = 256  # flash-attn 2's paged-KV kernels need page_size % 256 == 0


def _flash_attn_func() -> Callable[..., torch.Tensor] | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _torch_varlen_func() -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def available(device: torch.device, dtype: torch.dtype | None) -> str | None:
    """None when the backend can run here, else what is missing."""
    if device.type != "cuda":
        return "FlashAttention needs a CUDA device"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention runs float16/bfloat16 only, not {dtype}"
    if _flash_attn_func() is None and _torch_varlen_func() is None:
        return "neither the 'flash-attn' package nor torch.nn.attention.varlen is installed"
    return None


@dataclass
class FlashCallData:
    """Per-call tensors shared by every layer."""

    cu_q: torch.Tensor  # [R+1] int32
    cu_k: torch.Tensor  # [R+1] int32 (context lengths = end positions)
    max_q: int
    max_k: int
    index: torch.Tensor  # paged: [R, max_pages] int32 page ids + slot * num_pages; else [sum end] int64 flat rows
    write_index: torch.Tensor  # [T] int64 flat row (depth_slot * pages * page_size + slot) of each token
    write_mask: torch.Tensor | None  # [T, 1, 1] bool


class FlashAttentionBackend(AttentionBackend):
    name = "flash-attn"

    def __init__(
        self, page_size: int, kernel: Callable[..., torch.Tensor] | None = None, paged: bool | None = None
    ) -> None:
        """`kernel` (tests): a function with `flash_attn_varlen_func`'s signature to use instead."""
        fa = kernel or _flash_attn_func()
        self.paged = paged if paged is not None else fa is not None and page_size % PAGED_PAGE_MULTIPLE == 0
        if fa is not None:
            self.kernel = "flash_attn (paged)" if self.paged else "flash_attn (gathered)"
            self._call = self._call_flash_attn(fa)
        else:
            self.kernel = "torch varlen_attn (gathered)"
            self._call = self._call_torch_varlen(_torch_varlen_func())

    # -- kernels --------------------------------------------------------------------------
    def _call_flash_attn(self, fa: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(q, k, v, d: FlashCallData, scale: float, table: torch.Tensor | None) -> torch.Tensor:
            extra = {"block_table": table} if table is not None else {}
            return fa(q, k, v, d.cu_q, d.cu_k, d.max_q, d.max_k, softmax_scale=scale, causal=True, **extra)

        return call

    def _call_torch_varlen(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        params = inspect.signature(fn).parameters
        causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        has_scale, has_gqa = "scale" in params, "enable_gqa" in params

        def call(q, k, v, d: FlashCallData, scale: float, table: torch.Tensor | None) -> torch.Tensor:
            kwargs: dict[str, Any] = dict(causal)
            if has_scale:
                kwargs["scale"] = scale
            elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
                q = q * (scale * q.shape[-1] ** 0.5)
            if q.shape[1] != k.shape[1]:
                if has_gqa:
                    kwargs["enable_gqa"] = True
                else:
                    group = q.shape[1] // k.shape[1]
                    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return fn(q, k, v, d.cu_q, d.cu_k, d.max_q, d.max_k, **kwargs)

        return call

    # -- interface ------------------------------------------------------------------------
    def prepare_extra(self, meta: AttentionMetadata, kv: KVCache) -> FlashCallData:
        rows, ps, n = meta.rows, kv.page_size, kv.num_pages
        cu_q, cu_k = [0], [0]
        for row in rows:
            cu_q.append(cu_q[-1] + row.num_query)
            cu_k.append(cu_k[-1] + row.end_pos)
        dev = kv.device
        if self.paged:
            width = max(len(r.page_ids) for r in rows)
            index = torch.tensor(
                [[p + r.depth_slot * n for p in r.page_ids] + [0] * (width - len(r.page_ids)) for r in rows],
                dtype=torch.int32,
            ).to(dev)
        else:
            flat = []
            for r in rows:
                pages = torch.tensor(r.page_ids, dtype=torch.long)
                pos = torch.arange(r.end_pos)
                flat.append(r.depth_slot * n * ps + pages[pos // ps] * ps + pos % ps)
            index = torch.cat(flat).to(dev)
        mask = meta.write_mask
        return FlashCallData(
            cu_q=torch.tensor(cu_q, dtype=torch.int32).to(dev),
            cu_k=torch.tensor(cu_k, dtype=torch.int32).to(dev),
            max_q=max(r.num_query for r in rows),
            max_k=max(r.end_pos for r in rows),
            index=index,
            write_index=meta.token_depth_slot * (n * ps) + meta.slot_mapping,
            write_mask=mask.to(dev).view(-1, 1, 1) if mask is not None else None,
        )

    def forward(self, q, k, v, kv, layer, meta, scale, kv_written=False):
        assert not kv_written, "this backend writes K/V itself (kv_write_target is None)"
        d: FlashCallData = meta.extra
        num_planes, n, ps, kv_heads, head_dim = kv.k.shape
        plane_rows = n * ps
        k_all = kv.k.view(num_planes * plane_rows, kv_heads, head_dim)
        v_all = kv.v.view(num_planes * plane_rows, kv_heads, head_dim)
        base = kv.plane_base(layer)
        write_kv(k_all, v_all, k, v, d.write_index + base * plane_rows, d.write_mask)
        if self.paged:
            table = d.index + base * n
            k_src = kv.k.view(num_planes * n, ps, kv_heads, head_dim)
            v_src = kv.v.view(num_planes * n, ps, kv_heads, head_dim)
            return self._call(q, k_src, v_src, d, scale, table)
        index = d.index + base * plane_rows
        return self._call(q, k_all.index_select(0, index), v_all.index_select(0, index), d, scale, None)


def write_kv(
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    mask: torch.Tensor | None,
) -> None:
    """Write new K/V rows at `index`. Masked-out tokens write back what the cache holds, so the
    mask costs a read instead of the host synchronisation a boolean index would."""
    k, v = k.to(k_all.dtype), v.to(v_all.dtype)
    if mask is not None:
        k = torch.where(mask, k, k_all.index_select(0, index))
        v = torch.where(mask, v, v_all.index_select(0, index))
    k_all.index_copy_(0, index, k)
    v_all.index_copy_(0, index, v)
