"""The one small interface every attention backend implements.

A core call is a varlen batch of rows, each at its own depth. The backend gets, per row, how many
query tokens it has, where they start, which depth slot it reads and writes, and the request's
page table; per layer it writes the new K/V into plane `base(layer) + depth_slot` and attends
the row's queries to that plane's prefix plus themselves (causal). Rows at different depths
share one call: only the plane index differs.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from rlt_serve.config import ConfigError
from rlt_serve.engine.kv_cache import KVCache
from rlt_serve.host_copy import to_device


@dataclass(frozen=True)
class RowSpec:
    """What attention needs to know of one row of a core call."""

    num_query: int
    start_pos: int
    depth_slot: int
    page_ids: list[int]

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_query


@dataclass
class AttentionMetadata:
    """Per-call tensors shared by every layer; `extra` holds backend-specific data."""

    rows: list[RowSpec]
    query_start: list[int]
    slot_mapping: torch.Tensor  # [T] flat (page * page_size + offset) of each query token
    token_depth_slot: torch.Tensor  # [T] depth slot of each query token
    # [T] bool or None: tokens whose K/V is written. An early-exited token still riding in its
    # span must not overwrite the exit-depth K/V that `last_exited` copied into deeper slots.
    write_mask: torch.Tensor | None = None
    extra: Any = None


class KVWriteTarget(NamedTuple):
    """Where a fused producer of K/V (the qkv GEMV's epilogue) writes a layer's new tokens: the
    plane layout of the Triton backend's own write (flat [planes, slots, kv_heads, head_dim])."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T]
    depth_slot: torch.Tensor  # [T]
    write_mask: torch.Tensor | None  # [T] int8, or None: every token writes
    plane_base: int


class AttentionBackend(ABC):
    name: str = "abstract"
    reason: str = ""  # why get_attention_backend chose it (reported by the bench and recipes)
    strided_qkv: bool = False  # takes q/k/v as strided views of one fused projection (no copies)

    def prepare(self, rows: list[RowSpec], kv: KVCache, write_mask: torch.Tensor | None = None) -> AttentionMetadata:
        """Build the tensors every layer of one core call reuses."""
        ps = kv.page_size
        slots: list[int] = []
        depth: list[int] = []
        starts: list[int] = []
        t = 0
        for row in rows:
            starts.append(t)
            t += row.num_query
            for pos in range(row.start_pos, row.end_pos):
                slots.append(row.page_ids[pos // ps] * ps + pos % ps)
            depth.extend([row.depth_slot] * row.num_query)
        dev = kv.device
        meta = AttentionMetadata(
            rows=rows,
            query_start=starts,
            slot_mapping=to_device(slots, torch.long, dev),
            token_depth_slot=to_device(depth, torch.long, dev),
            write_mask=write_mask,
        )
        meta.extra = self.prepare_extra(meta, kv)
        return meta

    def prepare_extra(self, meta: AttentionMetadata, kv: KVCache) -> Any:
        return None

    def kv_write_target(self, kv: KVCache, layer: int, meta: AttentionMetadata) -> KVWriteTarget | None:
        """Where another kernel may write this layer's K/V before `forward(..., kv_written=True)`;
        None: this backend writes K/V itself."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,
        kv: KVCache,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,  # K/V already in the cache (only where kv_write_target is not None)
    ) -> torch.Tensor:  # [T, heads, head_dim]
        ...


def _missing(
    name: str, device: torch.device, dtype: torch.dtype | None, kv_dtype: torch.dtype | None = None
) -> str | None:
    """None when backend `name` can run for this device, dtype and KV storage dtype, else what is missing."""
    fp8 = kv_dtype is not None and kv_dtype.itemsize == 1
    if name == "torch":
        return None
    if fp8 and name == "flash-attn":
        return f"kv_cache_dtype {kv_dtype} is read by the torch and triton backends only (flash-attn takes bf16/fp16 KV)"
    if fp8 and name == "triton" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return "Triton converts float8 K/V only on compute capability 8.9 or newer (Ada, Hopper)"
    if name == "triton":
        from rlt_serve.attention import triton_backend

        missing = triton_backend.available()
        if missing is None and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            missing = "the Triton backend needs a CUDA device (or TRITON_INTERPRET=1 to interpret it on the CPU)"
        return missing
    if name == "flash-attn":
        from rlt_serve.attention import flash_backend

        return flash_backend.available(device, dtype)
    return f"unknown attention backend {name!r}; choose from auto, torch, triton, flash-attn"


def get_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype | None = None, page_size: int = 16,
    kv_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend `name`, or for `auto` the fastest one that is correct here.

    `auto`: the torch backend on the CPU. On CUDA the Triton backend when triton imports (it
    reads the paged planes in place at any page size and dtype, float32 included), else
    flash-attn when it can run (fp16/bf16; the package, or torch's own FlashAttention), else
    torch (flash-attn never for float8 KV). The chosen backend's `reason` says why. Asking for a backend that cannot run is a
    ConfigError naming what is missing.
    """
    from rlt_serve.attention.torch_backend import TorchAttentionBackend

    if name == "auto":
        if device.type != "cuda":
            choice, reason = "torch", "auto: CPU device"
        elif _missing("triton", device, dtype, kv_dtype) is None:
            choice, reason = "triton", "auto: CUDA and triton imports (paged planes read in place)"
        elif _missing("flash-attn", device, dtype, kv_dtype) is None:
            choice, reason = "flash-attn", f"auto: triton missing ({_missing('triton', device, dtype, kv_dtype)})"
        else:
            choice, reason = "torch", "auto: neither triton nor FlashAttention can run here"
    else:
        missing = _missing(name, device, dtype, kv_dtype)
        if missing is not None:
            raise ConfigError(f"attention_backend={name!r} cannot run: {missing}")
        choice, reason = name, "asked for"
    backend: AttentionBackend
    if choice == "triton":
        from rlt_serve.attention.triton_backend import TritonAttentionBackend

        backend = TritonAttentionBackend()
    elif choice == "flash-attn":
        from rlt_serve.attention.flash_backend import FlashAttentionBackend

        backend = FlashAttentionBackend(page_size)
    else:
        backend = TorchAttentionBackend()
    backend.reason = reason
    return backend
