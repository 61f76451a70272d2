"""Depth-aware paged KV storage: one tensor holds every plane.

A plane is one (attention layer, depth slot) pair. K and V are
`[num_planes, num_pages, page_size, kv_heads, head_dim]`; a request's page table indexes the
page axis, so page p holds the same token positions in every plane. Each attention layer has
its own number of depth slots: one for layers that run once per token (prelude, coda), one per
depth for core layers under the `separate` layout.

The storage dtype is the model's or an 8-bit float (`kv_cache_dtype`). Code that only moves K/V
(swap, copies between planes, the torch backend's gather) goes through `raw`: integer views of the
same element size, whose index ops exist for every dtype on every device, float8 included.
"""

from __future__ import annotations

import torch

_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


class KVCache:
    def __init__(
        self,
        slots_per_layer: list[int],
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.slots_per_layer = list(slots_per_layer)
        self._base = [sum(self.slots_per_layer[:i]) for i in range(len(self.slots_per_layer))]
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = device
        self.num_planes = sum(self.slots_per_layer)
        shape = (self.num_planes, num_pages, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        flat = (self.num_planes, num_pages * page_size, kv_heads, head_dim)
        self._k_flat = self.k.view(flat)
        self._v_flat = self.v.view(flat)
        raw = _RAW[self.k.element_size()]
        self.raw_k, self.raw_v = self.k.view(raw), self.v.view(raw)  # same shape, integer elements

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def quantized(self) -> bool:
        """K/V stored in 8 bits (kv_cache_dtype fp8*): attention upcasts what it reads to the model dtype."""
        return self.k.element_size() == 1

    def plane_base(self, layer: int) -> int:
        """First plane of `layer`; depth slot s of that layer is plane `base + s`."""
        return self._base[layer]

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of all planes as `[num_planes, num_pages * page_size, kv_heads, head_dim]`."""
        return self._k_flat, self._v_flat

    def raw_flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`flat`'s shape over the integer views: for copies and gathers of stored values."""
        shape = self._k_flat.shape
        return self.raw_k.view(shape), self.raw_v.view(shape)

    @staticmethod
    def bytes_per_token(num_planes: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_planes * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
