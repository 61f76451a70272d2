"""Triton attention backend: a KV-write launch and an attention launch per layer, for every row.

Each program of the attention kernel owns a tile of one row: up to `TOK_M` consecutive query
tokens times the query heads of one KV head (GQA heads are packed into the tile's M dimension,
so a one-token decode row of a GQA model still fills a matrix-multiply tile). It walks the row's
KV plane `plane_base + depth_slot[row]` through the row's page table, gathering page ids per key
position, so page size 1 and 16 take the same path and rows at different depths share one launch.
Softmax is online (running max and sum in fp32); head dims that are not a power of two are padded
and masked. Float8 K/V (`kv_cache_dtype`) is upcast to q's dtype as it is loaded. K/V of the new tokens is written first by a small kernel (tokens masked out by
`write_mask` keep what the cache holds), then every query reads its keys from the cache; or the
qkv GEMV's epilogue writes them (`kv_write_target`, `forward(..., kv_written=True)`).

Prompt spans take the prompt tile (`prefill_*` knobs): 64 keys a step, two pipeline stages, and
the key blocks every query of the tile sees whole in a loop of their own without masks, the
diagonal blocks after them. On an H100 that cut a layer's attention over an 8192-token prompt from
1283 to 898 us and over a 2048-token chunk after a 6144-token prefix from 705 to 397 us.

When a call has too few programs to fill the GPU (decode at low concurrency: one row is only
`kv_heads` programs) and long contexts, each program's key range is split (flash-decoding): the
splits leave unnormalised fp32 partials with their running max and sum, and a third launch merges
them. `TritonAttentionBackend.num_splits` makes the choice per call.

Kernels are launched through `rlt_serve.triton_jit.jit`, which imports Triton on first launch
(tests pick the CPU interpreter per process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from rlt_serve.attention.backend import AttentionBackend, AttentionMetadata, KVWriteTarget
from rlt_serve.engine.kv_cache import KVCache
from rlt_serve.host_copy import to_device
from rlt_serve.triton_jit import device_function, jit, next_pow2, pdl, triton_missing

triton: Any = None  # bound on first launch by rlt_serve.triton_jit.jit
tl: Any = None

_LOG2E = 1.4426950408889634
_ROW_FIELDS = 4  # q_start, num_query, start_pos, depth_slot
# KV_BITS of the attention kernel: how float8 K/V become dot operands (see _kv_operand).
_AS_Q, _E4M3_BITS, _E5M2_BITS = 0, 1, 2
_E4M3_SCALE = 256.0  # e4m3's bits read as fp16 give the value times 2^-8


@device_function
def _kv_operand(x, dt, KV_BITS: tl.constexpr):
    """Loaded K or V as a dot operand. _AS_Q: `x.to(dt)`. For float8 with a 16-bit q the bits are
    moved into an fp16 instead of converted: e5m2 is the top byte of an fp16 (exact), and e4m3's
    sign, exponent and mantissa land in an fp16's fields so that the value is x * 2^-8, subnormals
    included (fp16 holds every e4m3 value exactly); the caller scales the scores and the output
    back by _E4M3_SCALE. Integer shifts cost less than Triton's float8 conversion sequence."""
    if KV_BITS == 0:  # one return at the end: Triton compiles statements after a constexpr-if's return
        y = x.to(dt)
    else:
        b = x.to(tl.uint8, bitcast=True).to(tl.uint16)
        if KV_BITS == 1:
            h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        else:
            h = b << 8
        y = h.to(tl.float16, bitcast=True)
    return y


