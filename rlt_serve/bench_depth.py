"""Speedup of self-speculation and early exit against what they measured, as markdown tables.

Random weights make acceptance and exit rates meaningless on their own, so each row reports the
speedup over plain decoding of the same prompts next to the acceptance rate (speculation) or the
mean loops per sampled token (early exit) it was obtained at. Agreement between shallow and deep
predictions is set by the checkpoint's update scale (`make-random-checkpoint --update-scale`),
so one sweep over a few scales traces speedup against acceptance.

The speedup is a paired measurement, because it is often a few percent while separate engines
measured one after another read the same plain workload up to 25% apart. For one checkpoint the engines
of every mode (plain, each fixed K:d, each adaptive K) are alive at once, each with a KV pool sized
for the workload, and serve every concurrency (max_num_seqs is the largest; each is warmed up once
there). Per concurrency each mode first runs one untimed full-length wave (adaptive K learns its
costs per batch size, as a long-running server has), then `runs` rounds follow, each one run of
every mode in turn (the order rotated per round), so drift in clocks or host load hits every mode
alike. A mode's speedup is the median over rounds of its tok/s over plain's in the same round; the
tables show the min-max of those ratios next to it, and the min-max of each mode's tok/s. Early
exit is paired the same way, its thresholds sharing one engine. Nothing here imports the serving
stack (router, workers), so it runs where only torch and safetensors are installed:

    python -m rlt_serve.bench_depth --model 1.0=/ckpt/s1 --model 0.05=/ckpt/s005 \\
        --concurrency 1 8 32 128 --spec 4:1 4:2 --adaptive 8 --exit-model /ckpt/s005 \\
        --exit-thresholds 1.0 0.9 0.7 0.5 --runs 5 --out table.md
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from collections.abc import Callable
from typing import Any

from rlt_serve.bench import (BenchConfig, DepthStats, _median, _prompts, engine_args, free_device_memory,
                             run_engine_once)
from rlt_serve.config import EngineConfig


@dataclass
class Row:
    checkpoint: str  # its label (the update scale)
    concurrency: int
    mode: str  # "plain", "K=4 d=1", "adaptive K<=8", "q=0.7"
    output_tps: float  # median of the mode's timed runs
    speedup: float  # median over rounds of tok/s over the baseline's (plain, or q = 1.0) in the same round
    acceptance_rate: float
    mean_loops: float
    core_calls_per_token: float
    output_len: int  # output tokens per request of this mode's runs
    round_tps: list[float]  # its timed runs, round by round
    round_speedup: list[float]  # the paired ratio of each round


@dataclass
class Arm:
    """One mode of a paired comparison: its engine (arms may share one) and its requests' settings."""

    name: str
    engine: Any
    output_len: int
    exit_threshold: float | None = None


def warm_up(engine: Any, cfg: BenchConfig, exit_thresholds: list[float | None]) -> None:
    """One short wave at the largest concurrency per threshold: kernels for prefill and decode
    shapes compile and the allocator grows before anything is timed."""
    for i, q in enumerate(exit_thresholds):
        for _ in range(cfg.warmup):
            prompts = _prompts(cfg.concurrency, cfg.input_len, engine.model_config.vocab_size, 10**6 + i)
            run_engine_once(engine, prompts, min(cfg.output_len, 4), f"warm{i}", cfg.num_loops, q)


def _seed(cfg: BenchConfig, concurrency: int, round_: int, slot: int) -> int:
    """Prompts of one round: the same for every engine (speculation compares like with like), their
    own for each arm sharing an engine (its prefix cache would hit otherwise), fresh every round."""
    return (1 << 40) + ((cfg.seed * 65536 + concurrency) * 1024 + round_) * 64 + slot


def _sum(stats: list[DepthStats]) -> DepthStats:
    return DepthStats(*(sum(getattr(s, f.name) for s in stats) for f in fields(DepthStats)))


