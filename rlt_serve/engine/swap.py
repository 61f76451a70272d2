"""Snapshot / restore of preempted requests to (pinned) CPU memory.

A suspended request keeps everything it needs to continue exactly where it stopped: the content
of its pages in every plane, its in-flight rows' hidden and injected state, and its RNG state.
Its device pages go back to the pool. When the swap space is full the caller recomputes instead.
"""

from __future__ import annotations

import torch

from rlt_serve.engine.kv_cache import KVCache
from rlt_serve.engine.sequence import Sequence, SwapState


class SwapSpace:
    def __init__(self, kv: KVCache, capacity_bytes: int) -> None:
        self.kv = kv
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._pin = kv.device.type == "cuda"

    def page_bytes(self) -> int:
        return 2 * self.kv.k[:, 0].numel() * self.kv.k.element_size()

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.used_bytes + len(seq.page_table) * self.page_bytes() <= self.capacity_bytes

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin)
        host.copy_(t)
        return host

    def swap_out(self, seq: Sequence) -> None:
        """Copy `seq`'s pages and row state to the host; the caller releases its device pages."""
        idx = torch.tensor(seq.page_table, dtype=torch.long, device=self.kv.device)
        k = self._to_host(self.kv.raw_k.index_select(1, idx))  # stored values, any KV dtype
        v = self._to_host(self.kv.raw_v.index_select(1, idx))
        for span in seq.spans:
            span.hidden = self._to_host(span.hidden) if span.hidden is not None else None
            span.injected = self._to_host(span.injected) if span.injected is not None else None
            span.exit = span.exit.to("cpu") if span.exit is not None else None
        nbytes = k.numel() * k.element_size() * 2
        seq.swapped = SwapState(k, v, seq.generator.get_state(), nbytes)
        self.used_bytes += nbytes

    def swap_in(self, seq: Sequence) -> None:
        """Copy the snapshot into `seq.page_table` (freshly allocated) and free the host copy."""
        state = seq.swapped
        idx = torch.tensor(seq.page_table, dtype=torch.long, device=self.kv.device)
        self.kv.raw_k.index_copy_(1, idx, state.k.to(self.kv.device, non_blocking=True))
        self.kv.raw_v.index_copy_(1, idx, state.v.to(self.kv.device, non_blocking=True))
        dev = self.kv.device
        for span in seq.spans:
            span.hidden = span.hidden.to(dev) if span.hidden is not None else None
            span.injected = span.injected.to(dev) if span.injected is not None else None
            span.exit = span.exit.to(dev) if span.exit is not None else None
        seq.generator.set_state(state.rng_state)
        self.used_bytes -= state.nbytes
        seq.swapped = None

    def discard(self, seq: Sequence) -> None:
        """A swapped request that ends (abort) gives its host memory back."""
        if seq.swapped is not None:
            self.used_bytes -= seq.swapped.nbytes
            seq.swapped = None
