"""Speedup of self-speculation and early exit against what they measured, as markdown tables.

Random weights make acceptance and exit rates meaningless on their own, so each row reports the
speedup over plain decoding of the same prompts next to the acceptance rate (speculation) or the
mean loops per sampled token (early exit) it was obtained at. Agreement between shallow and deep
predictions is set by the checkpoint's update scale (`make-random-checkpoint --update-scale`),
so one sweep over a few scales traces speedup against acceptance. One engine per (checkpoint,
mode) serves every concurrency: a run submits `concurrency` prompts at once and the engine's
max_num_seqs is the largest concurrency; it is warmed up once at the largest concurrency, and a
speculation engine runs one untimed full-length wave at each concurrency before it is measured
(adaptive K learns its costs per batch size, as a long-running server has). Nothing here imports
the serving stack (router, workers), so it runs where only torch and safetensors are installed:

    python -m rlt_serve.bench_depth --model 1.0=/ckpt/s1 --model 0.05=/ckpt/s005 \\
        --concurrency 1 8 32 128 --spec 4:1 4:2 --adaptive 8 --exit-model /ckpt/s005 \\
        --exit-thresholds 1.0 0.9 0.7 0.5 --out table.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from collections.abc import Callable
from typing import Any

from rlt_serve.bench import (BenchConfig, DepthStats, _median, _prompts, engine_args, free_device_memory, measure,
                             run_engine_once)


@dataclass
class Row:
    checkpoint: str  # its label (the update scale)
    concurrency: int
    mode: str  # "plain", "K=4 d=1", "adaptive K<=8", "q=0.7"
    output_tps: float
    speedup: float  # over plain decoding (speculation) or q = 1.0 (early exit) at this concurrency
    acceptance_rate: float
    mean_loops: float
    core_calls_per_token: float


def warm_up(engine: Any, cfg: BenchConfig, exit_thresholds: list[float | None]) -> None:
    """One short wave at the largest concurrency per threshold: kernels for prefill and decode
    shapes compile and the allocator grows before anything is timed."""
    for i, q in enumerate(exit_thresholds):
        for _ in range(cfg.warmup):
            prompts = _prompts(cfg.concurrency, cfg.input_len, engine.model_config.vocab_size, 10**6 + i)
            run_engine_once(engine, prompts, min(cfg.output_len, 4), f"warm{i}", cfg.num_loops, q)


def _engine_runs(model: str, base: BenchConfig, concurrencies: list[int], exit_threshold: float | None,
                 **mode: Any) -> dict[int, tuple[float, DepthStats]]:  # fmt: skip
    """Build one engine for `mode`, warm it up once, measure each concurrency: c -> (tok/s, stats)."""
    from rlt_serve.engine.llm_engine import LLMEngine

    top = max(concurrencies)
    cfg = replace(base, model=model, concurrency=top, num_prompts=None, exit_threshold=exit_threshold, **mode)
    engine = LLMEngine(model, **engine_args(cfg))
    device = engine.device
    warm_up(engine, cfg, [exit_threshold])
    out: dict[int, tuple[float, DepthStats]] = {}
    for c in concurrencies:
        # A full-length wave at this concurrency first, untimed: adaptive speculation learns its
        # step costs and acceptance per batch size, as a long-running server has.
        run_cfg = replace(cfg, concurrency=c, warmup=1, warmup_output_len=cfg.output_len)
        runs, depth = measure(engine, run_cfg, exit_threshold)
        out[c] = (_median([r.output_tps for r in runs]), depth)
    engine = None
    free_device_memory(device)
    return out


def sweep_speculation(models: dict[str, str], base: BenchConfig, concurrencies: list[int],
                      fixed: list[tuple[int, int]], adaptive: list[int],
                      progress: Callable[[list[Row]], None] | None = None) -> list[Row]:  # fmt: skip
    rows: list[Row] = []
    for label, path in models.items():
        modes: list[tuple[str, dict[str, Any]]] = [("plain", {})]
        modes += [(f"K={k} d={d}", dict(num_speculative_tokens=k, speculative_draft_depth=d)) for k, d in fixed]
        modes += [(f"adaptive K<={k}", dict(num_speculative_tokens=k, speculative_adaptive=True)) for k in adaptive]
        plain: dict[int, float] = {}
        for name, mode in modes:
            t0 = time.perf_counter()
            for c, (tps, depth) in _engine_runs(path, base, concurrencies, None, **mode).items():
                plain.setdefault(c, tps)
                rows.append(Row(label, c, name, tps, tps / plain[c], depth.acceptance_rate, depth.mean_loops,
                                depth.core_calls_per_token))  # fmt: skip
            print(f"[bench_depth] {label} {name}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
            if progress is not None:
                progress(rows)
    return rows


def sweep_exit(label: str, path: str, base: BenchConfig, concurrencies: list[int], thresholds: list[float],
               progress: Callable[[list[Row]], None] | None = None) -> list[Row]:  # fmt: skip
    """Early exit: one last_exited engine; q is per request, so every threshold shares it."""
    from rlt_serve.engine.llm_engine import LLMEngine

    top = max(concurrencies)
    cfg = replace(base, model=path, concurrency=top, num_prompts=None, exit_threshold=0.5)  # last_exited layout
    engine = LLMEngine(path, **engine_args(cfg))
    device = engine.device
    rows: list[Row] = []
    fixed: dict[int, float] = {}
    t0 = time.perf_counter()
    warm_up(engine, cfg, [1.0, min(thresholds)])
    for c in concurrencies:
        for q in sorted(thresholds, reverse=True):  # 1.0 first: the baseline
            run_cfg = replace(cfg, concurrency=c, exit_threshold=q, warmup=0)
            runs, depth = measure(engine, run_cfg, q)
            tps = _median([r.output_tps for r in runs])
            fixed.setdefault(c, tps)
            rows.append(Row(label, c, f"q={q:g}", tps, tps / fixed[c], float("nan"), depth.mean_loops,
                            depth.core_calls_per_token))  # fmt: skip
        if progress is not None:
            progress(rows)
    print(f"[bench_depth] exit {label}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    engine = None
    free_device_memory(device)
    return rows


def _f(x: float, fmt: str) -> str:
    return "-" if x != x else format(x, fmt)  # NaN: not applicable


def render(spec: list[Row], exits: list[Row], header: str) -> str:
    lines = [header, ""]
    if spec:
        lines += ["### Self-speculation: speedup over plain decoding vs measured acceptance", "",
                  "| update scale | concurrency | mode | output tok/s | speedup | acceptance | core calls / token |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in spec:
            lines.append(f"| {r.checkpoint} | {r.concurrency} | {r.mode} | {r.output_tps:.1f} | {r.speedup:.2f}x | "
                         f"{_f(r.acceptance_rate, '.3f')} | {r.core_calls_per_token:.2f} |")  # fmt: skip
        lines.append("")
    if exits:
        lines += ["### Early exit (Q-exit): throughput vs mean exit depth", "",
                  "| update scale | concurrency | threshold | output tok/s | speedup vs q=1 | mean loops / sampled token "
                  "| core calls / token |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in exits:
            lines.append(f"| {r.checkpoint} | {r.concurrency} | {r.mode} | {r.output_tps:.1f} | {r.speedup:.2f}x | "
                         f"{_f(r.mean_loops, '.2f')} | {r.core_calls_per_token:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _pair(text: str) -> tuple[int, int]:
    k, d = text.split(":")
    return int(k), int(d)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlt_serve.bench_depth", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], metavar="LABEL=DIR",
                   help="checkpoint for the speculation sweep, labelled by its update scale (repeat)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--spec", type=_pair, nargs="*", default=[(4, 1)], metavar="K:DEPTH", help="fixed K and draft depth")
    p.add_argument("--adaptive", type=int, nargs="*", default=[8], metavar="K", help="adaptive speculation, K at most")
    p.add_argument("--exit-model", default=None, metavar="[LABEL=]DIR", help="checkpoint for the early-exit sweep")
    p.add_argument("--exit-thresholds", type=float, nargs="*", default=[1.0, 0.9, 0.7, 0.5])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--num-kv-pages", type=int, default=None)
    p.add_argument("--out", default=None, help="also write the markdown here")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    base = BenchConfig(model="", input_len=args.input_len, output_len=args.output_len, runs=args.runs,
                       warmup=args.warmup, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
                       num_kv_pages=args.num_kv_pages, reference=False, max_num_batched_tokens=8192)  # fmt: skip
    header = (f"Greedy, {args.input_len}-token random prompts, {args.output_len} output tokens each (ignore_eos), "
              f"all `concurrency` prompts submitted at once; median of {args.runs} run(s) after an untimed "
              "full-length wave at each concurrency.")  # fmt: skip
    done: dict[str, list[Row]] = {"spec": [], "exit": []}

    def write(kind: str) -> Callable[[list[Row]], None]:
        def save(rows: list[Row]) -> None:  # after every mode, so a run cut short keeps what it measured
            done[kind] = list(rows)
            if args.out:
                with open(args.out, "w", encoding="utf-8") as f:
                    f.write(render(done["spec"], done["exit"], header))
            if args.json:
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump([asdict(r) for r in done["spec"] + done["exit"]], f, indent=2)

        return save

    models = dict(m.split("=", 1) for m in args.model)
    if models:
        sweep_speculation(models, base, args.concurrency, args.spec, args.adaptive, write("spec"))
    if args.exit_model:
        label, path = args.exit_model.split("=", 1) if "=" in args.exit_model else ("-", args.exit_model)
        sweep_exit(label, path, base, args.concurrency, args.exit_thresholds, write("exit"))
    print(render(done["spec"], done["exit"], header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