def paired_runs(label: str, arms: list[Arm], cfg: BenchConfig, concurrencies: list[int], settle: bool,
                progress: Callable[[list[Row]], None] | None = None) -> list[Row]:  # fmt: skip
    """Per concurrency: an untimed full-length wave of every arm (`settle`), then `cfg.runs`
    rounds of one run per arm, the order rotated per round; arms[0] is the baseline every other
    arm's runs are divided by, round by round. `progress` gets all rows after each concurrency."""
    slots = [sum(a.engine is arm.engine for a in arms[:i]) for i, arm in enumerate(arms)]
    rows: list[Row] = []
    rounds = max(1, cfg.runs)
    for c in concurrencies:
        def run(i: int, round_: int, tag: str) -> Any:
            arm = arms[i]
            prompts = _prompts(c, cfg.input_len, arm.engine.model_config.vocab_size, _seed(cfg, c, round_, slots[i]))
            return run_engine_once(arm.engine, prompts, arm.output_len, f"{tag}{i}", cfg.num_loops, arm.exit_threshold)

        if settle:
            for i in range(len(arms)):
                run(i, 0, "settle")
        tps: list[list[float]] = [[0.0] * rounds for _ in arms]
        depth: list[list[DepthStats]] = [[] for _ in arms]
        for r in range(rounds):
            for j in range(len(arms)):
                i = (r + j) % len(arms)  # rotated: no arm always runs first, or right after another
                before = copy.deepcopy(arms[i].engine.stats())
                res = run(i, r + 1, f"r{r}-")
                tps[i][r] = res.output_tps
                depth[i].append(DepthStats.delta(before, arms[i].engine.stats(), res.output_tokens))
        for i, arm in enumerate(arms):
            ratios = [t / b for t, b in zip(tps[i], tps[0])]  # paired: the same round's baseline
            d = _sum(depth[i])
            rows.append(Row(label, c, arm.name, _median(tps[i]), _median(ratios), d.acceptance_rate, d.mean_loops,
                            d.core_calls_per_token, arm.output_len, tps[i], ratios))  # fmt: skip
        if progress is not None:
            progress(rows)
    return rows


def _spec_arms(path: str, base: BenchConfig, top: int, modes: list[tuple[str, dict[str, Any], int]]) -> list[Arm]:
    """One engine per mode, all alive at once: a KV pool each that holds `top` requests of the
    longest mode (the memory-fraction default would give the first engine most of the device), and
    one max_model_len, so nothing but speculation differs between them."""
    from rlt_serve.engine.llm_engine import LLMEngine

    max_k = max(mode.get("num_speculative_tokens", 0) for _, mode, _ in modes)
    max_len = base.input_len + max(n for _, _, n in modes) + 1 + max_k
    page_size = EngineConfig().page_size
    pages = base.num_kv_pages or top * math.ceil(max_len / page_size)
    arms = []
    for name, mode, output_len in modes:
        cfg = replace(base, model=path, concurrency=top, num_prompts=None, exit_threshold=None, **mode)
        engine = LLMEngine(path, **engine_args(cfg) | dict(max_model_len=max_len, num_kv_pages=pages))
        warm_up(engine, cfg, [None])
        arms.append(Arm(name, engine, output_len))
    return arms


def sweep_speculation(models: dict[str, str], base: BenchConfig, concurrencies: list[int],
                      fixed: list[tuple[int, int]], adaptive: list[int],
                      progress: Callable[[list[Row]], None] | None = None,
                      fixed_output_len: int | None = None) -> list[Row]:  # fmt: skip
    """Plain, fixed K:d and adaptive K, paired per checkpoint. `fixed_output_len`: output tokens
    of the fixed K:d runs (default base.output_len), since a fixed K that does not pay is slow."""
    rows: list[Row] = []
    fixed_len = fixed_output_len or base.output_len
    for label, path in models.items():
        modes: list[tuple[str, dict[str, Any], int]] = [("plain", {}, base.output_len)]
        modes += [(f"K={k} d={d}", dict(num_speculative_tokens=k, speculative_draft_depth=d), fixed_len)
                  for k, d in fixed]  # fmt: skip
        modes += [(f"adaptive K<={k}", dict(num_speculative_tokens=k, speculative_adaptive=True), base.output_len)
                  for k in adaptive]  # fmt: skip
        t0 = time.perf_counter()
        arms = _spec_arms(path, base, max(concurrencies), modes)
        device = arms[0].engine.device
        done = len(rows)
        rows += paired_runs(label, arms, base, concurrencies, settle=True,
                            progress=None if progress is None else lambda new: progress(rows[:done] + new))
        print(f"[bench_depth] {label} {', '.join(a.name for a in arms)}: {time.perf_counter() - t0:.1f}s",
              file=sys.stderr, flush=True)  # fmt: skip
        arms = []
        free_device_memory(device)
    return rows


