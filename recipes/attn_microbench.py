"""Attention-kernel microbenchmark on the Ouro-1.4B plane layout (bf16, 96 planes, page 16; other
head shapes through ATTN_SHAPE).

Times one layer's attention call per backend for the three shapes that matter (decode at
concurrency 1 and 64 with ~576 tokens of context, and a 8192-token prefill of 16 prompts),
and the KV write alone (Triton kernel vs torch index_copy_), against bandwidth/FLOP floors.
Usage: python recipes/attn_microbench.py [backend ...]
       python recipes/attn_microbench.py --sweep   (Triton decode: block_n x num_warps x num_stages)
       python recipes/attn_microbench.py --sweep-splits   (c=1 decode: kernel x split-KV key range)
       python recipes/attn_microbench.py --fp8   (bf16 vs float8 KV: conversion vs bit operands, tiles)
       python recipes/attn_microbench.py --vector-sweep [64:1,32:1 [repeats]]   (vector kernel: key step x warps)
       python recipes/attn_microbench.py --prefill-sweep   (tiled kernel: prompt tile, unmasked key blocks)
"""

from __future__ import annotations

import itertools
import os
import random
import sys
from typing import Any

import torch
from triton.testing import do_bench

from rlt_serve.attention.backend import RowSpec, get_attention_backend
from rlt_serve.attention.flash_backend import write_kv
from rlt_serve.engine.cuda_graph import capture
from rlt_serve.engine.kv_cache import KVCache

# Ouro-1.4B's attention; ATTN_SHAPE=heads:kv_heads:head_dim times another family's (Nanbeige 48:8:128, Huginn 55:55:96)
HEADS, KV_HEADS, HEAD_DIM = (int(x) for x in os.environ.get("ATTN_SHAPE", "16:16:128").split(":"))
LAYERS, LOOPS, PAGE = 24, 4, 16
BW, FLOPS = 4.2e12, 790e12
DEV, DT = torch.device("cuda"), torch.bfloat16


def device_us(fn, reps: int = 20) -> float:
    """Kernel time of one call: `reps` calls captured in a CUDA graph and replayed, so the Python
    launch overhead (larger than the kernel at small shapes) is not what is timed."""
    graph, _ = capture(lambda: [fn() for _ in range(reps)])
    return 1e3 * do_bench(graph.replay) / reps


def layer_us(head: str, backend: Any, meta: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             kv: KVCache) -> float | None:
    """One layer's attention call (layer 5), graph-timed; None, after printing `head` and the
    error, when the tile does not compile (out of shared memory or registers)."""
    try:
        return device_us(lambda: backend.forward(q, k, v, kv, 5, meta, HEAD_DIM**-0.5))
    except Exception as e:  # noqa: BLE001  (Triton's OutOfResources and compile errors alike)
        print(f"{head}  {type(e).__name__}")
        return None


def shapes() -> dict[str, list[tuple[int, int, int]]]:
    """name -> rows as (num_query, start_pos, depth_slot)."""
    rng = random.Random(0)
    return {
        "decode c=1 ctx 576": [(1, 575, 2)],
        "decode c=64 ctx ~576": [(1, rng.randint(512, 640), rng.randrange(LOOPS)) for _ in range(64)],
        "prefill 16x512": [(512, 0, d % LOOPS) for d in range(16)],
    }


def paged_cache(pages: int = 64 * 41 + 64, dtype: torch.dtype = DT) -> tuple[KVCache, list[int]]:
    """The Ouro plane layout (layer 5's planes are the ones timed) and its pages in shuffled order,
    so a row's pages are scattered as they are after a server has run a while."""
    kv = KVCache([LOOPS] * 8, pages, PAGE, KV_HEADS, HEAD_DIM, dtype, DEV)
    if dtype.itemsize == 1:
        for t in (kv.k, kv.v):
            t.copy_(torch.randn(t.shape, device=DEV).to(dtype))
    free = list(range(kv.num_pages))
    random.Random(1).shuffle(free)
    return kv, free


def kv_floor_us(tokens: int) -> float:
    """Time to read `tokens` positions of one layer's K and V at peak bandwidth."""
    return 1e6 * tokens * 2 * KV_HEADS * HEAD_DIM * DT.itemsize / BW


def call_floor_us(rows: list[RowSpec]) -> float:
    """One layer's attention call at peak: the slower of reading its K/V and its QK^T and PV FLOPs."""
    flops = sum(4 * HEADS * HEAD_DIM * r.num_query * (r.start_pos + (r.num_query + 1) / 2) for r in rows)
    return max(kv_floor_us(sum(r.end_pos for r in rows)), 1e6 * flops / FLOPS)


Inputs = tuple[list[RowSpec], torch.Tensor, torch.Tensor, torch.Tensor]


