"""Byte regions of registered buffers: what a KV chunk transfer moves.

K and V are `[num_planes, num_pages, page_size, kv_heads, head_dim]`, so page p of plane l is one
contiguous run of `page_bytes` at `(l * num_pages + p) * page_bytes`. A chunk is therefore a list
of (plane, local page) -> (plane, remote page) copies; consecutive pages on both sides merge into
one region, which matters for NIXL (descriptor count) and ZMQ (frame count) alike. Regions name a
buffer by its registration index, so the same list works for any transport and either side's
addresses.
"""

from __future__ import annotations

import msgspec
import torch

K, V, STATE = 0, 1, 2  # registration order of the engine's buffers


class Region(msgspec.Struct, array_like=True, frozen=True):
    buf: int  # index of the registered buffer
    offset: int  # bytes from its start
    nbytes: int


class KVLayout(msgspec.Struct, frozen=True):
    """What a peer must know about the other side's KV to address its pages."""

    num_planes: int
    num_pages: int
    page_bytes: int  # one page of one plane
    state_bytes: int  # one row of the final-state buffer
    kv_dtype: str = ""  # e.g. "torch.bfloat16": two 8-bit formats have equal page bytes but differ

    @classmethod
    def of(cls, k: torch.Tensor, state: torch.Tensor | None = None) -> "KVLayout":
        planes, pages = k.shape[:2]
        page_bytes = k[0, 0].numel() * k.element_size()
        state_bytes = state[0].numel() * state.element_size() if state is not None else 0
        return cls(int(planes), int(pages), int(page_bytes), int(state_bytes), str(k.dtype))


def _runs(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """(local first, remote first, count) runs where both sides advance by one page."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(local, remote):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs


def kv_regions(
    local: KVLayout, remote: KVLayout, local_pages: list[int], remote_pages: list[int],
    planes: list[int] | range | None = None,
) -> tuple[list[Region], list[Region]]:
    """Matching region lists (K then V, plane by plane) moving `local_pages` to `remote_pages`."""
    if len(local_pages) != len(remote_pages):
        raise ValueError(f"{len(local_pages)} local pages vs {len(remote_pages)} remote pages")
    if (local.num_planes, local.page_bytes, local.kv_dtype) != (remote.num_planes, remote.page_bytes, remote.kv_dtype):
        raise ValueError(f"incompatible KV layouts: {local} vs {remote} (same model, dtype, kv_cache_dtype and page_size needed)")
    for pages, lay, side in ((local_pages, local, "local"), (remote_pages, remote, "remote")):
        if any(not 0 <= p < lay.num_pages for p in pages):
            raise ValueError(f"{side} page out of range [0, {lay.num_pages})")
    planes = range(local.num_planes) if planes is None else planes
    src: list[Region] = []
    dst: list[Region] = []
    runs = _runs(local_pages, remote_pages)
    pb = local.page_bytes
    for buf in (K, V):
        for plane in planes:
            for a, b, n in runs:
                src.append(Region(buf, (plane * local.num_pages + a) * pb, n * pb))
                dst.append(Region(buf, (plane * remote.num_pages + b) * pb, n * pb))
    return src, dst


def state_regions(local: KVLayout, remote: KVLayout, local_slot: int, remote_slot: int) -> tuple[list[Region], list[Region]]:
    """The final-state row `local_slot` -> the peer's row `remote_slot`."""
    if local.state_bytes != remote.state_bytes or not local.state_bytes:
        raise ValueError(f"incompatible final-state buffers: {local.state_bytes} vs {remote.state_bytes} bytes")
    n = local.state_bytes
    return [Region(STATE, local_slot * n, n)], [Region(STATE, remote_slot * n, n)]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A registered buffer as flat uint8 (it must be contiguous: regions are byte offsets)."""
    if not t.is_contiguous():
        raise ValueError("registered buffers must be contiguous")
    return t.view(-1).view(torch.uint8)


def chunk_regions(
    local: KVLayout, remote: KVLayout, page_ids: list[int], first_page: int, remote_page_ids: list[int],
    local_slot: int | None = None, remote_slot: int | None = None,
) -> tuple[list[Region], list[Region]]:
    """The regions of one reported chunk (`KVChunk.page_ids`, `first_page`) into a reservation's
    page table (`Reservation.page_ids`), plus the final-state row when both slots are given."""
    dst_pages = remote_page_ids[first_page : first_page + len(page_ids)]
    if len(dst_pages) != len(page_ids):
        raise ValueError(f"chunk pages [{first_page}, {first_page + len(page_ids)}) exceed the reservation's "
                         f"{len(remote_page_ids)} pages")
    src, dst = kv_regions(local, remote, page_ids, dst_pages)
    if local_slot is not None and remote_slot is not None:
        s, d = state_regions(local, remote, local_slot, remote_slot)
        src, dst = src + s, dst + d
    return src, dst
