"""Pure-torch attention backend: runs on CPU and GPU, the baseline every kernel is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlt_serve.attention.backend import AttentionBackend, AttentionMetadata
from rlt_serve.engine.kv_cache import KVCache


class TorchAttentionBackend(AttentionBackend):
    """Writes K/V by flat slot index, then one SDPA call per row over that row's plane."""

    name = "torch"

    def prepare_extra(self, meta: AttentionMetadata, kv: KVCache) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        ps = kv.page_size
        out = []
        for row in meta.rows:
            pages = torch.tensor(row.page_ids, dtype=torch.long)
            pos = torch.arange(row.end_pos)
            ctx = (pages[pos // ps] * ps + pos % ps).to(kv.device)
            mask = None
            if row.num_query > 1:
                q_pos = torch.arange(row.start_pos, row.end_pos)
                mask = (pos[None, :] <= q_pos[:, None]).to(kv.device)
            out.append((ctx, mask))
        return out

    def forward(self, q, k, v, kv, layer, meta, scale, kv_written=False):
        assert not kv_written, "this backend writes K/V itself (kv_write_target is None)"
        # Stored values move through the integer views (float8 has no CUDA index kernels in every
        # torch); attention reads them back as the model dtype, as the Triton kernels do.
        k_flat, v_flat = kv.raw_flat()
        base = kv.plane_base(layer)
        planes, slots = meta.token_depth_slot + base, meta.slot_mapping
        if meta.write_mask is not None:
            m = meta.write_mask
            planes, slots, k_new, v_new = planes[m], slots[m], k[m], v[m]
        else:
            k_new, v_new = k, v
        k_flat[planes, slots] = k_new.to(kv.dtype).view(k_flat.dtype)
        v_flat[planes, slots] = v_new.to(kv.dtype).view(v_flat.dtype)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        for row, start, (ctx, mask) in zip(meta.rows, meta.query_start, meta.extra):
            plane = base + row.depth_slot
            keys = k_flat[plane].index_select(0, ctx).view(kv.dtype).to(q.dtype).transpose(0, 1)
            values = v_flat[plane].index_select(0, ctx).view(kv.dtype).to(q.dtype).transpose(0, 1)
            qi = q[start : start + row.num_query].transpose(0, 1)
            oi = F.scaled_dot_product_attention(qi, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[start : start + row.num_query] = oi.transpose(0, 1)
        return out
