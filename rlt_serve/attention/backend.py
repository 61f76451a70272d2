"""The one small interface every attention backend implements.

A core call is a varlen batch of rows, each at its own depth. The backend gets, per row, how many
query tokens it has, where they start, which depth slot it reads and writes, and the request's
page table; per layer it writes the new K/V into plane `base(layer) + depth_slot` and attends
the row's queries to that plane's prefix plus themselves (causal). Rows at different depths
share one call: only the plane index differs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from rlt_serve.config import ConfigError
from rlt_serve.engine.kv_cache import KVCache


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


class AttentionBackend(ABC):
    name: str = "abstract"

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
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            token_depth_slot=torch.tensor(depth, dtype=torch.long, device=dev),
            write_mask=write_mask,
        )
        meta.extra = self.prepare_extra(meta, kv)
        return meta

    def prepare_extra(self, meta: AttentionMetadata, kv: KVCache) -> Any:
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
    ) -> torch.Tensor:  # [T, heads, head_dim]
        ...


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    from rlt_serve.attention.torch_backend import TorchAttentionBackend

    if name in ("auto", "torch"):
        return TorchAttentionBackend()
    raise ConfigError(f"attention backend {name!r} is not available; choose from auto, torch")
