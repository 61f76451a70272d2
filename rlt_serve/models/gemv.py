"""Decode-time projections y = x @ W^T for a few rows (M <= 8): a Triton GEMV instead of cuBLAS.

At concurrency 1 decode is a stream of weight reads: every projection reads its whole W for one
or a few activation rows, and cuBLAS reaches about 65% of the H200's copy bandwidth on these
shapes. Here each program streams BLOCK_N whole contiguous rows of W (16-byte loads along K,
fp32 accumulation) and writes BLOCK_N outputs: at M = 1 as elementwise products summed once at
the end, at M > 1 (and for gate|up) on the tensor cores as W @ x^T. Where N / BLOCK_N programs
cannot keep 132 SMs busy K may be split; a second small kernel then adds the fp32 partials in a
fixed order, so outputs never depend on scheduling (no float atomics). The gate|up projection
ends in SiLU-and-multiply: a program reads gate rows [n0, n0+B) and the matching up rows
[I+n0, I+n0+B) and writes silu(gate)*up, so the [M, 2I] intermediate is never stored. On the
H200 (recipes/gemv_bench.py) Ouro-1.4B's four projections at M = 1 take 33 us a layer-loop
against cuBLAS's 40 (with silu_mul), 3.2 against 3.85 ms a token.

Rounding is F.linear's then fused_ops.silu_mul's: each product accumulates in fp32 and rounds to
the model dtype once; gate and up round before the SiLU, the SiLU rounds, the product rounds. So
results equal the torch path up to the fp32 reduction order.

The qkv projection ends in RoPE and the K/V cache write (qkv_rope; `RLT_QKV_EPILOGUE=0` turns
it off): a program takes rotation pairs (rows j and j + head_dim/2 of one head, as gate|up pairs
gate and up rows), so the rope and write_kv launches go. (Tried and removed, recipes/ouro.md: a
norm in the projections' prologue, 7% slower at c=1; o_proj or down_proj prefetching the next
weight into L2 while waiting, 1-8% slower.)

Tile shapes are fixed per shape class (no autotuning: the calls are captured in CUDA graphs), no
host syncs, and nothing is allocated but the output (and the split-K partials) via torch.empty.
`RLT_GEMV=0` keeps F.linear everywhere.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from rlt_serve.attention.backend import KVWriteTarget
from rlt_serve.models import fused_ops
from rlt_serve.triton_jit import EXACT_ROUNDING, device_function, jit, next_pow2, pdl, triton_missing

triton: Any = None  # bound on first launch by rlt_serve.triton_jit.jit
tl: Any = None

MAX_M = 8  # the decode batch sizes the bench measured; more rows stay with cuBLAS


def max_m() -> int:
    """Most rows the GEMV serves: MAX_M, or `RLT_GEMV_MAX_M` (up to 64) to measure wider decode
    batches end to end (recipes/decode_variants.py --concurrency) before changing the default."""
    return min(64, int(os.environ.get("RLT_GEMV_MAX_M", MAX_M)))


_DTYPES = (torch.bfloat16, torch.float16)


class GemvConfig(NamedTuple):
    """Tile of one launch. mode 0: elementwise products summed at the end (M == 1 only);
    1: tl.dot(x, W^T) with x padded to 16 rows; 2: tl.dot(W, x^T) ("swap AB", W the wide operand)."""

    block_n: int
    block_k: int
    split_k: int = 1
    mode: int = 0
    num_warps: int = 4
    num_stages: int = 3


@device_function
def _rope_kv_epilogue(out_lo, out_hi, y_ptr, stride_ym, ms, m_ok, mask, rows, j0, head, cos_ptr, sin_ptr, stride_c,
                      k_cache, v_cache, slot_ptr, depth_ptr, wmask_ptr, plane_base, stride_plane, stride_slot,
                      n_q_heads, n_kv_heads, HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr, KV_WRITE: tl.constexpr,
                      HAS_WMASK: tl.constexpr):  # fmt: skip
    """A qkv program's [BLOCK_M, BLOCK_N] pair halves: q and k heads rotated with fused_ops' RoPE
    rounding (each product and the sum round to the dtype), all stored to y; with KV_WRITE k and v
    also go to each token's cache slot in its depth plane, as the Triton backend's write does
    (tokens whose write mask is 0 keep what the cache holds)."""
    half: tl.constexpr = HEAD_D // 2
    dt = y_ptr.dtype.element_ty
    x1 = out_lo.to(dt).to(tl.float32)
    x2 = out_hi.to(dt).to(tl.float32)
    d = j0 + tl.arange(0, BLOCK_N)
    roped = head < n_q_heads + n_kv_heads
    c_at = ms[:, None] * stride_c + d[None, :]
    c1 = tl.load(cos_ptr + c_at, mask=mask & roped, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + c_at + half, mask=mask & roped, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + c_at, mask=mask & roped, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + c_at + half, mask=mask & roped, other=0.0).to(tl.float32)
    y1, y2 = fused_ops.rope_pair(x1, x2, c1, c2, s1, s2, dt)
    y1 = tl.where(roped, y1, x1.to(dt))
    y2 = tl.where(roped, y2, x2.to(dt))
    y_at = y_ptr + ms[:, None] * stride_ym + rows[None, :]
    tl.store(y_at, y1, mask=mask)
    tl.store(y_at + half, y2, mask=mask)
    if KV_WRITE:
        is_v = head >= n_q_heads + n_kv_heads
        col = (head - n_q_heads - is_v.to(tl.int32) * n_kv_heads) * HEAD_D + d
        ok = m_ok & (head >= n_q_heads)
        if HAS_WMASK:
            ok = ok & (tl.load(wmask_ptr + ms, mask=m_ok, other=0) != 0)
        plane = (plane_base + tl.load(depth_ptr + ms, mask=m_ok, other=0)).to(tl.int64)
        slot = tl.load(slot_ptr + ms, mask=m_ok, other=0).to(tl.int64)
        at = (plane * stride_plane + slot * stride_slot)[:, None] + col[None, :]
        k_ok = ok[:, None] & mask & ~is_v
        v_ok = ok[:, None] & mask & is_v
        kt = k_cache.dtype.element_ty
        tl.store(k_cache + at, y1.to(kt), mask=k_ok)
        tl.store(k_cache + at + half, y2.to(kt), mask=k_ok)
        tl.store(v_cache + at, y1.to(kt), mask=v_ok)
        tl.store(v_cache + at + half, y2.to(kt), mask=v_ok)


@device_function
def _accumulate(acc, w, x, MODE: tl.constexpr):
    """acc += one W tile [BLOCK_N, BLOCK_K] times x's tile [BLOCK_M, BLOCK_K], in the mode's layout."""
    if MODE == 0:  # BLOCK_M == 1: x is [1, BLOCK_K], broadcast over the rows of W
        return acc + w.to(tl.float32) * x.to(tl.float32)
    elif MODE == 1:
        return tl.dot(x, tl.trans(w), acc)
    else:
        return tl.dot(w, tl.trans(x), acc)


def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, M, N, K, k_split, split, up_off,
    stride_xm, stride_wn, stride_ym,
    cos_ptr, sin_ptr, stride_c, k_cache, v_cache, slot_ptr, depth_ptr, wmask_ptr, plane_base,
    stride_plane, stride_slot, n_q_heads, n_kv_heads,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
    SILU: tl.constexpr, MODE: tl.constexpr, ROPE: tl.constexpr, HEAD_D: tl.constexpr, KV_WRITE: tl.constexpr,
    HAS_WMASK: tl.constexpr, PAIRED: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr,
):  # fmt: skip
    """Program (n block, k split): outputs [n0, n0+BLOCK_N) over K range [s*k_split, (s+1)*k_split).
    With SILU, up rows sit `up_off` rows below the gate rows. PARTIAL stores fp32 partials
    [split, M, N] (with SILU the up partials follow, another [split, M, N]) for _reduce_kernel.
    With ROPE (a qkv projection) a program takes BLOCK_N rotation pairs of one head, rows j and
    j + HEAD_D/2 (as SILU takes gate and up rows), and ends in _rope_kv_epilogue. PAIRED: SILU or ROPE.
    With PDL the first W tile is loaded before waiting for the kernel that wrote x (MODE 0, and
    the tensor-core modes with PRELOAD)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ROPE:
        head = pid_n // (HEAD_D // 2 // BLOCK_N)
        j0 = pid_n % (HEAD_D // 2 // BLOCK_N) * BLOCK_N
        rows = head * HEAD_D + j0 + tl.arange(0, BLOCK_N)
    else:
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rows < N
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + ms[:, None] * stride_xm
    k_lo = pid_k * k_split
    if MODE == 0:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    elif MODE == 1:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = k_lo
    if PDL and (MODE == 0 or PRELOAD):  # the first tile of W streams in while the previous kernel drains
        ks = k_lo + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)
        if PAIRED:
            wu = tl.load(w_rows + up_off * stride_wn + ks[None, :], mask=w_mask, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        if MODE == 0 or PRELOAD:
            x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _accumulate(acc, w, x, MODE)
            if PAIRED:
                acc_u = _accumulate(acc_u, wu, x, MODE)
            k_start = k_lo + BLOCK_K
    for k0 in range(k_start, k_lo + k_split, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)
        acc = _accumulate(acc, w, x, MODE)
        if PAIRED:
            wu = tl.load(w_rows + up_off * stride_wn + ks[None, :], mask=w_mask, other=0.0)
            acc_u = _accumulate(acc_u, wu, x, MODE)
    # -> [BLOCK_M, BLOCK_N]
    if MODE == 0:
        out = tl.sum(acc, 1)[None, :]
        out_u = tl.sum(acc_u, 1)[None, :]
    elif MODE == 1:
        out = acc
        out_u = acc_u
    else:
        out = tl.trans(acc)
        out_u = tl.trans(acc_u)
    mask = m_ok[:, None] & n_ok[None, :]
    if ROPE:  # never split (see epilogue_fits)
        _rope_kv_epilogue(out, out_u, y_ptr, stride_ym, ms, m_ok, mask, rows, j0, head, cos_ptr, sin_ptr, stride_c,
                          k_cache, v_cache, slot_ptr, depth_ptr, wmask_ptr, plane_base, stride_plane, stride_slot,
                          n_q_heads, n_kv_heads, HEAD_D, BLOCK_N, KV_WRITE, HAS_WMASK)  # fmt: skip
    elif not PARTIAL:
        dt = y_ptr.dtype.element_ty
        if SILU:
            g = out.to(dt).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dt)
            res = (s.to(tl.float32) * out_u.to(dt).to(tl.float32)).to(dt)
        else:
            res = out.to(dt)
        tl.store(y_ptr + ms[:, None] * stride_ym + rows[None, :], res, mask=mask)
    else:
        part = part_ptr + (pid_k * M + ms[:, None]) * N + rows[None, :]
        tl.store(part, out, mask=mask)
        if SILU:
            tl.store(part + split * M * N, out_u, mask=mask)


