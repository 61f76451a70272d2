"""Decode projections on the H200: cuBLAS F.linear against rlt_serve.models.gemv, and its tile choices.

For each weight shape of Ouro-1.4B, Nanbeige4.2-3B and Huginn-0125 and M = 1, 2, 4, 8 rows, one CUDA graph
holds CALLS back-to-back calls over distinct weight copies (at least L2_FLOOR bytes of them, so
L2, 50 MB, never holds the weight a call reads: Ouro's o_proj is only 8 MB). Times are graph
replays over CUDA events, per call. gate_up is timed as the engine's current path (F.linear then
fused_ops.silu_mul) against the fused GEMV. Every GEMV tile in CANDIDATES is tried, the best is
printed, and the outputs are checked against F.linear.

    python recipes/gemv_bench.py [--quick] [--m 16,32,64] [--only ouro]

`--m` picks the row counts (past MAX_M, where the engine uses cuBLAS, to see whether the GEMV's
tensor-core modes would win there too); `--only` keeps the shapes whose name starts with it.
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from rlt_serve.engine.cuda_graph import capture
from rlt_serve.models import fused_ops
from rlt_serve.models.gemv import GemvConfig, default_config, gemv

DEV, DT = torch.device("cuda"), torch.bfloat16
CALLS, REPLAYS, L2_FLOOR = 100, 5, 256 << 20
LAYER_LOOPS = 24 * 4  # Ouro-1.4B: 24 layers x 4 loops per decoded token

# name -> (N rows of W, K, silu); for gate_up N is 2 * intermediate
SHAPES = {
    "ouro qkv": (6144, 2048, False),
    "ouro o": (2048, 2048, False),
    "ouro gate_up": (11264, 2048, True),
    "ouro down": (2048, 5632, False),
    "nanb qkv": ((48 + 8 + 8) * 128, 3072, False),
    "nanb o": (3072, 6144, False),
    "nanb gate_up": (21504, 3072, True),
    "nanb down": (3072, 10752, False),
    "hug qkv": (3 * 5280, 5280, False),
    "hug o": (5280, 5280, False),
    "hug adapter": (5280, 2 * 5280, False),
    "hug gate_up": (2 * 17920, 5280, True),
    "hug down": (5280, 17920, False),
}

# (block_n, block_k, split_k, mode, num_warps, num_stages), by (M == 1, silu)
CANDIDATES = {
    (True, False): [
        GemvConfig(8, 512, 1, 0, 4, 1), GemvConfig(4, 1024, 1, 0, 4, 1), GemvConfig(8, 1024, 1, 0, 8, 1),
        GemvConfig(8, 512, 2, 0, 4, 1), GemvConfig(4, 512, 1, 0, 2, 1), GemvConfig(16, 512, 1, 0, 4, 1),
        GemvConfig(8, 256, 1, 0, 2, 1), GemvConfig(8, 512, 1, 0, 4, 2), GemvConfig(64, 128, 1, 2, 4, 4),
        # narrow tensor-core tiles, deep pipelines: more W bytes in flight per program than mode 0's
        GemvConfig(16, 256, 1, 2, 4, 4), GemvConfig(16, 256, 1, 2, 4, 6), GemvConfig(16, 512, 1, 2, 4, 3),
        GemvConfig(32, 128, 1, 2, 4, 6), GemvConfig(32, 256, 1, 2, 4, 4), GemvConfig(16, 128, 1, 2, 4, 8),
        GemvConfig(32, 256, 1, 2, 8, 5), GemvConfig(16, 512, 1, 2, 8, 4),
    ],
    (True, True): [
        GemvConfig(4, 512, 1, 0, 4, 1), GemvConfig(8, 512, 1, 0, 4, 1), GemvConfig(4, 1024, 1, 0, 8, 1),
        GemvConfig(64, 128, 1, 2, 4, 4), GemvConfig(32, 128, 1, 2, 4, 4), GemvConfig(32, 256, 1, 2, 4, 3),
        GemvConfig(64, 64, 1, 2, 4, 6), GemvConfig(128, 64, 1, 2, 4, 5), GemvConfig(4, 512, 1, 0, 2, 1),
    ],
    (False, False): [
        GemvConfig(64, 128, 1, 2, 4, 4), GemvConfig(32, 128, 1, 2, 4, 4), GemvConfig(128, 64, 1, 2, 4, 5),
        GemvConfig(64, 64, 1, 2, 4, 6), GemvConfig(32, 128, 2, 2, 4, 4), GemvConfig(16, 256, 1, 1, 4, 4),
        GemvConfig(16, 128, 1, 1, 4, 6), GemvConfig(32, 256, 1, 2, 8, 3), GemvConfig(64, 128, 2, 2, 4, 4),
    ],
    (False, True): [
        GemvConfig(64, 128, 1, 2, 4, 4), GemvConfig(32, 128, 1, 2, 4, 4), GemvConfig(128, 64, 1, 2, 4, 5),
        GemvConfig(64, 64, 1, 2, 4, 6), GemvConfig(32, 256, 1, 2, 8, 3), GemvConfig(16, 128, 1, 1, 4, 6),
    ],
}  # fmt: skip
# past MAX_M (16..64 rows): x is a real tensor-core operand, so wider tiles and more warps
WIDE = [
    GemvConfig(64, 64, 1, 2, 4, 4), GemvConfig(64, 128, 1, 2, 4, 3), GemvConfig(128, 64, 1, 2, 4, 4),
    GemvConfig(128, 64, 1, 2, 8, 4), GemvConfig(128, 128, 1, 2, 8, 3), GemvConfig(32, 128, 1, 2, 4, 4),
    GemvConfig(64, 128, 2, 2, 4, 3), GemvConfig(64, 64, 1, 1, 4, 4), GemvConfig(128, 64, 1, 1, 8, 4),
]  # fmt: skip


def time_graph(fn, xs: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """µs per call: CALLS calls cycling over the weight copies, captured once, replayed."""
    graph, _ = capture(lambda: [fn(xs, weights[i % len(weights)]) for i in range(CALLS)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / CALLS)
    del graph
    return best


def check(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst error in bf16 ulps of the reference (a different fp32 summation order moves a few)."""
    ulp = (want.float().abs() * 2**-7).clamp_min(want.float().abs().max() * 2**-12)
    return ((got.float() - want.float()).abs() / ulp).max().item()