def shape_inputs(spec: list[tuple[int, int, int]], free: list[int]) -> Inputs:
    """Rows of one microbench shape (each on its own run of the shuffled pages) and random q, k, v
    for its new tokens."""
    starts = [0]
    for n, s, _ in spec:
        starts.append(starts[-1] + -(-(s + n) // PAGE))
    rows = [RowSpec(n, s, d, free[a:b]) for (n, s, d), a, b in zip(spec, starts, starts[1:])]
    t = sum(r.num_query for r in rows)
    q = torch.randn(t, HEADS, HEAD_DIM, device=DEV, dtype=DT)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, device=DEV, dtype=DT)
    return rows, q, k, torch.randn_like(k)


def main(backends: list[str]) -> None:
    kv, free = paged_cache()
    print(f"{'shape':<24}{'backend':<12}{'us':>9}{'floor us':>10}{'of floor':>9}")
    for name, spec in shapes().items():
        rows, q, k, v = shape_inputs(spec, free)
        floor_us = call_floor_us(rows)
        for b in backends:
            backend = get_attention_backend(b, DEV, DT, PAGE)
            meta = backend.prepare(rows, kv)
            us = device_us(lambda b=backend, m=meta: b.forward(q, k, v, kv, 5, m, HEAD_DIM**-0.5))  # noqa: B023
            print(f"{name:<24}{b:<12}{us:>9.1f}{floor_us:>10.1f}{floor_us / us:>9.1%}")
        # the KV write alone: the Triton kernel vs torch index_copy_ (floor: read + write K and V)
        write_floor = 1e6 * 4 * k.nbytes / BW
        triton_backend = get_attention_backend("triton", DEV, DT, PAGE)
        meta = triton_backend.prepare(rows, kv)
        us = device_us(lambda: triton_backend.write(k, v, kv, 5, meta))  # noqa: B023  (called at once)
        print(f"{name:<24}{'write:triton':<12}{us:>9.1f}{write_floor:>10.1f}{write_floor / us:>9.1%}")
        k_all, v_all = kv.k.view(-1, KV_HEADS, HEAD_DIM), kv.v.view(-1, KV_HEADS, HEAD_DIM)
        index = (meta.token_depth_slot + kv.plane_base(5)) * (kv.num_pages * PAGE) + meta.slot_mapping
        us = device_us(lambda: write_kv(k_all, v_all, k, v, index, None))  # noqa: B023  (called at once)
        print(f"{name:<24}{'write:torch':<12}{us:>9.1f}{write_floor:>10.1f}{write_floor / us:>9.1%}")


def tuned_backend(kernel: str, **knobs: int) -> Any:
    """A Triton backend running `kernel` (tiled, vector or vec-rows) with tile knobs set on the
    instance, so the class defaults stay as they are."""
    backend = get_attention_backend("triton", DEV, DT, PAGE)
    backend.decode_mha, backend.heads_first = kernel != "tiled", kernel == "vector"
    for name, value in knobs.items():
        setattr(backend, name, value)
    return backend


def fixed_tile(backend: Any, block_n: int, warps: int, v_with_k: bool) -> Any:
    """`backend` with its float8 vector kernel held to one tile (instead of fp8_vector_tile's choice)."""
    backend.fp8_vector_tile = lambda programs, splits: (block_n, warps, v_with_k)
    backend.block_n, backend.num_warps, backend.v_with_k = block_n, warps, v_with_k
    return backend


def sweep() -> None:
    """The Triton kernel's tile knobs on the decode shapes, to choose the class defaults."""
    kv, free = paged_cache()
    print(f"{'shape':<24}{'kernel':>8}{'block_n':>8}{'warps':>6}{'stages':>7}{'us':>9}{'of floor':>9}")
    for name, spec in list(shapes().items())[:2]:
        rows = [RowSpec(n, s, d, free[i * 41 : i * 41 + -(-(s + n) // PAGE)]) for i, (n, s, d) in enumerate(spec)]
        t = len(rows)
        q = torch.randn(t, HEADS, HEAD_DIM, device=DEV, dtype=DT)
        k = torch.randn(t, KV_HEADS, HEAD_DIM, device=DEV, dtype=DT)
        v = torch.randn_like(k)
        floor_us = kv_floor_us(sum(r.end_pos for r in rows))
        configs = [(k, *c) for k in ("vector", "vec-rows") for c in itertools.product((64, 128), (2, 4), (2, 3))]
        configs += [("tiled", *c) for c in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]
        for kernel, block_n, warps, stages in configs:
            backend = tuned_backend(kernel, block_n=block_n, num_warps=warps, num_stages=stages)
            head = f"{name:<24}{kernel:>8}{block_n:>8}{warps:>6}{stages:>7}"
            if (us := layer_us(head, backend, backend.prepare(rows, kv), q, k, v, kv)) is not None:
                print(f"{head}{us:>9.1f}{floor_us / us:>9.1%}")


def sweep_splits() -> None:
    """Concurrency-1 decode is latency-bound: which kernel and how many keys per split-KV program
    (`min_split_keys`, so the number of splits) are fastest at short and long contexts."""
    kv, free = paged_cache(64 * 41 + 64 + 1024)
    q, k = (torch.randn(1, h, HEAD_DIM, device=DEV, dtype=DT) for h in (HEADS, KV_HEADS))
    v = torch.randn_like(k)
    print(f"{'context':>8}{'kernel':>9}{'split keys':>11}{'splits':>7}{'us':>8}{'of floor':>9}")
    for ctx in (576, 2048, 8192):
        rows = [RowSpec(1, ctx - 1, 2, free[: -(-ctx // PAGE)])]
        floor_us = kv_floor_us(ctx)
        for kernel, split_keys in itertools.product(("tiled", "vector", "vec-rows"), (32, 64, 128, 256, 10**6)):
            backend = tuned_backend(kernel, min_split_keys=split_keys, max_splits=64)
            splits = backend.num_splits(HEADS, ctx, DEV)
            head = f"{ctx:>8}{kernel:>9}{split_keys:>11}{splits:>7}"
            if (us := layer_us(head, backend, backend.prepare(rows, kv), q, k, v, kv)) is not None:
                print(f"{head}{us:>8.1f}{floor_us / us:>9.1%}")


def fp8() -> None:
    """bf16 against float8 KV on the decode and prefill shapes: float8 converted to bf16 in the
    kernel (`fp8_bits` off) or moved into fp16 operands bit by bit, over a few tiles; decode
    shapes also through the vector kernel (fp32 products, no matrix tile)."""
    print(f"{'shape':<24}{'kv':>7}{'operands':>10}{'block_n':>8}{'stages':>7}{'us':>9}{'bf16 KV floor':>14}")
    for kv_dtype in (DT, torch.float8_e4m3fn, torch.float8_e5m2):
        kv, free = paged_cache(dtype=kv_dtype)
        for name, spec in shapes().items():
            rows, q, k, v = shape_inputs(spec, free)
            floor_us = kv_floor_us(sum(r.end_pos for r in rows))
            modes = ["-"] if kv_dtype == DT else ["convert", "bits"]
            if spec[0][0] == 1:  # one query per row: the vector kernel converts as it loads
                modes.append("vector")
            for mode, block_n, stages in itertools.product(modes, (64, 128), (None, 3)):
                backend = tuned_backend("vector" if mode == "vector" else "tiled", block_n=block_n, num_stages=stages,
                                        fp8_decode_mha=mode == "vector")
                if mode == "vector":
                    fixed_tile(backend, block_n, 4, False)
                backend.fp8_bits = mode == "bits"
                meta = backend.prepare(rows, kv)
                head = f"{name:<24}{str(kv_dtype)[6:13]:>7}{mode:>10}{block_n:>8}{stages!s:>7}"
                if (us := layer_us(head, backend, meta, q, k, v, kv)) is not None:
                    print(f"{head}{us:>9.1f}{floor_us:>14.1f}")


def vector_sweep(tiles: list[tuple[int, int]], repeats: int) -> None:
    """The vector kernel's key step and warps where its KV reads are most of a decode step
    (c=32..128, unsplit) and at c=1 (split), for float8 and bf16 KV, with the tiled kernel's
    default beside it; `repeats` rounds over the same tiles show the run-to-run spread."""
    print(f"{'shape':<8}{'kv':>6}{'kernel':>8}{'block_n':>8}{'warps':>6}{'splits':>7}{'us':>9}{'KV floor':>9}{'of floor':>9}")
    for kv_dtype in (torch.float8_e4m3fn, DT):
        kv, free = paged_cache(128 * 41 + 64, dtype=kv_dtype)
        rng = random.Random(0)
        for c in (1, 32, 64, 128):
            spec = [(1, 575, 2)] if c == 1 else [(1, rng.randint(512, 640), rng.randrange(LOOPS)) for _ in range(c)]
            rows, q, k, v = shape_inputs(spec, free)
            floor_us = kv_floor_us(sum(r.end_pos for r in rows)) * kv_dtype.itemsize / DT.itemsize
            configs = [("tiled", 64, 4), ("default", 0, 0)]
            configs += [(kernel, *t) for kernel in ("v-early", "v-late") for t in tiles]
            for _, (kernel, block_n, warps) in itertools.product(range(repeats), configs):
                if kernel == "default":  # the class defaults: fp8_vector_tile's choice for float8
                    backend = get_attention_backend("triton", DEV, DT, PAGE)
                else:
                    backend = tuned_backend(kernel, heads_first=True, fp8_decode_mha=kernel != "tiled")
                    if kernel != "tiled":
                        fixed_tile(backend, block_n, warps, kernel == "v-early")
                meta = backend.prepare(rows, kv)
                splits = backend.num_splits(c * HEADS, meta.extra.max_end, DEV)
                if kernel == "default":
                    block_n, warps = (backend.fp8_vector_tile(c * HEADS, splits)[:2] if kv.quantized
                                      else (backend.block_n, backend.num_warps))
                head = f"c={c:<6}{str(kv_dtype)[6:13]:>6}{kernel:>8}{block_n:>8}{warps:>6}{splits:>7}"
                if (us := layer_us(head, backend, meta, q, k, v, kv)) is not None:
                    print(f"{head}{us:>9.1f}{floor_us:>9.1f}{floor_us / us:>9.1%}")
        del kv
        torch.cuda.empty_cache()


def prefill_sweep() -> None:
    """The tiled kernel on prompt spans (fresh prompts and a chunk after a long cached prefix):
    the prompt tile off (64 rows, 32 keys, masked loop alone: before 2026-12-07) and its (rows,
    key step, warps, stages), with or without the unmasked-block loop; and the decode shapes,
    which keep their tiles. FlashAttention (gathered K/V) for scale."""
    kv, free = paged_cache(64 * 41 + 64 + 1024)
    prompt_shapes = {
        "prefill 16x512": [(512, 0, d % LOOPS) for d in range(16)],
        "prefill 4x2048": [(2048, 0, d % LOOPS) for d in range(4)],
        "prefill 1x8192": [(8192, 0, 1)],
        "chunk 2048 @ 6144": [(2048, 6144, 3)],
    }
    decode_shapes = dict(list(shapes().items())[:2])
    print(f"{'shape':<20}{'kernel':<8}{'rows':>5}{'keys':>5}{'warps':>6}{'stages':>7}{'full':>6}{'us':>9}"
          f"{'floor us':>9}{'of floor':>9}")  # fmt: skip
    configs: list[tuple[str, int, int, int, int | None, bool]] = [("off", 0, 0, 4, None, False)]
    configs += [("prompt", m, n, w, st, full) for m, n, w, st in ((64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 4, 2),
                (128, 128, 8, 3), (64, 64, 4, 1)) for full in (True, False)]  # fmt: skip
    for name, spec in {**prompt_shapes, **decode_shapes}.items():
        rows, q, k, v = shape_inputs(spec, free)
        floor_us = call_floor_us(rows)
        decode = spec[0][0] == 1
        for kernel, block_m, block_n, warps, stages, full in configs[:1] if decode else configs:
            backend = get_attention_backend("triton", DEV, DT, PAGE)
            if kernel == "off":  # decode shapes run only this: decode rows never take the prompt tile
                backend.prefill_block_m = 0
            else:
                for knob, value in (("block_m", block_m), ("block_n", block_n), ("gqa_block_n", block_n), ("warps", warps),
                                    ("stages", stages), ("full_first", full)):  # fmt: skip
                    setattr(backend, f"prefill_{knob}", value)
            head = f"{name:<20}{kernel:<8}{block_m or 64:>5}{block_n or 32:>5}{warps:>6}{stages!s:>7}{full!s:>6}"
            if (us := layer_us(head, backend, backend.prepare(rows, kv), q, k, v, kv)) is not None:
                print(f"{head}{us:>9.1f}{floor_us:>9.1f}{floor_us / us:>9.1%}")
        if not decode:
            backend = get_attention_backend("flash-attn", DEV, DT, PAGE)
            head = f"{name:<20}{'flash':<8}{'':>29}"
            if (us := layer_us(head, backend, backend.prepare(rows, kv), q, k, v, kv)) is not None:
                print(f"{head}{us:>9.1f}{floor_us:>9.1f}{floor_us / us:>9.1%}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--sweep"]:
        sweep()
    elif sys.argv[1:] == ["--sweep-splits"]:
        sweep_splits()
    elif sys.argv[1:] == ["--fp8"]:
        fp8()
    elif sys.argv[1:] == ["--prefill-sweep"]:
        prefill_sweep()
    elif sys.argv[1:2] == ["--vector-sweep"]:  # [block_n:warps,... [repeats]]
        tiles = [(32, 1), (64, 1), (128, 1), (64, 2), (128, 4)]
        if sys.argv[2:]:
            tiles = [(int(b), int(w)) for b, w in (t.split(":") for t in sys.argv[2].split(","))]
        vector_sweep(tiles, int(sys.argv[3]) if sys.argv[3:] else 1)
    else:
        main(sys.argv[1:] or ["torch", "triton", "flash-attn"])