def _reduce_kernel(
    part_ptr, y_ptr, M, N, split, stride_ym, SILU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    """Program (row, n block): the fp32 partials added in split order, then the epilogue."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(split):
        acc += tl.load(part_ptr + (s * M + m) * N + cols, mask=ok, other=0.0)
        if SILU:
            acc_u += tl.load(part_ptr + ((split + s) * M + m) * N + cols, mask=ok, other=0.0)
    dt = y_ptr.dtype.element_ty
    if SILU:
        g = acc.to(dt).to(tl.float32)
        sg = (g / (1.0 + tl.exp(-g))).to(dt)
        res = (sg.to(tl.float32) * acc_u.to(dt).to(tl.float32)).to(dt)
    else:
        res = acc.to(dt)
    tl.store(y_ptr + m * stride_ym + cols, res, mask=ok)


@functools.lru_cache(maxsize=4)
def _tile_overrides(spec: str) -> dict[tuple[int, int, bool], GemvConfig]:
    """`RLT_GEMV_TILES` = "NxK=n,k,split,mode,warps,stages;..." (N output columns, `NxK:silu` for
    gate|up): tiles for M=1 calls of those weights, so recipes/decode_variants.py can time a tile
    from recipes/gemv_bench.py end to end before it becomes a default."""
    out: dict[tuple[int, int, bool], GemvConfig] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        try:
            shape, tile = item.split("=")
            dims, _, kind = shape.partition(":")
            n, k = (int(v) for v in dims.lower().split("x"))
            fields = [int(v) for v in tile.split(",")]
            if len(fields) != len(GemvConfig._fields):
                raise ValueError(f"{len(fields)} numbers")
            out[n, k, kind == "silu"] = GemvConfig(*fields)
        except (ValueError, TypeError) as e:
            raise ValueError(f"RLT_GEMV_TILES: cannot read {item!r} (want NxK[:silu]=n,k,split,mode,warps,stages)") from e
    return out


def default_config(m: int, n: int, k: int, silu: bool) -> GemvConfig:
    """Tiles per shape class, fixed from recipes/gemv_bench.py on the H200 (2026-12-03; Ouro gate|up
    2026-12-04; GB/s at M=1 against cuBLAS in the comments). `n` counts output columns (for gate|up:
    the intermediate size). Ouro's o_proj takes K whole in one tile (2026-12-04): under PDL its
    programs launch while attention still runs and stream all of W before waiting for it, which
    took c=1 decode from 5.46 to 4.93 ms a step (recipes/ouro.md); alone it is no faster."""
    if m == 1 and (spec := os.environ.get("RLT_GEMV_TILES")):
        override = _tile_overrides(spec).get((n, k, silu))
        if override is not None:
            return override
    rows = 2 * n if silu else n  # rows of W streamed
    if silu:  # gate|up, 64 or 128 output columns a program, W @ x^T on the tensor cores
        if k >= 3072:
            return GemvConfig(128, 64, 1, mode=2, num_warps=4, num_stages=5)  # Nanbeige 3904 (3755)
        return GemvConfig(64, 64, 1, mode=2, num_warps=4, num_stages=6)  # Ouro 3650 (3036 + silu_mul)
    if m == 1:
        if rows <= 4096 and k <= 2048:  # Ouro o_proj: each program's whole W slice loads before the PDL wait
            return GemvConfig(8, 2048, 1, mode=0, num_warps=8, num_stages=1)  # (see below)
        if rows <= 4096:  # o_proj, down: longer rows, so more bytes in flight per program
            return GemvConfig(8, 1024, 1, mode=0, num_warps=8, num_stages=1)  # Ouro o 1975 (1381), down 2825 (2231)
        if k >= 3072:
            return GemvConfig(64, 128, 1, mode=2, num_warps=4, num_stages=4)  # Nanbeige qkv 3534 (3469)
        return GemvConfig(8, 512, 1, mode=0, num_warps=4, num_stages=1)  # Ouro qkv 3277 (2839)
    if m > 8:  # RLT_GEMV_MAX_M: x fills a tensor-core operand, as in recipes/gemv_bench.py --m
        return GemvConfig(64, 64, 1, mode=2, num_warps=4, num_stages=4)
    if rows <= 4096:  # only with long rows (see cublas_wins): split K so 132 SMs have work
        return GemvConfig(64, 128, 2, mode=2, num_warps=4, num_stages=4)  # Nanbeige o/down, M=2..8: +3..8%
    return GemvConfig(64, 128, 1, mode=2, num_warps=4, num_stages=4)  # qkv M=2..8: +1..4%


def cublas_wins(m: int, rows: int, k: int) -> bool:
    """Where the bench found no tile beating cuBLAS: several rows of a short, narrow W (Ouro's
    o_proj and down at M=2..8 tie or lose by 4%)."""
    return m > 1 and rows <= 4096 and k < 6144


def gemv(
    x: torch.Tensor, w: torch.Tensor, silu: bool = False, config: GemvConfig | None = None,
    epilogue: QKVEpilogue | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ w[N, K]^T -> [M, N]; with `silu`, w is gate|up [2I, K] and the result
    silu(x @ gate^T) * (x @ up^T) [M, I]; with an `epilogue` (a qkv projection, see epilogue_fits)
    q and k come out rotated and K/V written. Any device Triton runs on (the CPU interpreter too)."""
    m, k = x.shape
    rows, kw = w.shape
    if kw != k or (silu and rows % 2):
        raise ValueError(f"gemv: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit (silu={silu})")
    if epilogue is not None and (silu or not epilogue_fits(m, w, epilogue, config)):
        raise ValueError(f"gemv: the qkv epilogue does not fit w {tuple(w.shape)} at M={m}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    n = rows // 2 if silu else rows
    cfg = config or default_config(m, n, k, silu)
    if cfg.mode == 0 and m != 1:
        raise ValueError("gemv: the elementwise mode (0) takes one row")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m = 1 if cfg.mode == 0 else max(16, next_pow2(m))
    k_split, split = _k_split(k, cfg)
    part = torch.empty((2 if silu else 1) * split * m * n, dtype=torch.float32, device=x.device) if split > 1 else y
    epi = epilogue
    kvw = epi.kv if epi is not None else None
    cos, sin = (epi.cos, epi.sin) if epi is not None else (x, x)
    block_n = cfg.block_n // 2 if epi is not None else cfg.block_n  # a pair of rows each
    grid = (-(-n // cfg.block_n), split)
    launch = pdl(x)
    jit(_gemv_kernel)[grid](
        x, w, y, part, m, n, k, k_split, split, epi.head_dim // 2 if epi is not None else n,
        x.stride(0), w.stride(0), y.stride(0),
        cos, sin, cos.stride(0), *(kvw[:4] if kvw is not None else (x, x, x, x)),
        kvw.write_mask if kvw is not None and kvw.write_mask is not None else x,
        *((kvw.plane_base, kvw.k_cache.stride(0), kvw.k_cache.stride(1)) if kvw is not None else (0, 0, 0)),
        epi.heads if epi is not None else 0, epi.kv_heads if epi is not None else 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k, PARTIAL=split > 1, SILU=silu, MODE=cfg.mode,
        ROPE=epi is not None, HEAD_D=epi.head_dim if epi is not None else 2, KV_WRITE=kvw is not None,
        HAS_WMASK=kvw is not None and kvw.write_mask is not None, PAIRED=silu or epi is not None,
        PRELOAD=cfg.mode != 0 and preload_tensor_core(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch, **(EXACT_ROUNDING if epi is not None else {}),
    )  # fmt: skip
    if split > 1:
        block = min(1024, next_pow2(n))
        jit(_reduce_kernel)[(m, triton.cdiv(n, block))](
            part, y, m, n, split, y.stride(0), SILU=silu, BLOCK=block, num_warps=4, **launch
        )
    return y


class QKVEpilogue(NamedTuple):
    """RoPE of q and k, and with `kv` the K/V cache write, done by the qkv GEMV on its outputs."""

    cos: torch.Tensor  # [T, head_dim], the model dtype
    sin: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    kv: KVWriteTarget | None


def epilogue_fits(m: int, w: torch.Tensor, epilogue: QKVEpilogue, config: GemvConfig | None = None) -> bool:
    """Whether a qkv GEMV of `m` rows can take the epilogue: its tile splits neither K nor a head's
    rotation halves (and tl.dot tiles keep 16 rows)."""
    n, k = w.shape
    e = epilogue
    cfg = config or default_config(m, n, k, False)
    half, block = e.head_dim // 2, cfg.block_n // 2
    return (
        n == (e.heads + 2 * e.kv_heads) * e.head_dim
        and e.head_dim % 2 == 0
        and block >= (1 if cfg.mode == 0 else 16)
        and half % block == 0
        and _k_split(k, cfg)[1] == 1
    )


def _k_split(k: int, cfg: GemvConfig) -> tuple[int, int]:
    """(K per split, splits): whole K blocks per split."""
    k_split = -(-k // (cfg.split_k * cfg.block_k)) * cfg.block_k
    return k_split, -(-k // k_split)


def preload_tensor_core() -> bool:
    """`RLT_GEMV_PRELOAD=1`: the tensor-core tiles (gate|up at M=1, every tile at M>1) also load
    their first W tile before the PDL wait, as the elementwise tiles do; off until measured."""
    return os.environ.get("RLT_GEMV_PRELOAD", "0") == "1"


def use_gemv(x: torch.Tensor, w: torch.Tensor, silu: bool = False) -> bool:
    """Decode-sized CUDA inputs; with `RLT_GEMV=interpret` also the CPU (Triton's interpreter, any
    float dtype), so the layers' fused paths run in CPU tests."""
    interpret = os.environ.get("RLT_GEMV") == "interpret" and os.environ.get("TRITON_INTERPRET") == "1"
    return (
        (x.is_cuda or (interpret and x.device.type == "cpu"))
        and x.dim() == 2
        and x.shape[0] <= max_m()
        and (x.dtype in _DTYPES or (interpret and x.dtype == torch.float32))
        and w.dtype == x.dtype
        and (silu or not cublas_wins(x.shape[0], w.shape[0], w.shape[1]))
        and os.environ.get("RLT_GEMV", "1") != "0"
        and triton_missing() is None
    )


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) (no bias), through the GEMV for decode-sized CUDA inputs."""
    return gemv(x, w) if use_gemv(x, w) else F.linear(x, w)


def gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul(F.linear(x, gate_up)) for a fused gate|up weight, one kernel at decode sizes."""
    return gemv(x, gate_up, silu=True) if use_gemv(x, gate_up, silu=True) else fused_ops.silu_mul(F.linear(x, gate_up))


def qkv_epilogue() -> bool:
    """Whether the qkv GEMV rotates q and k and writes K/V itself (on; `RLT_QKV_EPILOGUE=0` turns
    it off): it saves the RoPE and KV-write launches, 0.13 ms of a c=1 token (recipes/ouro.md)."""
    return os.environ.get("RLT_QKV_EPILOGUE", "1") != "0"


def qkv_rope(x: torch.Tensor, w: torch.Tensor, epilogue: QKVEpilogue) -> tuple[torch.Tensor, bool]:
    """(qkv, done) of a call the GEMV serves (the caller checked use_gemv and qkv_epilogue, so
    prefill builds no epilogue): where the tile fits, one kernel whose q and k come out rotated
    and, where `epilogue.kv`, K/V written (done True); otherwise the plain GEMV, for the caller
    to rotate and write."""
    if epilogue_fits(x.shape[0], w, epilogue):
        return gemv(x, w, epilogue=epilogue), True
    return gemv(x, w), False