def main(quick: bool, ms: list[int], only: str) -> None:
    ms = ms or ([1, 8] if quick else [1, 2, 4, 8])
    t0 = time.time()
    print(f"{'shape':<14}{'M':>2}{'cuBLAS us':>10}{'GB/s':>6}{'gemv us':>9}{'GB/s':>6}{'x':>6}"
          f"{'best us':>9}{'GB/s':>6}{'ulps':>6}  best tile (n, k, split, mode, warps, stages)")  # fmt: skip
    totals = {"cublas": 0.0, "default": 0.0, "best": 0.0}
    for name, (rows, k, silu) in SHAPES.items():
        if not name.startswith(only):
            continue
        nbytes = rows * k * 2
        copies = max(2, -(-L2_FLOOR // nbytes))
        weights = [torch.randn(rows, k, device=DEV, dtype=DT) * k**-0.5 for _ in range(copies)]
        n = rows // 2 if silu else rows
        for m in ms:
            x = torch.randn(m, k, device=DEV, dtype=DT)
            if silu:
                cublas = time_graph(lambda a, w: fused_ops.silu_mul(F.linear(a, w)), x, weights)
                want = fused_ops.silu_mul(F.linear(x, weights[0]))
            else:
                cublas = time_graph(F.linear, x, weights)
                want = F.linear(x, weights[0])
            default = default_config(m, n, k, silu)
            candidates = CANDIDATES[m == 1, silu] if m <= 8 else WIDE
            tiles = [default] + [c for c in candidates if c != default]
            results = []
            for cfg in tiles:
                try:
                    us = time_graph(lambda a, w, c=cfg, s=silu: gemv(a, w, silu=s, config=c), x, weights)
                except OutOfResources:  # e.g. a wide tile's pipeline past the SM's shared memory
                    if cfg == default:
                        raise
                    continue
                results.append((us, cfg, check(gemv(x, weights[0], silu=silu, config=cfg), want)))
            best = min(results)
            print(f"{name:<14}{m:>2}{cublas:>10.2f}{nbytes / cublas / 1e3:>6.0f}{results[0][0]:>9.2f}{nbytes / results[0][0] / 1e3:>6.0f}"
                  f"{cublas / results[0][0]:>6.2f}{best[0]:>9.2f}{nbytes / best[0] / 1e3:>6.0f}"
                  f"{max(r[2] for r in results):>6.1f}  {tuple(best[1])}")  # fmt: skip
            if m == 1 and name.startswith("ouro"):
                totals["cublas"] += cublas
                totals["default"] += results[0][0]
                totals["best"] += best[0]
        del weights
        torch.cuda.empty_cache()
    c, d, b = (totals[key] * LAYER_LOOPS / 1e3 for key in ("cublas", "default", "best"))
    if c:
        print(f"Ouro-1.4B M=1 projections per token ({LAYER_LOOPS} layer-loops): cuBLAS (+silu_mul) {c:.2f} ms, "
              f"gemv default {d:.2f} ms, best tiles {b:.2f} ms (saving {c - d:.2f} / {c - b:.2f} ms)")  # fmt: skip
    print(f"[{time.time() - t0:.0f} s]")


def _flag(name: str) -> str:
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else ""


if __name__ == "__main__":
    main("--quick" in sys.argv[1:], [int(m) for m in _flag("--m").split(",") if m], _flag("--only"))
