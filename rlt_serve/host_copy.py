"""Host lists to device tensors without waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory, which synchronises the stream
first: an eager step that builds its metadata that way waits for the previous step's kernels
before it can launch its own. Staging through pinned memory (PyTorch's caching host allocator
keeps the block until the copy has run) lets the copy be queued like a kernel.
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(values: Sequence[int] | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