@device_function
def _block_kv_offsets(n0, hi, table_row, kv_base, stride_page, stride_slot,
                      BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Key positions [n0, n0 + BLOCK_N), which of them are below `hi`, and their K/V offsets (page lookup)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    n_ok = pos < hi
    if MASKED:
        page = tl.load(table_row + pos // PAGE_SIZE, mask=n_ok, other=0)
    else:
        page = tl.load(table_row + pos // PAGE_SIZE)
    return pos, n_ok, kv_base + page.to(tl.int64) * stride_page + (pos % PAGE_SIZE) * stride_slot


@device_function
def _load_kt(k_cache, kv_off, d, key_ok, d_ok, MASKED: tl.constexpr, FULL_D: tl.constexpr):
    """K of a key block, transposed: [HEAD_DP, BLOCK_N]."""
    if MASKED:
        kt = tl.load(k_cache + kv_off[None, :] + d[:, None], mask=key_ok[None, :] & d_ok[:, None], other=0.0)
    elif FULL_D:
        kt = tl.load(k_cache + kv_off[None, :] + d[:, None])
    else:
        kt = tl.load(k_cache + kv_off[None, :] + d[:, None], mask=d_ok[:, None], other=0.0)
    return kt


@device_function
def _load_v(v_cache, kv_off, d, key_ok, d_ok, MASKED: tl.constexpr, FULL_D: tl.constexpr):
    """V of a key block: [BLOCK_N, HEAD_DP]."""
    if MASKED:
        v = tl.load(v_cache + kv_off[:, None] + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    elif FULL_D:
        v = tl.load(v_cache + kv_off[:, None] + d[None, :])
    else:
        v = tl.load(v_cache + kv_off[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
    return v


@device_function
def _block_scores(q, m_i, l_i, kt, pos, n_ok, q_pos, qk_scale,
                  PRECISION: tl.constexpr, KV_BITS: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Online softmax over one loaded K block: (probabilities, rescale of the old sums, new max, new sum).
    Masked-out keys add exact zeros."""
    s = tl.dot(q, _kv_operand(kt, q.dtype, KV_BITS), input_precision=PRECISION) * qk_scale
    if MASKED:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query that sees no key of this block
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@device_function
def _add_pv(acc, alpha, p, v, dt, PRECISION: tl.constexpr, KV_BITS: tl.constexpr):
    return acc * alpha[:, None] + tl.dot(p.to(dt), _kv_operand(v, dt, KV_BITS), input_precision=PRECISION)


@device_function
def _attend_block(
    q, acc, m_i, l_i, n0, hi, q_pos, k_cache, v_cache, table_row, kv_base,
    stride_page, stride_slot, d, d_ok, qk_scale,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr, KV_BITS: tl.constexpr,
    MASKED: tl.constexpr, FULL_D: tl.constexpr,
):  # fmt: skip
    """One key block [n0, n0 + BLOCK_N) of the online softmax. MASKED: keys at or past `hi` and
    keys after a query's position are excluded; unmasked blocks (every key seen by every query)
    skip those selects, and with FULL_D (head_dim a power of two) the loads carry no mask at all.
    V is loaded once the scores are formed, so its registers are free until then."""
    pos, n_ok, kv_off = _block_kv_offsets(n0, hi, table_row, kv_base, stride_page, stride_slot,
                                          BLOCK_N, PAGE_SIZE, MASKED)  # fmt: skip
    kt = _load_kt(k_cache, kv_off, d, n_ok, d_ok, MASKED, FULL_D)
    p, alpha, m_new, l_i = _block_scores(q, m_i, l_i, kt, pos, n_ok, q_pos, qk_scale, PRECISION, KV_BITS, MASKED)
    v = _load_v(v_cache, kv_off, d, n_ok, d_ok, MASKED, FULL_D)
    return _add_pv(acc, alpha, p, v, q.dtype, PRECISION, KV_BITS), m_new, l_i


def _write_kv_kernel(
    k_ptr, v_ptr, k_cache, v_cache, slot_ptr, depth_ptr, mask_ptr,
    plane_base, stride_t, stride_plane, stride_slot,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per token: copy its `kv_heads * head_dim` K and V values into its plane, cast
    to the cache's dtype (float8 storage: round to nearest even, saturating, as torch's cast)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < WIDTH
    if HAS_MASK:
        ok = ok & (tl.load(mask_ptr + t) != 0)
    plane = (plane_base + tl.load(depth_ptr + t)).to(tl.int64)
    dst = plane * stride_plane + tl.load(slot_ptr + t).to(tl.int64) * stride_slot + offs
    src = t.to(tl.int64) * stride_t + offs
    kt = k_cache.dtype.element_ty
    tl.store(k_cache + dst, tl.load(k_ptr + src, mask=ok).to(kt), mask=ok)
    tl.store(v_cache + dst, tl.load(v_ptr + src, mask=ok).to(kt), mask=ok)


def _attention_kernel(
    q_ptr, o_ptr, k_cache, v_cache, rows_ptr, tiles_ptr, table_ptr,
    part_acc, part_ml, num_splits, cells,
    plane_base, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_plane, stride_page, stride_slot, stride_kvh, stride_table,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, TOK_M: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_DP: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr, KV_BITS: tl.constexpr,
    V_SCALE: tl.constexpr, FULL_FIRST: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (tile, kv_head, split): causal attention of one tile's queries over its row's plane,
    or (SPLIT) over split `s` of the key blocks, leaving unnormalised partials for the combine.
    KV_BITS: float8 K/V read as fp16 bit patterns (_kv_operand), q and p in fp16; V_SCALE undoes
    the operand's power-of-two scale (the scores' is folded into qk_scale by the caller).
    PREFETCH (one query a row: decode) reads before `gdc_wait` what no kernel of this call writes:
    row records and page tables (host copies made before the call's first kernel) and the first
    key block's K/V below the query's position (written by earlier calls). Only q and the query's
    own key, written by the previous kernel, are loaded after the wait."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if not PREFETCH:
            tl.extra.cuda.gdc_wait()
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.load(tiles_ptr + 2 * tile)
    q_off = tl.load(tiles_ptr + 2 * tile + 1)
    q_start = tl.load(rows_ptr + 4 * row)
    num_q = tl.load(rows_ptr + 4 * row + 1)
    start_pos = tl.load(rows_ptr + 4 * row + 2)
    plane = (plane_base + tl.load(rows_ptr + 4 * row + 3)).to(tl.int64)

    m = tl.arange(0, TOK_M * GROUP_P)
    tok = q_off + m // GROUP_P
    head = kvh * GROUP + m % GROUP_P
    m_ok = (tok < num_q) & (m % GROUP_P < GROUP)
    d = tl.arange(0, HEAD_DP)
    d_ok = d < HEAD_D
    q_rows = (q_start + tok).to(tl.int64)
    q_pos = start_pos + tok
    kv_end = start_pos + tl.minimum(num_q, q_off + TOK_M)
    lo = 0
    hi = kv_end
    if SPLIT:  # split s takes an equal share of the row's key blocks
        per = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), num_splits) * BLOCK_N
        lo = tl.program_id(2) * per
        hi = tl.minimum(kv_end, lo + per)
    kv_base = plane * stride_plane + kvh * stride_kvh
    table_row = table_ptr + row * stride_table
    if PREFETCH:
        pos0, ok0, off0 = _block_kv_offsets(lo, hi, table_row, kv_base, stride_page, stride_slot,
                                            BLOCK_N, PAGE_SIZE, True)  # fmt: skip
        old = ok0 & (pos0 < start_pos)
        kt0 = _load_kt(k_cache, off0, d, old, d_ok, True, HEAD_D == HEAD_DP)
        v0 = _load_v(v_cache, off0, d, old, d_ok, True, HEAD_D == HEAD_DP)
    if PDL and PREFETCH:
        tl.extra.cuda.gdc_wait()
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if KV_BITS != 0:
        q = q.to(tl.float16)

    m_i = tl.full([TOK_M * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([TOK_M * GROUP_P], tl.float32)
    acc = tl.zeros([TOK_M * GROUP_P, HEAD_DP], tl.float32)
    mid = lo
    if PREFETCH:
        if start_pos < lo + BLOCK_N:  # the block holds the query's own key
            own = ok0 & (pos0 == start_pos)
            kt0 = tl.where(own[None, :], _load_kt(k_cache, off0, d, own, d_ok, True, HEAD_D == HEAD_DP), kt0)
            v0 = tl.where(own[:, None], _load_v(v_cache, off0, d, own, d_ok, True, HEAD_D == HEAD_DP), v0)
        p, alpha, m_i, l_i = _block_scores(q, m_i, l_i, kt0, pos0, ok0, q_pos, qk_scale, PRECISION, KV_BITS, True)
        acc = _add_pv(acc, alpha, p, v0, q.dtype, PRECISION, KV_BITS)
        mid = lo + BLOCK_N
    if FULL_FIRST:  # key blocks every query of the tile sees whole: no causal or range mask
        mid = lo + tl.maximum(tl.minimum(hi, start_pos + q_off + 1) - lo, 0) // BLOCK_N * BLOCK_N
        for n0 in range(lo, mid, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                q, acc, m_i, l_i, n0, hi, q_pos, k_cache, v_cache, table_row, kv_base,
                stride_page, stride_slot, d, d_ok, qk_scale,
                BLOCK_N, PAGE_SIZE, PRECISION, KV_BITS, False, HEAD_D == HEAD_DP,
            )  # fmt: skip
    for n0 in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            q, acc, m_i, l_i, n0, hi, q_pos, k_cache, v_cache, table_row, kv_base,
            stride_page, stride_slot, d, d_ok, qk_scale,
            BLOCK_N, PAGE_SIZE, PRECISION, KV_BITS, True, HEAD_D == HEAD_DP,
        )  # fmt: skip
    if V_SCALE != 1.0:
        acc = acc * V_SCALE
    if SPLIT:  # partials [splits, T, heads, HEAD_DP] and (max, sum) [splits, T, heads, 2], fp32
        n_heads = tl.num_programs(1) * GROUP
        cell = tl.program_id(2).to(tl.int64) * cells + q_rows * n_heads + head
        tl.store(part_acc + cell[:, None] * HEAD_DP + d[None, :], acc, mask=m_ok[:, None])
        tl.store(part_ml + 2 * cell, m_i, mask=m_ok)
        tl.store(part_ml + 2 * cell + 1, l_i, mask=m_ok)
    else:
        out = acc / l_i[:, None]
        tl.store(
            o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=m_ok[:, None] & d_ok[None, :],
        )


@device_function
def _vector_offsets(n0, hi, table_row, kv_base, stride_page, stride_slot, d,
                    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):  # fmt: skip
    """Positions, in-range mask and [BLOCK_N, HEAD_DP] K/V offsets of a key block in the vector
    kernel's layout (one key a row)."""
    pos, n_ok, kv_off = _block_kv_offsets(n0, hi, table_row, kv_base, stride_page, stride_slot,
                                          BLOCK_N, PAGE_SIZE, True)  # fmt: skip
    return pos, n_ok, kv_off[:, None] + d[None, :]


@device_function
def _vector_scores(qf, k, n_ok, m_i, l_i, qk_scale):
    """Online softmax of one query over a [BLOCK_N, HEAD_DP] K block: (p, rescale, new max, new sum).
    A block with no key in range (an empty split's peeled first block) adds exact zeros."""
    s = tl.sum(k.to(tl.float32) * qf[None, :], 1) * qk_scale
    s = tl.where(n_ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe)
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 0)


@device_function
def _vector_pv(acc, alpha, p, v, dt):
    return acc * alpha + tl.sum(p.to(dt).to(tl.float32)[:, None] * v.to(tl.float32), 0)


def _decode_mha_kernel(
    q_ptr, o_ptr, k_cache, v_cache, rows_ptr, table_ptr,
    part_acc, part_ml, num_splits, cells,
    plane_base, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_plane, stride_page, stride_slot, stride_kvh, stride_table,
    HEAD_D: tl.constexpr, HEAD_DP: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr, HEADS_FIRST: tl.constexpr, V_WITH_K: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (row, head, split) of a one-query-per-row call without GQA: the score of a key is
    a dot product of two vectors, so no matrix-multiply tile is padded out from one query row to
    16 and the program holds a [HEAD_DP] accumulator, leaving registers for more programs in
    flight. Same online softmax, same bf16 rounding of p, same split partials as the tiled kernel.
    HEADS_FIRST puts the head on the fastest grid axis: the programs running side by side are then
    the heads of one row, which together read each key's contiguous [heads, head_dim] block.
    PREFETCH: the first key block is read before `gdc_wait`, as in the tiled kernel."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if not PREFETCH:
            tl.extra.cuda.gdc_wait()
    row = tl.program_id(1) if HEADS_FIRST else tl.program_id(0)
    head = tl.program_id(0) if HEADS_FIRST else tl.program_id(1)
    q_row = tl.load(rows_ptr + 4 * row).to(tl.int64)
    start_pos = tl.load(rows_ptr + 4 * row + 2)
    plane = (plane_base + tl.load(rows_ptr + 4 * row + 3)).to(tl.int64)
    d = tl.arange(0, HEAD_DP)
    d_ok = d < HEAD_D
    kv_end = start_pos + 1
    lo = 0
    hi = kv_end
    if SPLIT:
        per = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), num_splits) * BLOCK_N
        lo = tl.program_id(2) * per
        hi = tl.minimum(kv_end, lo + per)
    kv_base = plane * stride_plane + head * stride_kvh
    table_row = table_ptr + row * stride_table
    if PREFETCH:
        pos0, ok0, offs0 = _vector_offsets(lo, hi, table_row, kv_base, stride_page, stride_slot, d, BLOCK_N, PAGE_SIZE)
        old = (ok0 & (pos0 < start_pos))[:, None] & d_ok[None, :]
        k0 = tl.load(k_cache + offs0, mask=old, other=0.0)
        v0 = tl.load(v_cache + offs0, mask=old, other=0.0)
    if PDL and PREFETCH:
        tl.extra.cuda.gdc_wait()
    q = tl.load(q_ptr + q_row * stride_qt + head * stride_qh + d, mask=d_ok, other=0.0)
    qf = q.to(tl.float32)
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([HEAD_DP], tl.float32)
    mid = lo
    if PREFETCH:
        if start_pos < lo + BLOCK_N:  # the block holds the query's own key
            own = (ok0 & (pos0 == start_pos))[:, None] & d_ok[None, :]
            k0 = tl.where(own, tl.load(k_cache + offs0, mask=own, other=0.0), k0)
            v0 = tl.where(own, tl.load(v_cache + offs0, mask=own, other=0.0), v0)
        p, alpha, m_i, l_i = _vector_scores(qf, k0, ok0, m_i, l_i, qk_scale)
        acc = _vector_pv(acc, alpha, p, v0, q.dtype)
        mid = lo + BLOCK_N
    for n0 in range(mid, hi, BLOCK_N):
        pos, n_ok, offs = _vector_offsets(n0, hi, table_row, kv_base, stride_page, stride_slot, d, BLOCK_N, PAGE_SIZE)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache + offs, mask=kv_mask, other=0.0)
        if V_WITH_K:
            v = tl.load(v_cache + offs, mask=kv_mask, other=0.0)
        p, alpha, m_i, l_i = _vector_scores(qf, k, n_ok, m_i, l_i, qk_scale)
        if not V_WITH_K:
            v = tl.load(v_cache + offs, mask=kv_mask, other=0.0)
        acc = _vector_pv(acc, alpha, p, v, q.dtype)
    if SPLIT:
        n_heads = tl.num_programs(0) if HEADS_FIRST else tl.num_programs(1)
        cell = tl.program_id(2).to(tl.int64) * cells + q_row * n_heads + head
        tl.store(part_acc + cell * HEAD_DP + d, acc)
        tl.store(part_ml + 2 * cell, m_i)
        tl.store(part_ml + 2 * cell + 1, l_i)
    else:
        tl.store(o_ptr + q_row * stride_ot + head * stride_oh + d, (acc / l_i).to(o_ptr.dtype.element_ty), mask=d_ok)


def _combine_kernel(
    o_ptr, part_acc, part_ml, num_splits, cells, stride_ot, stride_oh,
    HEAD_D: tl.constexpr, HEAD_DP: tl.constexpr, SPLITS_P: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (token, head): merge the splits' partial softmax sums into the output."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cell = t * tl.num_programs(1) + h
    sp = tl.arange(0, SPLITS_P)
    sp_ok = sp < num_splits
    m = tl.load(part_ml + 2 * (sp * cells + cell), mask=sp_ok, other=float("-inf"))
    total = tl.load(part_ml + 2 * (sp * cells + cell) + 1, mask=sp_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    d = tl.arange(0, HEAD_DP)
    acc = tl.load(part_acc + (sp[:, None] * cells + cell) * HEAD_DP + d[None, :], mask=sp_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(total * w, 0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < HEAD_D)


@dataclass
class TritonCallData:
    """Device tensors of one core call, shared by every layer; tiles are built per GQA group."""

    rows: torch.Tensor  # [R, 4] int32: q_start, num_query, start_pos, depth_slot
    table: torch.Tensor  # [R, max_pages] int32 page ids (padding 0 is never read)
    write_mask: torch.Tensor | None  # [T] int8
    num_query: list[int]
    max_end: int  # longest context of the call, for the split-KV choice
    tiles: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)  # tok_m -> ([G, 2], G)
    # One-query rows (decode): tile r is row r whatever the tile height; a CUDA graph passes its own.
    decode_tiles: torch.Tensor | None = None

    def tiles_for(self, tok_m: int, device: torch.device) -> tuple[torch.Tensor, int]:
        if self.decode_tiles is not None:
            return self.decode_tiles, len(self.num_query)
        if tok_m not in self.tiles:
            flat = [x for r, n in enumerate(self.num_query) for off in range(0, n, tok_m) for x in (r, off)]
            self.tiles[tok_m] = (to_device(flat, torch.int32, device), len(flat) // 2)
        return self.tiles[tok_m]


def tile_shape(max_query: int, group: int, prompt_m: int = 0) -> tuple[int, int]:
    """(rows, query tokens) of an attention tile: 16 or 64 (token, head-of-group) rows, the wide
    tile only when some row has more queries than a narrow one holds; `prompt_m` rows (the prompt
    tile, `TritonAttentionBackend.prefill_block_m`) when some row fills a tile of that height."""
    group_p = next_pow2(group)
    block_m = prompt_m if is_prompt_tile(max_query, group, prompt_m) else 64 if max_query > 16 // group_p else 16
    return block_m, max(1, block_m // group_p)


def is_prompt_tile(max_query: int, group: int, prompt_m: int) -> bool:
    """Whether a call whose longest row has `max_query` queries takes the `prompt_m`-row prompt tile."""
    return prompt_m > 0 and max_query >= prompt_m // next_pow2(group)


def _token_rows(x: torch.Tensor) -> bool:
    """[T, heads, dim] whose heads x dim values of a token are contiguous (views of a fused qkv)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


class TritonAttentionBackend(AttentionBackend):
    """Paged, depth-aware attention for CUDA (or Triton's CPU interpreter in tests)."""

    name = "triton"
    strided_qkv = True
    block_n = 64  # keys per inner step; halved for wide tiles (M=64, head_dim > 64) to bound registers
    num_warps = 4
    num_stages: int | None = None  # Triton's default pipelining depth unless set (the microbenchmark sweeps it)
    # One-query rows without GQA may take the vector kernel (_decode_mha_kernel). Off: on the H200 it
    # took 8.3 us per layer at c=1 against the tiled kernel's 6.2 us (profile_decode, 2026-12-03).
    decode_mha = False
    # Float8 K/V takes the vector kernel anyway: its fp32 products convert as they load, where the
    # tiled kernel's MMA operands do not pay back the conversion. Its tile: fp8_vector_tile.
    fp8_decode_mha = True
    fp8_warps_in_flight = 2048  # unsplit: programs x warps to aim for (about 16 warps an SM)
    fp8_split_block_n = 32
    heads_first = True  # its grid order (see the kernel)
    # Decode calls may read their first key block before `gdc_wait` (the kernel's docstring says why
    # that is safe). Off until timed and tested on a GPU (the CPU interpreter shows equal bits and
    # sm_90 compiles); `RLT_ATTN_PREFETCH=1` turns it on.
    prefetch_decode = False
    v_with_k = False  # bf16 vector kernel: V loaded after the scores (with K's loads: fp8_vector_tile)
    fp8_bits = True  # float8 K/V into 16-bit dots by bit moves, not conversion (_kv_operand)
    max_splits = 16
    min_split_keys = 64  # one key block: shorter splits cost more in the combine than they save
    split_target: int | None = None  # programs to aim for; None: twice the GPU's multiprocessors
    # Prompt spans (some row with at least this many (token, head) rows) take the prompt tile: its
    # own key step, warps and pipelining, and whole key blocks without masks in their own loop
    # (_attend_block) (0: off). Chosen by `attn_microbench.py --prefill-sweep`.
    prefill_block_m = 64
    prefill_block_n = 64
    prefill_gqa_block_n = 32  # GQA: a tile's rows are several heads of few tokens, one K block for all
    prefill_warps = 4
    prefill_stages: int | None = 2
    prefill_full_first = True
    # Prompt tiles split key ranges only this long: a fresh 512-token prompt split 3 ways took
    # 14.9 us of attention plus a 24.3 us combine a layer (H100); a short chunk on a long prefix
    # still splits.
    prefill_min_split_keys = 1024
    _sms: int | None = None

    def prepare_extra(self, meta: AttentionMetadata, kv: KVCache) -> TritonCallData:
        rows = meta.rows
        width = max(len(r.page_ids) for r in rows)
        flat: list[int] = []
        for row, start in zip(rows, meta.query_start):
            flat += [start, row.num_query, row.start_pos, row.depth_slot]
        for row in rows:
            flat += row.page_ids + [0] * (width - len(row.page_ids))
        packed = to_device(flat, torch.int32, kv.device)  # one host-to-device copy
        n = _ROW_FIELDS * len(rows)
        mask = meta.write_mask.to(device=kv.device, dtype=torch.int8) if meta.write_mask is not None else None
        return TritonCallData(
            rows=packed[:n].view(len(rows), _ROW_FIELDS),
            table=packed[n:].view(len(rows), width),
            write_mask=mask,
            num_query=[r.num_query for r in rows],
            max_end=max(r.end_pos for r in rows),
        )

    def write(self, k: torch.Tensor, v: torch.Tensor, kv: KVCache, layer: int, meta: AttentionMetadata) -> None:
        """K/V of the call's tokens into their planes (one launch; masked-out tokens skipped)."""
        data: TritonCallData = meta.extra
        k_flat, v_flat = kv.flat(layer)
        if not (_token_rows(k) and _token_rows(v) and k.stride(0) == v.stride(0)):
            k, v = k.contiguous(), v.contiguous()
        width = k.shape[1] * k.shape[2]
        jit(_write_kv_kernel)[(k.shape[0],)](
            k, v, k_flat, v_flat, meta.slot_mapping, meta.token_depth_slot,
            data.write_mask if data.write_mask is not None else meta.slot_mapping,
            kv.plane_base(layer), k.stride(0), k_flat.stride(0), k_flat.stride(1),
            WIDTH=width, BLOCK=next_pow2(width), HAS_MASK=data.write_mask is not None, **pdl(k),
        )  # fmt: skip

    def num_splits(self, programs: int, max_context: int, device: torch.device, min_keys: int | None = None) -> int:
        """Key-range splits per program: enough to fill the GPU twice over when few programs
        (decode at low concurrency) face long contexts, with at least `min_keys` (default
        `min_split_keys`) per split."""
        target = self.split_target
        if target is None:
            if self._sms is None:
                self._sms = (
                    torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
                )
            target = 2 * self._sms
        min_keys = min_keys or self.min_split_keys
        return max(1, min(-(-target // programs), max_context // min_keys, self.max_splits))

    def kv_write_target(self, kv: KVCache, layer: int, meta: AttentionMetadata) -> KVWriteTarget:
        data: TritonCallData = meta.extra
        k_flat, v_flat = kv.flat(layer)
        return KVWriteTarget(k_flat, v_flat, meta.slot_mapping, meta.token_depth_slot, data.write_mask,
                             kv.plane_base(layer))  # fmt: skip

    def forward(self, q, k, v, kv, layer, meta, scale, kv_written=False):
        data: TritonCallData = meta.extra
        if not kv_written:
            self.write(k, v, kv, layer, meta)
        t, heads, head_dim = q.shape
        kv_heads = k.shape[1]
        if not kv.quantized:  # float8 K/V is read as q's dtype; otherwise q is in the KV dtype already
            q = q.to(kv.dtype)
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        group = heads // kv_heads
        group_p = next_pow2(group)
        prompt_m = self.prompt_rows(q.dtype)
        block_m, tok_m = tile_shape(max(data.num_query), group, prompt_m)
        head_dp = max(16, next_pow2(head_dim))
        k_pages = kv.k  # [planes, pages, page_size, kv_heads, head_dim]
        vector = self.decode_mha or (kv.quantized and self.fp8_decode_mha)
        if vector and group == 1 and max(data.num_query) == 1:
            num_rows = len(data.num_query)
            splits = self.num_splits(num_rows * heads, data.max_end, kv.device)
            block_n, warps, v_with_k = self.block_n, self.num_warps, self.v_with_k
            if kv.quantized:
                block_n, warps, v_with_k = self.fp8_vector_tile(num_rows * heads, splits)
            part_acc, part_ml = self._partials(splits, t, heads, head_dp, out)
            grid = (heads, num_rows, splits) if self.heads_first else (num_rows, heads, splits)
            jit(_decode_mha_kernel)[grid](
                q, out, k_pages, kv.v, data.rows, data.table,
                part_acc, part_ml, splits, t * heads,
                kv.plane_base(layer), scale * _LOG2E,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), k_pages.stride(3), data.table.stride(0),
                HEAD_D=head_dim, HEAD_DP=head_dp, BLOCK_N=block_n, PAGE_SIZE=kv.page_size, SPLIT=splits > 1,
                HEADS_FIRST=self.heads_first, V_WITH_K=v_with_k, PREFETCH=self._prefetch(data), num_warps=warps,
                **pdl(q), **({} if self.num_stages is None else {"num_stages": self.num_stages}),
            )  # fmt: skip
            return self._combine(out, part_acc, part_ml, splits, t, heads, head_dim, head_dp)
        tiles, num_tiles = data.tiles_for(tok_m, kv.device)
        kv_bits = self.kv_bits(kv.dtype, q.dtype)
        op_scale = _E4M3_SCALE if kv_bits == _E4M3_BITS else 1.0
        block_n = self.block_n if head_dp <= 64 or block_m <= 16 else self.block_n // 2
        warps, stages, full_first, min_keys = self.num_warps, self.num_stages, False, None
        if is_prompt_tile(max(data.num_query), group, prompt_m):
            block_n = self.prefill_block_n if group == 1 else self.prefill_gqa_block_n
            warps, stages = self.prefill_warps, self.prefill_stages
            full_first, min_keys = self.prefill_full_first, self.prefill_min_split_keys
        splits = self.num_splits(num_tiles * kv_heads, data.max_end, kv.device, min_keys)
        prefetch = self._prefetch(data)
        part_acc, part_ml = self._partials(splits, t, heads, head_dp, out)
        jit(_attention_kernel)[(num_tiles, kv_heads, splits)](
            q, out, k_pages, kv.v, data.rows, tiles, data.table,
            part_acc, part_ml, splits, t * heads,
            kv.plane_base(layer), scale * _LOG2E * op_scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), k_pages.stride(3), data.table.stride(0),
            GROUP=group, GROUP_P=group_p, TOK_M=tok_m, HEAD_D=head_dim, HEAD_DP=head_dp,
            BLOCK_N=block_n, PAGE_SIZE=kv.page_size, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            SPLIT=splits > 1, KV_BITS=kv_bits, V_SCALE=op_scale, FULL_FIRST=full_first and not prefetch,
            PREFETCH=prefetch, num_warps=warps, **pdl(q), **({} if stages is None else {"num_stages": stages}),
        )  # fmt: skip
        return self._combine(out, part_acc, part_ml, splits, t, heads, head_dim, head_dp)

    def _prefetch(self, data: TritonCallData) -> bool:
        """Whether the call's first key block is read before the PDL wait: one-query rows only."""
        wanted = self.prefetch_decode or os.environ.get("RLT_ATTN_PREFETCH") == "1"
        return wanted and max(data.num_query) == 1

    def prompt_rows(self, dtype: torch.dtype) -> int:
        """Rows of the prompt tile for q in `dtype` (0: none). 16-bit only: the sweep timed bf16, and
        float32 (exact test models) keeps the tiles its GPU tests ran with."""
        return self.prefill_block_m if dtype.itemsize == 2 else 0

    def fp8_vector_tile(self, programs: int, splits: int) -> tuple[int, int, bool]:
        """(keys a step, warps, V loaded with K) of the float8 vector kernel. Unsplit, 32 keys a
        warp and as many warps a program (up to 4) as keep about `fp8_warps_in_flight` warps
        resident; a lone warp issues its V loads with K's, wider programs after the scores. Split
        (c=1: short key ranges): one warp, 32 keys. H100, one layer, ctx ~576, us
        (`attn_microbench.py --vector-sweep`, 2026-12-07): c=32 36.8 (128 x 4), c=64 61.8 (64 x 2),
        c=128 108.1 (32 x 1), c=1 6.7 (32 x 1, 9 splits); the earlier fixed tiles (128 x 4
        unsplit, 64 x 4 split) took 36.9, 66.7, 123.8 and 7.7, the tiled kernel 62.3, 115.3,
        219.9 and 8.0."""
        if splits > 1:
            return self.fp8_split_block_n, 1, True
        warps = 1
        while warps < 4 and programs * warps * 2 <= self.fp8_warps_in_flight:
            warps *= 2
        return 32 * warps, warps, warps == 1

    def kv_bits(self, kv_dtype: torch.dtype, q_dtype: torch.dtype) -> int:
        """How the tiled kernel takes float8 K/V: as fp16 bit patterns when q is 16-bit (the
        default, `fp8_bits`), else converted to q's dtype (float32 models: exact dots)."""
        if kv_dtype.itemsize != 1 or q_dtype == torch.float32 or not self.fp8_bits:
            return _AS_Q
        return _E4M3_BITS if kv_dtype == torch.float8_e4m3fn else _E5M2_BITS

    @staticmethod
    def _partials(splits: int, t: int, heads: int, head_dp: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 split-KV partials (accumulators, and running max and sum), or `out` twice when unsplit (not read)."""
        if splits == 1:
            return out, out
        return (torch.empty(splits, t, heads, head_dp, dtype=torch.float32, device=out.device),
                torch.empty(splits, t, heads, 2, dtype=torch.float32, device=out.device))  # fmt: skip

    @staticmethod
    def _combine(out: torch.Tensor, part_acc: torch.Tensor, part_ml: torch.Tensor, splits: int, t: int, heads: int,
                 head_dim: int, head_dp: int) -> torch.Tensor:  # fmt: skip
        if splits > 1:
            jit(_combine_kernel)[(t, heads)](
                out, part_acc, part_ml, splits, t * heads, out.stride(0), out.stride(1),
                HEAD_D=head_dim, HEAD_DP=head_dp, SPLITS_P=max(2, next_pow2(splits)), **pdl(out),
            )  # fmt: skip
        return out


def available() -> str | None:
    """None when the backend can run here, else what is missing (found without importing it)."""
    return triton_missing()