def sweep_exit(label: str, path: str, base: BenchConfig, concurrencies: list[int], thresholds: list[float],
               progress: Callable[[list[Row]], None] | None = None) -> list[Row]:  # fmt: skip
    """Early exit: one last_exited engine; q is per request, so every threshold shares it (paired
    like speculation; no settling wave, as there is nothing to learn per batch size)."""
    from rlt_serve.engine.llm_engine import LLMEngine

    top = max(concurrencies)
    cfg = replace(base, model=path, concurrency=top, num_prompts=None, exit_threshold=0.5)  # last_exited layout
    engine = LLMEngine(path, **engine_args(cfg))
    device = engine.device
    t0 = time.perf_counter()
    warm_up(engine, cfg, [1.0, min(thresholds)])
    arms = [Arm(f"q={q:g}", engine, base.output_len, q) for q in sorted(thresholds, reverse=True)]  # 1.0: baseline
    rows = paired_runs(label, arms, base, concurrencies, settle=False, progress=progress)
    print(f"[bench_depth] exit {label}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    arms, engine = [], None
    free_device_memory(device)
    return rows


def _f(x: float, fmt: str) -> str:
    return "-" if x != x else format(x, fmt)  # NaN: not applicable


def _tps(r: Row) -> str:
    t = r.round_tps
    return f"{r.output_tps:.1f} ({min(t):.1f}-{max(t):.1f})" if len(t) > 1 else f"{r.output_tps:.1f}"


def _speedup(r: Row) -> str:
    lo, hi = min(r.round_speedup), max(r.round_speedup)
    return f"{r.speedup:.2f}x" + (f" ({lo:.2f}-{hi:.2f})" if lo != hi else "")  # the baseline's are all 1


def render(spec: list[Row], exits: list[Row], header: str) -> str:
    lines = [header, ""]
    if spec:
        lines += ["### Self-speculation: speedup over plain decoding vs measured acceptance", "",
                  "| update scale | concurrency | mode | output tok/s (min-max) | speedup (min-max over rounds) "
                  "| acceptance | core calls / token |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in spec:
            lines.append(f"| {r.checkpoint} | {r.concurrency} | {r.mode} | {_tps(r)} | {_speedup(r)} | "
                         f"{_f(r.acceptance_rate, '.3f')} | {r.core_calls_per_token:.2f} |")  # fmt: skip
        lines.append("")
    if exits:
        lines += ["### Early exit (Q-exit): throughput vs mean exit depth", "",
                  "| update scale | concurrency | threshold | output tok/s (min-max) | speedup vs q=1 (min-max over "
                  "rounds) | mean loops / sampled token | core calls / token |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in exits:
            lines.append(f"| {r.checkpoint} | {r.concurrency} | {r.mode} | {_tps(r)} | {_speedup(r)} | "
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
    p.add_argument("--fixed-output-len", type=int, default=None, metavar="N",
                   help="output tokens of the fixed K:d runs (default --output-len): a K that does not pay is "
                        "slow; their speedup then compares unequal lengths")
    p.add_argument("--runs", type=int, default=5, help="rounds per concurrency: one timed run of every mode each")
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
    fixed_len = f" ({args.fixed_output_len} for fixed K:d)" if args.fixed_output_len else ""
    header = (f"Greedy, {args.input_len}-token random prompts, {args.output_len} output tokens each{fixed_len} "
              "(ignore_eos), all `concurrency` prompts submitted at once. Per concurrency, the engines of all "
              "modes alive at once: an untimed full-length wave of each speculation mode, then "
              f"{max(1, args.runs)} round(s) of one run per mode (order rotated). output tok/s: median (min-max) "
              "of a mode's runs; speedup: median (min-max) over rounds of its tok/s over the baseline's in the "
              "same round.")  # fmt: skip
    done: dict[str, list[Row]] = {"spec": [], "exit": []}

    def write(kind: str) -> Callable[[list[Row]], None]:
        def save(rows: list[Row]) -> None:  # after every concurrency, so a run cut short keeps what it measured
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
        sweep_speculation(models, base, args.concurrency, args.spec, args.adaptive, write("spec"),
                          args.fixed_output_len)
    if args.exit_model:
        label, path = args.exit_model.split("=", 1) if "=" in args.exit_model else ("-", args.exit_model)
        sweep_exit(label, path, base, args.concurrency, args.exit_thresholds, write("exit"))
    print(render(done["spec"], done["exit"], header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
